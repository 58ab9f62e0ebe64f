"""`not` and `oneOf`: negations as positive keywords, and oneOf branches kept exclusive (a mixin of
json_grammar._Converter)."""

from __future__ import annotations

import json
import re
from typing import Any

from radixlm.core.constrained.grammar import Expr
from radixlm.core.constrained.json_common import (
    _CONFLICT, _IGNORED, _NOT_STRINGS, _TYPES, NOTHING, SchemaError, _json_type)
from radixlm.core.constrained.json_strings import ecma_string_pattern


class ExclusionRules:
    """`not` (_negation, _without) and oneOf (_exclusive, _excluding, _signature)."""


    def _negation(self, sub: Any, opened: dict, ptr: str) -> Any:
        """A schema of positive keywords that the values `sub` rejects satisfy: keys of `required` absent
        (one of them, at least), strings matching no `pattern`/`enum`/`const`, and anyOf/allOf of those
        (De Morgan). `opened` keeps an object that lists no keys open (see _opened)."""
        sub, _ = self._deref(sub, ())
        if sub is True or sub == {}:
            return False
        if sub is False:
            return True
        body = {k: v for k, v in sub.items() if k not in _IGNORED} if isinstance(sub, dict) else None
        if body is not None and set(body) == {"type"}:  # the other types ("integer" alone has no complement)
            excluded = {body["type"]} if isinstance(body["type"], str) else set(body["type"])
            if excluded <= set(_TYPES):
                return {"type": [t for t in _TYPES if t not in excluded]}
        if (body and set(body) <= {"type", "properties"} and body.get("type", "object") == "object"
                and isinstance(body.get("properties"), dict) and body["properties"]):
            # not (objects whose listed keys, where present, match): an object with a key whose value
            # fails its schema (and, where `type: object` is said, any value that is not an object)
            present = [{"type": "object", "required": [k], "properties": {k: self._negation(v, {}, ptr)}, **opened}
                       for k, v in body["properties"].items()]
            others = [{"type": [t for t in _TYPES if t != "object"]}] if "type" in body else []
            return {"anyOf": [*others, *present]}
        flips = {"minimum": "exclusiveMaximum", "maximum": "exclusiveMinimum", "exclusiveMinimum": "maximum",
                 "exclusiveMaximum": "minimum"}
        if (body and set(body) - {"type"} and set(body) <= {"type", *flips} and body.get("type", "number") == "number"
                and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                        for k, v in body.items() if k != "type")):
            # Bounds hold for every value but numbers: their negation is a number past one of them (and,
            # where `type: number` is said, any value that is not a number).
            past = [{"type": "number", flips[k]: v} for k, v in body.items() if k != "type"]
            others = [{"type": [t for t in _TYPES if t != "number"]}] if "type" in body else []
            return {"anyOf": [*others, *past]}
        if body is not None and len(body) == 1 and isinstance(body.get("anyOf", body.get("allOf")), list):
            flip = "allOf" if "anyOf" in body else "anyOf"
            return {flip: [self._negation(b, opened, ptr) for b in next(iter(body.values()))]}
        kind = body.get("type") if body else None
        props = body.get("properties", {}) if body else None
        if (body and kind in (None, "object") and body.get("required") and set(body) <= {"type", "required", "properties"}
                and isinstance(props, dict) and all(v is True or v == {} for v in props.values())):
            # `required` holds for every value but objects: its negation is an object without one of the
            # keys (and, where `type: object` is said, any value that is not an object).
            absent = [{"type": "object", "properties": {r: False}, **opened} for r in body["required"]]
            absent += [{"type": [t for t in _TYPES if t != "object"]}] if "type" in body else []
            return absent[0] if len(absent) == 1 else {"anyOf": absent}
        if body and kind in (None, "string") and set(body) - {"type"} and set(body) <= {"type", "pattern", "enum", "const"}:
            values = list(body.get("enum", [])) + ([body["const"]] if "const" in body else [])
            if all(isinstance(v, str) for v in values):
                excluded = [re.escape(json.dumps(v, ensure_ascii=False)) for v in values]
                if "pattern" in body:
                    try:
                        excluded.append(f'"{ecma_string_pattern(body["pattern"])}"')
                    except ValueError as e:
                        raise SchemaError(f"{ptr}/pattern: {e}") from None
                if set(body) == {"pattern"}:  # a pattern holds for every value but strings
                    return {_NOT_STRINGS: excluded, "type": "string"}
                return {_NOT_STRINGS: excluded}
        raise SchemaError(f"{ptr}: only 'not' of types, of required keys, of string patterns or constants, and "
                          "anyOf/allOf of those, is supported")

    def _without(self, types: list[str], sub: Any, ptr: str) -> list[str]:
        if sub is True or sub == {}:
            return []
        if isinstance(sub, dict) and set(sub) - _IGNORED == {"type"}:
            excluded = {sub["type"]} if isinstance(sub["type"], str) else set(sub["type"])
            if "number" in excluded:
                excluded.add("integer")
            # Numbers that are not integers: the ones with a fraction that is not zero.
            return ["fraction" if t == "number" and "integer" in excluded else t for t in types if t not in excluded]
        raise SchemaError(f"{ptr}/not: only 'not' of types is supported")


    def _exclusive(self, branches: list[Any], own: list[Any], ptr: str) -> list[Expr]:
        """oneOf's branches, each generating only values no other branch accepts. When the branches
        do not exclude each other as they are, each is kept to the types no other branch allows (a
        number type is dropped if another branch allows integers); a branch left with none is dropped.
        Failing that, each branch excludes the others with `not` (_excluding)."""
        sigs = [self._signature(b) for b in branches]
        if _pairwise_exclusive(sigs):
            return [self.value(b, f"{ptr}/{i}") for i, b in enumerate(branches)]
        kept, kept_sigs = [], []
        for i, (branch, sig) in enumerate(zip(branches, sigs)):
            others = set().union(*(s["types"] for j, s in enumerate(sigs) if j != i))
            types = {t for t in sig["types"] if t not in others and not (t == "number" and "integer" in others)}
            if types:
                kept.append({"allOf": [branch, {"type": sorted(types - {"integer"} if "number" in types else types)}]})
                kept_sigs.append(dict(sig, types=types | ({"integer"} if "number" in types else set())))
        if kept and _pairwise_exclusive(kept_sigs):
            return [self.value(b, f"{ptr}/{i}") for i, b in enumerate(kept)]
        return self._excluding(branches, own, sigs, ptr)

    def _excluding(self, branches: list[Any], own: list[Any], sigs: list[dict], ptr: str) -> list[Expr]:
        """Branches that may overlap, each as `allOf: [branch, not: other, ...]` for the others it may
        overlap (`own`: the branches without the keywords beside oneOf, which every branch has); a
        branch whose exclusions `not` cannot express is dropped (a sound subset)."""
        kept, first_error = [], None
        for i, branch in enumerate(branches):
            overlapping = [b for j, b in enumerate(own)
                           if j != i and not (_excludes(sigs[i], sigs[j]) and _excludes(sigs[j], sigs[i]))]
            candidate = {"allOf": [branch, *({"not": b} for b in overlapping)]}
            expr = self._attempt(candidate, f"{ptr}/{i}")
            if isinstance(expr, SchemaError):
                first_error = first_error or expr
            elif expr != NOTHING:
                kept.append(expr)
        if not kept and first_error is None:
            raise SchemaError(f"{ptr}: no value matches exactly one branch")
        if not kept:
            raise SchemaError(f"{ptr}: its branches may overlap, and no branch could exclude the others "
                              f"({first_error})")
        return kept

    def _attempt(self, schema: Any, ptr: str) -> Expr | SchemaError:
        """value(schema), or the SchemaError it raised, with the rules as they were before (a refused
        conversion may leave rules half made)."""
        rules, ref_rules = dict(self.rules), dict(self.ref_rules)
        try:
            return self.value(schema, ptr)
        except SchemaError as e:
            self.rules, self.ref_rules = rules, ref_rules
            return e


    def _signature(self, schema: Any, depth: int = 0) -> dict:
        """What a branch's outputs look like, as far as telling branches apart needs."""
        schema, _ = self._deref(schema, ())
        if schema is False or isinstance(schema, dict) and any(p is False for p in schema.get("allOf", ())):
            return {"types": set(), "consts": None}  # matches nothing: excludes every other branch
        if isinstance(schema, dict) and "allOf" in schema:
            schema = self._merge(schema["allOf"] + [{k: v for k, v in schema.items() if k != "allOf"}], ())
        if not isinstance(schema, dict):
            return {"types": set(_TYPES) | {"integer"}, "consts": None}
        if schema.get("const") is _CONFLICT:
            return {"types": set(), "consts": None}
        consts = None
        if "const" in schema:
            consts = [schema["const"]]
        elif isinstance(schema.get("enum"), list):
            consts = schema["enum"]
        if consts is not None:
            types = {_json_type(c) for c in consts}
        else:
            t = schema.get("type", list(_TYPES))
            types = {t} if isinstance(t, str) else set(t)
            choice = schema.get("anyOf", schema.get("oneOf"))
            if isinstance(choice, list) and depth < 8:  # the types its branches allow, within its own
                inner = set().union(*(self._signature(b, depth + 1)["types"] for b in choice))
                types = types | ({"integer"} if "number" in types else set())
                types = types & inner | ({"integer"} if "number" in types & inner else set())
            elif choice is not None or "not" in schema:
                types = set(_TYPES)
        if "number" in types:
            types.add("integer")
        if schema.get("nullable") is True:
            types.add("null")
        props = schema.get("properties") or {}
        closed = "additionalProperties" not in schema and bool(props) or schema.get("additionalProperties") is False
        return {"types": types, "consts": consts, "required": set(schema.get("required") or []),
                "props": set(props) | set(schema.get("required") or []), "closed": closed and not schema.get("patternProperties"),
                "prop_consts": {k: _const_of(v) for k, v in props.items() if _const_of(v) is not None},
                "prop_not_consts": {k: _const_of(v["not"]) for k, v in props.items()
                                    if isinstance(v, dict) and _const_of(v.get("not")) is not None}}



def _pairwise_exclusive(sigs: list[dict]) -> bool:
    return all(_excludes(a, b) and _excludes(b, a) for i, a in enumerate(sigs) for b in sigs[i + 1:])


def _const_of(schema: Any) -> list | None:
    if isinstance(schema, dict):
        if "const" in schema:
            return [schema["const"]]
        if isinstance(schema.get("enum"), list):
            return schema["enum"]
    return None


def _excludes(a: dict, b: dict) -> bool:
    """Whether every output generated for branch a fails branch b."""
    if a["consts"] is not None:
        others = b["consts"]
        if others is not None:
            return all(c not in others for c in a["consts"])
        return all(_json_type(c) not in b["types"] for c in a["consts"])
    if not (a["types"] & b["types"]):
        return True
    if a["types"] & b["types"] - {"object"}:
        return False
    # Both may be objects: a's objects fail b when b requires a key a never writes, or a required key of
    # a holds constants b's schema for that key does not allow.
    if a.get("closed") and b.get("required", set()) - a.get("props", set()):
        return True
    for key, values in a.get("prop_consts", {}).items():
        other = b.get("prop_consts", {}).get(key)
        if key in a.get("required", set()) and other is not None and all(v not in other for v in values):
            return True
        if key in a.get("required", set()) and all(v in b.get("prop_not_consts", {}).get(key, ()) for v in values):
            return True  # b's schema for the key is `not` of a list holding all of a's values
    for key, excluded in a.get("prop_not_consts", {}).items():
        other = b.get("prop_consts", {}).get(key)
        if key in a.get("required", set()) and other is not None and all(v in excluded for v in other):
            return True
    return False



def _types_only(sub: Any) -> bool:
    """Whether `not: sub` only removes types (value() filters the types for it)."""
    return sub is True or sub == {} or isinstance(sub, dict) and set(sub) - _IGNORED == {"type"}
