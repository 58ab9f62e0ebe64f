"""What a oneOf branch's outputs look like, as far as telling branches apart needs (json_exclusion.py's
_signature makes the signatures): whether every output of one branch fails another."""

from __future__ import annotations

from typing import Any, Callable

from radixlm.core.runtime.constrained.schema.json_common import SchemaError, json_type, pattern_matches, same_json


def joined(sigs: list[dict]) -> dict:
    """The signature of outputs of any of `sigs`: what each has (the types and constants of any; the keys
    all require; constants of a key that each lists)."""
    if len(sigs) <= 1:
        return sigs[0] if sigs else {"types": set(), "consts": None}
    consts = [s["consts"] for s in sigs]
    forbids = [s.get("forbids") for s in sigs]
    shared = set.intersection(*(set(s.get("prop_consts", {})) for s in sigs))
    return {"types": set().union(*(s["types"] for s in sigs)),
            "consts": None if any(c is None for c in consts) else [c for cs in consts for c in cs],
            "required": set.intersection(*(s.get("required", set()) for s in sigs)),
            "props": set().union(*(s.get("props", set()) for s in sigs)),
            "closed": all(s.get("closed") for s in sigs),
            "forbids": None if None in forbids else lambda key: all(f(key) for f in forbids),
            "prop_consts": {k: [v for s in sigs for v in s["prop_consts"][k]] for k in shared},
            "prop_not_consts": {}}


def forbidden_keys(schema: dict) -> Callable[[str], bool]:
    """Whether a validator rejects an object of `schema` holding a key (additionalProperties false or the
    key's schema false; not the generation's strictness, which closes objects that list keys)."""
    props = schema.get("properties") or {}
    false = {k for k, v in props.items() if rejects_all(v)}
    if not rejects_all(schema.get("additionalProperties", True)) or schema.get("patternProperties"):
        return false.__contains__
    return lambda key: key in false or key not in props


def rejects_all(schema: Any) -> bool:
    """Whether no value is valid under `schema` as written: false, `not: {}`, or an allOf (what merges
    make) with such a part."""
    return schema is False or isinstance(schema, dict) and (
        schema.get("not", False) in (True, {}) or any(rejects_all(p) for p in schema.get("allOf") or ()))


def _fails(value: Any, sig: dict) -> bool:
    """Whether a constant fails the branch of `sig` by its type, or (a string) by the branch's pattern."""
    if json_type(value) not in sig["types"]:
        return True
    pattern = sig.get("pattern")
    if not isinstance(value, str) or not isinstance(pattern, str):
        return False
    try:
        return not pattern_matches(pattern, value)
    except SchemaError:  # (the pattern's converter reports it)
        return False


def pairwise_exclusive(sigs: list[dict]) -> bool:
    return all(excludes(a, b) and excludes(b, a) for i, a in enumerate(sigs) for b in sigs[i + 1:])


def consts_within(schema: Any) -> list | None:
    """Constants a value of `schema` is among (None: not known to be), through allOf too: the values every
    part that lists constants lists (an allOf merge leaves a branch's {"const": ...} beside the parent's
    enum). A superset of the values allowed, so only for what a branch may write, never for a `not`."""
    consts = const_of(schema)
    for part in schema.get("allOf", ()) if isinstance(schema, dict) and isinstance(schema.get("allOf"), list) else ():
        more = consts_within(part)
        if more is not None:
            consts = more if consts is None else [c for c in consts if any(same_json(c, m) for m in more)]
    return consts


def const_of(schema: Any) -> list | None:
    if isinstance(schema, dict):
        if "const" in schema:
            return [schema["const"]]
        if isinstance(schema.get("enum"), list):
            return schema["enum"]
    return None


def excludes(a: dict, b: dict) -> bool:
    """Whether every output generated for branch a fails branch b."""
    if a["consts"] is not None:
        others = b["consts"]
        if others is not None:
            return all(c not in others for c in a["consts"])
        return all(_fails(c, b) for c in a["consts"])
    if b["consts"] is not None and all(_fails(c, a) for c in b["consts"]):
        return True  # none of b's constants is an output of a
    if not (a["types"] & b["types"]):
        return True
    if a["types"] & b["types"] - {"object"}:
        return False
    # Both may be objects: a's objects fail b when b requires a key a never writes, or a required key of
    # a holds constants b's schema for that key does not allow.
    if a.get("closed") and b.get("required", set()) - a.get("props", set()):
        return True
    for forbids in (b.get("forbids"), a.get("forbids")):  # a writes a key b rejects (or a itself: no value)
        if forbids is not None and any(forbids(key) for key in a.get("required", ())):
            return True
    for key, values in a.get("prop_consts", {}).items():
        other = b.get("prop_consts", {}).get(key)
        if other is not None and all(v not in other for v in values) and (
                key in a.get("required", set()) or key in b.get("required", set())):
            return True  # (where only b requires it, a's outputs without the key fail b too)
        if key in a.get("required", set()) and all(v in b.get("prop_not_consts", {}).get(key, ()) for v in values):
            return True  # b's schema for the key is `not` of a list holding all of a's values
    for key, excluded in a.get("prop_not_consts", {}).items():
        other = b.get("prop_consts", {}).get(key)
        if key in a.get("required", set()) and other is not None and all(v in excluded for v in other):
            return True
    return False
