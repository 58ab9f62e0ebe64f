"""allOf: parts merged into one schema (a mixin of json_grammar._Converter over schema_merge.py's merge)."""

from __future__ import annotations

import json
import math
from typing import Any

from radixlm.core.runtime.constrained.schema.json_common import (CONFLICT, LOWER_BOUNDS, NEGATED,
                                                                 NOT_STRINGS, SCHEMA_VALUED, UPPER_BOUNDS,
                                                                 NOT_MULTIPLE_OF, mark_negated, pattern_matches,
                                                                 same_json, type_set, with_parts)
from radixlm.core.runtime.constrained.schema.json_conditional import discriminated, through_if_branch


# The keywords that constrain values (JSON Schema 2020-12 and earlier drafts, OpenAPI's nullable);
# anything else is an annotation (description, markdownDescription, x-..., ...) and is ignored.
_KNOWN = {
    "type", "enum", "const", "properties", "required", "additionalProperties", "patternProperties",
    "minProperties", "maxProperties", "propertyNames", "unevaluatedProperties", "unevaluatedItems", "items",
    "prefixItems", "additionalItems", "minItems", "maxItems", "contains", "minContains", "maxContains",
    "uniqueItems", "minLength", "maxLength", "pattern", "format", "minimum", "maximum", "exclusiveMinimum",
    "exclusiveMaximum", "multipleOf", "anyOf", "oneOf", "allOf", "not", "if", "then", "else", "$ref",
    "nullable", "dependentRequired", "dependentSchemas", "dependencies", "$dynamicRef", "$recursiveRef",
    NOT_STRINGS, NEGATED, NOT_MULTIPLE_OF,
}
MAX_COMBINATIONS = 256  # allOf of several anyOf/oneOf: branch combinations generated at most


class AllOfRules:
    """allOf's merge (_merge, _combine, _flat_parts)."""

    def _merge(self, schemas: list[Any], refs: tuple) -> dict | bool:
        """allOf merged; a part's additionalProperties also constrains the properties that only other
        parts list (it does not look into them), and its items the other parts' extra prefix items, so
        those carry it along before the merge."""
        parts = _typed_choices(_distinct_choices(self._flat_parts(schemas, refs)))
        if parts is False:
            return False
        choosing = [p for p in parts if isinstance(p, dict) and ("anyOf" in p or "oneOf" in p)]
        if len(choosing) > 1 or choosing and "anyOf" in choosing[0] and "oneOf" in choosing[0]:
            combinations = math.prod(len(p[k]) for p in choosing for k in ("anyOf", "oneOf")
                                     if isinstance(p.get(k), list))
            if combinations > MAX_COMBINATIONS:  # each would become a schema of its own
                raise ValueError(f"allOf of choices with over {MAX_COMBINATIONS} combinations of branches "
                                 "is not supported")
            # Several choices in one allOf: distribute over the first one's branches (each branch an
            # in-place part of its schema, so it goes first and the parent stays last).
            first = choosing[0]
            key = "oneOf" if "oneOf" in first else "anyOf"
            index = parts.index(first)
            rest = {k: v for k, v in first.items() if k != key}
            alternatives = []
            for branch in first[key]:
                branch = mark_negated(branch) if first.get(NEGATED) else branch
                new = list(parts)
                new[index] = rest
                alternatives.append(with_parts(new[-1], branch, *new[:-1]))  # the parent stays the parent
            return {key: alternatives}
        # The last part is the parent: its unevaluated* keywords see the evaluations of every part. Any
        # other part's see only its own, which (stricter, so still sound) is what additionalProperties
        # and items mean.
        parts = [_own_evaluations_only(p) for p in parts[:-1]] + parts[-1:]
        parts = _unevaluated_in_negations(parts)
        closing = [p for p in parts if isinstance(p, dict) and p.get("additionalProperties", True) is not True]
        if closing:
            adjusted = []
            for part in parts:
                if isinstance(part, dict) and isinstance(part.get("properties"), dict):
                    props = dict(part["properties"])
                    for c in closing:
                        if c is part:
                            continue
                        for name in props:
                            patterns = c.get("patternProperties") or {}
                            if name not in (c.get("properties") or {}) and not any(
                                    pattern_matches(p, name) for p in patterns):
                                props[name] = {"allOf": [props[name], c["additionalProperties"]]}
                    part = dict(part, properties=props)
                adjusted.append(part)
            parts = adjusted
        covering = [p for p in parts if isinstance(p, dict) and isinstance(p.get("items", True), (dict, bool))
                    and p.get("items", True) is not True]
        if covering:  # likewise a part's items covers the other parts' prefix items past its own prefix
            adjusted = []
            for part in parts:
                if isinstance(part, dict) and isinstance(part.get("prefixItems"), list):
                    prefix = list(part["prefixItems"])
                    for c in covering:
                        if c is not part:
                            for j in range(len(c.get("prefixItems") or []), len(prefix)):
                                prefix[j] = {"allOf": [prefix[j], c["items"]]}
                    part = dict(part, prefixItems=prefix)
                adjusted.append(part)
            parts = adjusted
        containing = [p for p in parts if isinstance(p, dict) and "contains" in p]
        if len({json.dumps(p["contains"], sort_keys=True, default=str) for p in containing}) > 1 and any(
                "minContains" in p for p in containing):
            # minContains: 0 beside one part's contains would drop the other part's (see _combine)
            raise ValueError("allOf with different values for 'contains' and a minContains is not supported")
        merged = super()._merge(parts, refs)
        parent = parts[-1] if parts else None
        if isinstance(merged, dict) and isinstance(parent, dict) and isinstance(parent.get("properties"), dict) \
                and isinstance(merged.get("properties"), dict):
            # The parent's own properties first: the order one reads the schema in (its keys, then allOf's
            # or a branch's), which generation follows.
            props = merged["properties"]
            merged["properties"] = {**{k: props[k] for k in parent["properties"] if k in props}, **props}
        return merged

    def _combine(self, key: str, a: Any, b: Any) -> Any:
        """Two allOf parts' values of one keyword as one: the tighter bound, the schema keywords as an
        allOf of both (each part's additionalProperties and items were already carried onto the other
        parts' own properties and prefix items by _merge), prefixItems position by position, integer
        multipleOf as the least common multiple. Others are refused."""
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b))
        if key in LOWER_BOUNDS and numbers:
            return max(a, b)
        if key in UPPER_BOUNDS and numbers:
            return min(a, b)
        if key == "multipleOf" and numbers and float(a).is_integer() and float(b).is_integer():
            return math.lcm(int(a), int(b))
        if key in SCHEMA_VALUED:
            return {"allOf": [a, b]}
        if key == "not":  # not A and not B: not (A or B)
            return {"anyOf": [a, b]}
        if key == NOT_STRINGS:
            return a + b
        if key == "pattern":  # both hold: a list (json_strings.py intersects their automata)
            return [p for v in (a, b) for p in (v if isinstance(v, list) else [v])]
        if key == "contains" and isinstance(a, (dict, bool)) and isinstance(b, (dict, bool)):
            # Items valid under both: a sound subset (a single item then satisfies each part's contains;
            # the tighter min/maxContains of the merge hold for each part's count too).
            return {"allOf": [a, b]}
        if key == "enum":  # the values both list (none: no value)
            if a is CONFLICT or b is CONFLICT or not isinstance(a, list) or not isinstance(b, list):
                return CONFLICT
            both = [v for v in a if any(same_json(v, w) for w in b)]
            return both or CONFLICT
        if key == "const":  # two different constants: no value
            return a if a is not CONFLICT and b is not CONFLICT and same_json(a, b) else CONFLICT
        if key == "prefixItems" and isinstance(a, list) and isinstance(b, list):
            short, long = sorted((a, b), key=len)
            return [{"allOf": [x, y]} for x, y in zip(short, long)] + long[len(short):]
        return super()._combine(key, a, b)

    def _flat_parts(self, schemas: list[Any], refs: tuple) -> list[Any]:
        """allOf's parts, dereferenced, with nested allOfs spliced in (so that a nested part's
        additionalProperties also sees the properties the outer parts list)."""
        parts = []
        derefed = []
        for s in schemas:  # (a `not`'s positive form stays marked through its refs and nested allOfs)
            part, sub_refs = self._deref(s, refs)
            derefed.append((mark_negated(part) if isinstance(s, dict) and s.get(NEGATED) else part, sub_refs))
        derefed = discriminated([(_known_keywords(part), sub_refs) for part, sub_refs in derefed])
        for part, sub_refs in derefed:
            if isinstance(part, dict) and "if" in part:
                part = through_if_branch(part)
            if isinstance(part, dict) and isinstance(part.get("allOf"), list):
                inner = self._flat_parts(part["allOf"], sub_refs)
                parts.extend([mark_negated(p) for p in inner] if part.get(NEGATED) else inner)
                part = {k: v for k, v in part.items() if k != "allOf"}
            parts.append(part)
        return parts


def _distinct_choices(parts: list[Any]) -> list[Any]:
    """allOf's parts less a choice that a later part repeats (A and A is A; a property both listed and
    matched by a pattern meets the same oneOf twice), so that it does not multiply the combinations."""
    choices = [isinstance(part, dict) and ("anyOf" in part or "oneOf" in part) for part in parts]
    if sum(choices) < 2:
        return parts  # (most merges: a large choice's text is not worth writing out to compare it with nothing)
    seen, out = set(), []
    for part, choice in zip(reversed(parts), reversed(choices)):  # (the last part, the parent, stays last)
        if choice:
            text = json.dumps(part, sort_keys=True, default=str)
            if text in seen:
                continue
            seen.add(text)
        out.append(part)
    return out[::-1]


def _typed_choices(parts: list[Any]) -> list[Any] | bool:
    """allOf's parts with the anyOf/oneOf branches whose `type` no other part's allows left out (a `not`
    of an object schema is "another type, or ..."; beside `type: object`, its first branch only
    multiplies the combinations); a choice left with one branch becomes that branch. False: no value."""
    allowed = None
    for part in parts:
        if isinstance(part, dict) and "type" in part:
            allowed = type_set(part["type"]) if allowed is None else allowed & type_set(part["type"])
    if allowed is None:
        return parts
    out = []
    for part in parts:
        key = next((k for k in ("anyOf", "oneOf") if isinstance(part, dict) and isinstance(part.get(k), list)), None)
        if key is None or "anyOf" in part and "oneOf" in part:
            out.append(part)
            continue
        kept = [b for b in part[key] if not (isinstance(b, dict) and "type" in b and not type_set(b["type"]) & allowed)]
        if not kept:
            return False
        if len(kept) > 1 or len(part[key]) == 1 or isinstance(kept[0], dict) and (
                {"unevaluatedProperties", "unevaluatedItems"} & set(kept[0])):  # (as a part it could be the parent)
            out.append(part if len(kept) == len(part[key]) else {**part, key: kept})
            continue
        rest = {k: v for k, v in part.items() if k != key}
        out.append(mark_negated(kept[0]) if part.get(NEGATED) else kept[0])
        if set(rest) - {NEGATED}:  # (after the branch: a parent, the last part, stays last)
            out.append(rest)
    return out


def _known_keywords(schema: Any) -> Any:
    if not isinstance(schema, dict) or all(k in _KNOWN for k in schema):
        return schema
    return {k: v for k, v in schema.items() if k in _KNOWN}


def _own_evaluations_only(schema: Any) -> Any:
    """unevaluatedProperties / unevaluatedItems as additionalProperties / items (where those are absent)."""
    if not isinstance(schema, dict) or not ({"unevaluatedProperties", "unevaluatedItems"} & set(schema)):
        return schema
    out = {k: v for k, v in schema.items() if k not in ("unevaluatedProperties", "unevaluatedItems")}
    if "unevaluatedProperties" in schema:
        out.setdefault("additionalProperties", schema["unevaluatedProperties"])
    if "unevaluatedItems" in schema and "contains" not in schema:
        out.setdefault("items", schema["unevaluatedItems"])
    elif "unevaluatedItems" in schema:
        out["unevaluatedItems"] = schema["unevaluatedItems"]
    return out


def _unevaluated_in_negations(parts: list[Any]) -> list[Any]:
    """The parent's (last part's) unevaluatedProperties/unevaluatedItems carried onto the keys and items
    only a `not`'s positive form (a NEGATED part) lists: a validator counts nothing a `not` says as
    evaluated, while the merge would."""
    parent = parts[-1] if parts and isinstance(parts[-1], dict) else {}
    marked = [p for p in parts if isinstance(p, dict) and p.get(NEGATED)]
    real = [p for p in parts if isinstance(p, dict) and not p.get(NEGATED)]
    if not marked:
        return parts
    props_rule = parent.get("unevaluatedProperties", True)
    if any("additionalProperties" in p for p in real):
        props_rule = True  # every key is evaluated by it
    items_rule = parent.get("unevaluatedItems", True)
    if any("items" in p for p in real):
        items_rule = True
    listed = {k for p in real for k in (p.get("properties") or {})}
    patterns = [k for p in real for k in (p.get("patternProperties") or {})]
    prefix = max((len(p.get("prefixItems") or []) for p in real), default=0)
    out = []
    for part in parts:
        if isinstance(part, dict) and part.get(NEGATED):
            part = {k: v for k, v in part.items() if k != NEGATED}  # (the merged schema is not one)
            if props_rule is not True and isinstance(part.get("properties"), dict):
                part["properties"] = {k: v if k in listed or any(pattern_matches(p, k) for p in patterns)
                                      else {"allOf": [v, props_rule]} for k, v in part["properties"].items()}
            if items_rule is not True and isinstance(part.get("prefixItems"), list):
                part["prefixItems"] = [v if i < prefix else {"allOf": [v, items_rule]}
                                       for i, v in enumerate(part["prefixItems"])]
            if items_rule is not True and "items" in part:
                part["items"] = {"allOf": [part["items"], items_rule]}
        out.append(part)
    return out
