"""`not` and `oneOf`: negations as positive keywords, and oneOf branches kept exclusive (a mixin of
json_grammar._Converter)."""

from __future__ import annotations

import fractions
import json
import re
from collections.abc import Iterable, Iterator
from typing import Any

from radixlm.core.runtime.constrained.automata.grammar import Expr
from radixlm.core.runtime.constrained.schema.json_common import (CONFLICT, IGNORED_KEYWORDS, NOT_STRINGS, JSON_TYPES,
                                                                 NOT_MULTIPLE_OF, NOTHING, SchemaError, json_type,
                                                                 with_parts)
from radixlm.core.runtime.constrained.schema.branch_signatures import (const_of, consts_within, excludes,
                                                                       forbidden_keys, joined, pairwise_exclusive,
                                                                       rejects_all)
from radixlm.core.runtime.constrained.schema.json_numbers import MAX_MODULUS
from radixlm.core.runtime.constrained.schema.json_strings import ecma_string_pattern


MAX_NEGATION_DEPTH = 8  # `not` of nested schemas: levels looked into (a recursive schema has no end)
MAX_ONEOF_PAIRS = 4  # `not` of a oneOf: with up to this many branches, the values of each pair too
MAX_EXACT_ONEOF = 400  # oneOf branches split by type that lose values: up to this size (JSON), by `not`
# keywords failed through their subschemas (the applicators, and `required`: a property that must be absent)
SUBSCHEMA_KEYWORDS = frozenset({"patternProperties", "required", "properties", "items", "contains", "prefixItems",
                                "oneOf", "not", "anyOf", "allOf", "propertyNames"})


NAME_KEYWORDS = {"type", "pattern", "maxLength", "minLength", "enum", "const"}  # propertyNames' own
SEES_SIBLINGS = {"additionalProperties", "unevaluatedProperties", "items", "unevaluatedItems"}


class ExclusionRules:
    """`not` (_negation, _without) and oneOf (_exclusive, _excluding, _signature)."""

    def _negation(self, sub: Any, opened: dict, ptr: str, depth: int = 0) -> Any:
        """A schema of positive keywords that values `sub` rejects satisfy, as an anyOf of ways to fail
        it (De Morgan over its keywords, each of which holds for every value but those of its type): a
        type it does not allow, a string, number, array or object past one of its keywords, a value its
        `not` accepts. A keyword with no such form here is left out (a sound subset: fewer values); if
        that leaves nothing, it is refused naming the keywords. `opened` keeps an object that lists no
        keys open (see open_part)."""
        if depth > MAX_NEGATION_DEPTH:  # a recursive schema: its negation would never end
            raise SchemaError(f"{ptr}: 'not' nested deeper than {MAX_NEGATION_DEPTH} levels is not supported")
        try:
            sub, _ = self._deref(sub, ())
        except ValueError as e:
            raise SchemaError(f"{ptr}/$ref: {e}") from None
        if sub is True or sub == {}:
            return False
        if sub is False:
            return True
        if not isinstance(sub, dict):
            raise SchemaError(f"{ptr}: a JSON schema must be an object or a boolean, got {sub!r}")
        if isinstance(sub.get("allOf"), list) and SEES_SIBLINGS & set(sub):
            # additionalProperties (items) beside an allOf also covers the keys (prefix items) its parts list:
            # negated keyword by keyword, a part's `properties: {foo: {}}` alone would have no failure.
            try:
                merged = self._merge(sub["allOf"] + [{k: v for k, v in sub.items() if k != "allOf"}], ())
            except ValueError:
                merged = None  # negated as it is
            if merged is False:
                return True
            if isinstance(merged, dict) and "allOf" not in merged:
                sub = merged
        body = {k: v for k, v in sub.items() if k not in IGNORED_KEYWORDS}
        types = body.get("type")
        types = None if types is None else {types} if isinstance(types, str) else set(types)
        if types is not None and body.get("nullable") is True:  # OpenAPI's nullable widens the type
            types.add("null")
        ways, skipped = [], ["format"] if "format" in sub and self.formats_asserted else []
        if types is not None:  # a value of another type fails it
            others = ({"type": sorted(set(JSON_TYPES) - types)} if types <= set(JSON_TYPES)
                      else {"not": {"type": body["type"]}})
            ways.append(others)

        def of_type(kind: str, schema: dict) -> None:
            if kind == "number" and types is not None and "number" not in types:
                kind = "integer"  # {"type": "integer", "minimum": 3}: the integers below 3
            if types is None or kind in types or kind == "integer" and "number" in types:
                ways.append({"type": kind, **schema})

        for key, value in body.items():
            way = self._failing(key, value, body, opened, ptr, depth + 1)
            if way is None:
                skipped.append(key)
            else:
                for kind, schema in way:
                    if kind is None:
                        ways.append(schema)
                    else:
                        of_type(kind, schema)
        if not ways and skipped:
            raise SchemaError(f"{ptr}: 'not' of {', '.join(sorted(skipped))} is not supported (supported: types, "
                              "string/number/array/object bounds, pattern, string constants, required, properties, "
                              "propertyNames, items, contains, not, anyOf, allOf)")
        if not ways:
            return False  # its keywords hold for every value
        return ways[0] if len(ways) == 1 else {"anyOf": ways}

    def _failing(self, key: str, value: Any, body: dict, opened: dict, ptr: str, depth: int) -> list | None:
        """The ways a value fails keyword `key` of a `not`'s schema, as (type or None, schema) pairs;
        [] when every value passes it; None when there is no positive form here."""
        if key in SUBSCHEMA_KEYWORDS:
            return self._failing_subschemas(key, value, body, opened, ptr, depth)
        return self._failing_assertion(key, value, body, opened, ptr)

    def _failing_assertion(self, key: str, value: Any, body: dict, opened: dict, ptr: str) -> list | None:
        """_failing for a keyword that asserts on the value itself (type, bounds, pattern, enum...)."""
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        flips = {"minimum": "exclusiveMaximum", "maximum": "exclusiveMinimum", "exclusiveMinimum": "maximum",
                 "exclusiveMaximum": "minimum"}
        counts = {"minLength": ("string", "maxLength"), "minItems": ("array", "maxItems"),
                  "minProperties": ("object", "maxProperties")}
        if key in ("type", "nullable"):
            return []  # _negation's first way
        if key in flips and number:
            return [("number", {flips[key]: value})]
        if key in counts and number:  # fewer than the minimum
            kind, upper = counts[key]
            return [(kind, {upper: int(value) - 1})] if value > 0 else []
        lower = {upper: (kind, low) for low, (kind, upper) in counts.items()}
        if key in lower and number:  # more than the maximum
            kind, low = lower[key]
            return [(kind, {low: int(value) + 1})]
        if key == "pattern" and isinstance(value, str):
            try:
                return [("string", {NOT_STRINGS: [f'"{ecma_string_pattern(value)}"']})]
            except ValueError as e:
                raise SchemaError(f"{ptr}/pattern: {e}") from None
        if key in ("enum", "const"):
            values = body["enum"] if key == "enum" else [body["const"]]
            if not isinstance(values, list):
                return None
            return _other_than(values) + _other_containers(values, opened)
        if key == "multipleOf" and number and value > 0:  # a number that is not a multiple
            step = fractions.Fraction(repr(value))
            ways = [("integer", {NOT_MULTIPLE_OF: [step.numerator, step.denominator]})] \
                if 1 < step.numerator <= MAX_MODULUS else []
            if step.denominator == 1:  # of a whole number: every number that is not an integer too
                ways.append((None, {"type": "number", "not": {"type": "integer"}}))
            return ways or None  # past MAX_MODULUS, or 1/q: left out (a sound subset)
        return None

    def _each_failing(self, subs: Iterable[tuple[Any, Any]], where: str, depth: int) -> Iterator[tuple[Any, Any]]:
        """(key, failing schema) of each (key, subschema) of `subs` that some value fails; one whose
        failures this converter cannot write is left out (a sound subset)."""
        for key, sub in subs:
            try:
                failing = self._negation(sub, {}, f"{where}/{key}", depth)
            except SchemaError:
                continue
            if failing is not False:
                yield key, failing

    def _failing_subschemas(self, key: str, value: Any, body: dict, opened: dict, ptr: str,
                            depth: int) -> list | None:
        """_failing for a keyword of SUBSCHEMA_KEYWORDS: a value fails it through its subschemas' failures."""
        if key == "patternProperties" and isinstance(value, dict):
            # Objects whose keys all match one pattern, and whose values all fail its schema (at least one
            # key): a sound subset of those with some matching key's value failing it.
            return [("object", {"propertyNames": {"pattern": pattern}, "minProperties": 1,
                                "patternProperties": {pattern: failing}, "additionalProperties": False})
                    for pattern, failing in self._each_failing(value.items(), f"{ptr}/patternProperties", depth)]
        if key == "required" and isinstance(value, list):
            return [("object", {"properties": {r: False}, **opened}) for r in value]
        if key == "propertyNames" and isinstance(value, (dict, bool)):
            # An object with a key that fails `value`: one of the names that fail it where they are listed
            # (exact), else an object all of whose keys fail it (a sound subset).
            failing = self._negation(value, {}, f"{ptr}/propertyNames", depth)
            if failing is False:
                return []
            if isinstance(failing, dict) and failing and set(failing) <= {"enum", "const"}:
                return [("object", {"required": [name], **opened}) for name in const_of(failing) or ()
                        if isinstance(name, str)]
            names = failing if failing is True or isinstance(failing, dict) and set(failing) <= NAME_KEYWORDS \
                else {"not": value}  # as json_objects reads propertyNames
            return [("object", {"propertyNames": names, "minProperties": 1, **opened})]
        if key == "properties" and isinstance(value, dict):
            return [("object", {"required": [name], "properties": {name: failing}, **opened})
                    for name, failing in self._each_failing(value.items(), f"{ptr}/properties", depth)]
        if key == "items" and isinstance(value, (dict, bool)) and "prefixItems" not in body:
            failing = self._negation(value, {}, f"{ptr}/items", depth)
            return [] if failing is False else [("array", {"contains": failing})]
        if key == "contains" and not {"minContains", "maxContains"} & set(body):
            return [("array", {"items": self._negation(value, {}, f"{ptr}/contains", depth)})]
        if key == "prefixItems" and isinstance(value, list):  # an item at position i failing its schema
            return [("array", {"minItems": i + 1, "prefixItems": [True] * i + [failing]})
                    for i, failing in self._each_failing(enumerate(value), f"{ptr}/prefixItems", depth)]
        if key == "oneOf" and isinstance(value, list) and value:
            # no branch matches (each one's failures), or two do (a few branches: each pair's values)
            ways = [(None, {"allOf": [b, c]}) for i, b in enumerate(value) for c in value[i + 1:]
                    if len(value) <= MAX_ONEOF_PAIRS]
            try:
                none = [self._negation(b, opened, f"{ptr}/oneOf/{i}", depth) for i, b in enumerate(value)]
                ways.append((None, {"allOf": none}))
            except SchemaError:
                pass  # left out (a sound subset)
            return ways or None
        if key == "not":
            return [(None, value)]
        if key in ("anyOf", "allOf") and isinstance(value, list) and value:
            flip = "allOf" if key == "anyOf" else "anyOf"
            return [(None, {flip: [self._negation(b, opened, f"{ptr}/{key}/{i}", depth) for i, b in enumerate(value)]})]
        return None

    def _without(self, types: list[str], sub: Any, ptr: str) -> list[str]:
        if sub is True or sub == {}:
            return []
        if isinstance(sub, dict) and set(sub) - IGNORED_KEYWORDS == {"type"}:
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
        if pairwise_exclusive(sigs):
            return self._convertible(branches, ptr)
        kept, kept_sigs = [], []
        for i, (branch, sig) in enumerate(zip(branches, sigs)):
            others = set().union(*(s["types"] for j, s in enumerate(sigs) if j != i))
            types = {t for t in sig["types"] if t not in others and not (t == "number" and "integer" in others)}
            if types:
                kept.append(with_parts(branch, {"type": sorted(types - {"integer"} if "number" in types else types)}))
                kept_sigs.append(dict(sig, types=types | ({"integer"} if "number" in types else set())))
        if kept and pairwise_exclusive(kept_sigs):
            lost = len(kept) < len(branches) or any(k["types"] != s["types"] for k, s in zip(kept_sigs, sigs))
            if lost and len(json.dumps(branches, default=str)) <= MAX_EXACT_ONEOF and '"$ref"' not in \
                    json.dumps(branches, default=str):
                # Small branches: each excluding the others keeps the values the type split drops
                # ({"oneOf": [integer, {"minimum": 2}]}: 1 and 2.5), where `not` can say them all.
                rules, ref_rules, converted = dict(self.rules), dict(self.ref_rules), dict(self.converted)
                try:
                    exact = self._excluding(branches, own, sigs, ptr)
                    if len(exact) >= len(kept):
                        return exact
                except SchemaError:
                    pass
                self.rules, self.ref_rules, self.converted = rules, ref_rules, converted
            return [self.value(b, f"{ptr}/{i}") for i, b in enumerate(kept)]
        return self._excluding(branches, own, sigs, ptr)

    def _excluding(self, branches: list[Any], own: list[Any], sigs: list[dict], ptr: str) -> list[Expr]:
        """Branches that may overlap, each as `allOf: [branch, not: other, ...]` for the others it may
        overlap (`own`: the branches without the keywords beside oneOf, which every branch has); a
        branch whose exclusions `not` cannot express is dropped (a sound subset)."""
        kept, first_error = [], None
        for i, branch in enumerate(branches):
            overlapping = [b for j, b in enumerate(own)
                           if j != i and not (excludes(sigs[i], sigs[j]) and excludes(sigs[j], sigs[i]))]
            candidate = with_parts(branch, *({"not": b} for b in overlapping))
            expr = self._attempt(candidate, f"{ptr}/{i}")
            if isinstance(expr, SchemaError):
                first_error = first_error or expr
            elif expr != NOTHING:
                kept.append(expr)
        if not kept and first_error is None:  # (or `not` left out what would tell the branches apart)
            raise SchemaError(f"{ptr}: no value matches exactly one branch that 'not' can express (its branches "
                              "may overlap)")
        if not kept:
            raise SchemaError(f"{ptr}: its branches may overlap, and no branch could exclude the others "
                              f"({first_error})")
        return kept

    def _convertible(self, branches: list[Any], ptr: str) -> list[Expr]:
        """Exclusive branches' grammars, less those refused (SchemaError): dropped, as _excluding drops
        one, so that a oneOf keeps the same branches whichever way its exclusion is shown; the first
        refusal is raised if every branch is refused."""
        kept, first_error = [], None
        for i, branch in enumerate(branches):
            expr = self._attempt(branch, f"{ptr}/{i}")
            if isinstance(expr, SchemaError):
                first_error = first_error or expr
            else:
                kept.append(expr)
        if first_error is not None and not kept:
            raise first_error
        return kept

    def _attempt(self, schema: Any, ptr: str) -> Expr | SchemaError:
        """value(schema), or the SchemaError it raised, with the rules as they were before (a refused
        conversion may leave rules half made)."""
        rules, ref_rules, converted = dict(self.rules), dict(self.ref_rules), dict(self.converted)
        try:
            return self.value(schema, ptr)
        except SchemaError as e:
            self.rules, self.ref_rules, self.converted = rules, ref_rules, converted
            return e.with_traceback(None)  # its frames hold this one (and self): no cycle kept for the collector


    def _signature(self, schema: Any, depth: int = 0) -> dict:
        """What a branch's outputs look like, as far as telling branches apart needs."""
        schema, _ = self._deref(schema, ())
        if schema is False or isinstance(schema, dict) and any(p is False for p in schema.get("allOf", ())):
            return {"types": set(), "consts": None}  # matches nothing: excludes every other branch
        if isinstance(schema, dict) and "allOf" in schema:
            schema = self._merge(schema["allOf"] + [{k: v for k, v in schema.items() if k != "allOf"}], ())
        if not isinstance(schema, dict):
            return {"types": set(JSON_TYPES) | {"integer"}, "consts": None}
        if len(schema) == 1 and isinstance(schema.get("anyOf", schema.get("oneOf")), list) and depth < 8:
            # A choice alone (what a merge of choices gives): what all its branches' outputs share, its
            # branches that admit no value left out.
            sigs = [self._signature(b, depth + 1) for b in schema.get("anyOf", schema.get("oneOf"))]
            return joined([s for s in sigs if not excludes(s, s)])
        if schema.get("const") is CONFLICT:
            return {"types": set(), "consts": None}
        consts = None
        if "const" in schema:
            consts = [schema["const"]]
        elif isinstance(schema.get("enum"), list):
            consts = schema["enum"]
        if consts is not None:
            types = {json_type(c) for c in consts}
        else:
            t = schema.get("type", list(JSON_TYPES))
            types = {t} if isinstance(t, str) else set(t)
            choice = schema.get("anyOf", schema.get("oneOf"))
            if isinstance(choice, list) and depth < 8:  # the types its branches allow, within its own
                inner = set().union(*(self._signature(b, depth + 1)["types"] for b in choice))
                types = types | ({"integer"} if "number" in types else set())
                types = types & inner | ({"integer"} if "number" in types & inner else set())
            elif choice is not None or "not" in schema:
                types = set(JSON_TYPES)
        if "number" in types:
            types.add("integer")
        if schema.get("nullable") is True:
            types.add("null")
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        closed = "additionalProperties" not in schema and bool(props) or rejects_all(extra)
        return {"types": types, "consts": consts, "required": set(schema.get("required") or []),
                "props": set(props) | set(schema.get("required") or []), "closed": closed and not schema.get("patternProperties"),
                "forbids": forbidden_keys(schema), "pattern": schema.get("pattern"),
                "prop_consts": {k: consts_within(v) for k, v in props.items() if consts_within(v) is not None},
                "prop_not_consts": {k: const_of(v["not"]) for k, v in props.items()
                                    if isinstance(v, dict) and const_of(v.get("not")) is not None}}


def _other_than(values: list) -> list:
    """The ways a value differs from each of `values` (strings, numbers, booleans, null): any value but
    those strings; numbers in the open intervals between those numbers; the other boolean."""
    strings = [re.escape(json.dumps(v, ensure_ascii=False)) for v in values if isinstance(v, str)]
    if len(strings) == len(values):
        return [(None, {NOT_STRINGS: strings})]
    numbers = sorted({v for v in values if json_type(v) in ("integer", "number")})
    kinds = {"number" if json_type(v) == "integer" else json_type(v) for v in values}
    ways = [(None, {"type": sorted(set(JSON_TYPES) - kinds)})]
    if strings:
        ways.append(("string", {NOT_STRINGS: strings}))
    if numbers:
        ways += [("number", {"exclusiveMaximum": numbers[0]}), ("number", {"exclusiveMinimum": numbers[-1]})]
        ways += [("number", {"exclusiveMinimum": a, "exclusiveMaximum": b}) for a, b in zip(numbers, numbers[1:])]
    ways += [("boolean", {"const": b}) for b in (True, False)
             if "boolean" in kinds and not any(v is b for v in values)]
    return ways


def _other_containers(values: list, opened: dict) -> list:
    """The ways an array or object differs from each of the arrays and objects among `values`: another size
    than theirs; with one of them of its size, another item at some position, or without one of its keys
    or another value there. Sizes with several of them are left out (a sound subset)."""
    ways = []
    for kind, low, high in (("array", "minItems", "maxItems"), ("object", "minProperties", "maxProperties")):
        listed = [v for v in values if json_type(v) == kind]
        shape = opened if kind == "object" else {}
        sizes = sorted({len(v) for v in listed})
        if not sizes:
            continue
        ways += [(kind, {high: sizes[0] - 1, **shape})] if sizes[0] else []
        ways += [(kind, {low: a + 1, high: b - 1, **shape}) for a, b in zip(sizes, sizes[1:]) if b > a + 1]
        ways.append((kind, {low: sizes[-1] + 1, **shape}))
        for n in sizes:
            same = [v for v in listed if len(v) == n]
            if len(same) != 1 or not n:
                continue
            exact = {low: n, high: n}
            if kind == "array":
                ways += [(kind, {**exact, "prefixItems": [True] * i + [{"not": {"const": item}}]})
                         for i, item in enumerate(same[0])]
            else:
                ways += [(kind, {**exact, **shape, "properties": {k: False}}) for k in same[0]]
                ways += [(kind, {**exact, **shape, "required": [k], "properties": {k: {"not": {"const": v}}}})
                         for k, v in same[0].items()]
    return ways


def types_only(sub: Any) -> bool:
    """Whether `not: sub` only removes types (value() filters the types for it)."""
    return sub is True or sub == {} or isinstance(sub, dict) and set(sub) - IGNORED_KEYWORDS == {"type"}
