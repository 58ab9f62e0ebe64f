"""if/then/else and dependentRequired/dependentSchemas (a mixin of json_grammar._Converter)."""

from __future__ import annotations

from typing import Any

from radixlm.core.runtime.constrained.automata.grammar import Expr, alt
from radixlm.core.runtime.constrained.schema.json_common import (DEPENDENT_KEYWORDS, IGNORED_KEYWORDS, SchemaError,
                                                                 escape_pointer, json_key, json_type, open_part,
                                                                 type_set, with_parts)


class ConditionalRules:
    """if/then/else (_conditional) and dependencies (_dependents)."""

    @staticmethod
    def _dependents(schema: dict, ptr: str) -> dict:
        """dependentRequired / dependentSchemas (and draft 7's dependencies) as an allOf of choices, one per
        key: the key absent, or present with what depends on it. Keys whose dependent schemas each allow
        a set of constants for one common property (MongoDB's `"analyzer": {"properties": {"type": {"enum":
        [...]}}}`) make one choice instead, on that property's value (value_dependencies): n such keys
        would be 2^n combinations of branches."""
        rest = {k: v for k, v in schema.items() if k not in DEPENDENT_KEYWORDS}
        opened = open_part(schema)
        parts = []
        by_property: dict[str, list[tuple[str, list]]] = {}
        for keyword in DEPENDENT_KEYWORDS:
            table = schema.get(keyword, {})
            if not isinstance(table, dict):
                raise SchemaError(f"{ptr}/{keyword}: must be an object")
            for key, then in table.items():
                if isinstance(then, list):  # dependentRequired (and dependencies' list form)
                    then = {"required": then}
                elif keyword == "dependentRequired":
                    raise SchemaError(f"{ptr}/{keyword}/{escape_pointer(key)}: must be a list of property names")
                on_value = _value_dependency(then)
                if on_value is not None:
                    by_property.setdefault(on_value[0], []).append((key, on_value[1]))
                    continue
                parts.append(_dependent_choice(key, then, opened))
        for prop, keys in by_property.items():
            if len(keys) == 1:
                (key, values), = keys
                parts.append(_dependent_choice(key, {"properties": {prop: {"enum": values}}}, opened))
            else:
                parts.append(value_dependencies(prop, keys, opened))
        return with_parts(rest, *parts)

    def _conditional(self, schema: dict, ptr: str) -> Expr:
        """if/then/else: values of `if` and `then`, or of `not: if` and `else` where `not` can say it
        (else the former only: a sound subset)."""
        through_if = self.value(through_if_branch(schema), ptr)
        if schema["if"] is False or schema["if"] is True:
            return through_if
        rest = {k: v for k, v in schema.items() if k not in ("if", "then", "else")}
        other = self._attempt(with_parts(rest, {"not": schema["if"]}, schema.get("else", True)), f"{ptr}/else")
        return through_if if isinstance(other, SchemaError) else alt(through_if, other)


def _dependent_choice(key: str, then: Any, opened: dict) -> dict:
    """The key absent, or present with `then`."""
    present = {"allOf": [{"required": [key], **opened}, then]}
    return {"anyOf": [{"properties": {key: False}, **opened}, present]}


def _value_dependency(then: Any) -> tuple[str, list] | None:
    """(property, the constants it may take) for a dependent schema `{"properties": {property: {"enum":
    [...]}}}` (or const, or a type beside them; `"type": "object"` beside properties), else None."""
    if not isinstance(then, dict) or set(then) - IGNORED_KEYWORDS - {"properties", "type"} or \
            then.get("type", "object") != "object" or not isinstance(then.get("properties"), dict) or \
            len(then["properties"]) != 1:
        return None
    (prop, sub), = then["properties"].items()
    if not isinstance(sub, dict) or set(sub) - IGNORED_KEYWORDS - {"enum", "const", "type"} or \
            ("enum" in sub) == ("const" in sub) or "enum" in sub and not isinstance(sub["enum"], list):
        return None
    values = sub["enum"] if "enum" in sub else [sub["const"]]
    if "type" in sub:
        values = [v for v in values if json_type(v) in type_set(sub["type"])]
    return prop, values


def value_dependencies(prop: str, keys: list[tuple[str, list]], opened: dict) -> dict:
    """Keys each allowed only when `prop` holds one of its constants (key -> constants), as one choice
    on `prop`: absent (every key free: `properties` holds of an object without prop), or holding a
    value, with the keys that do not allow that value absent. Values are grouped by the keys they
    allow; the values no key lists allow none of them (a branch that takes any value: it overlaps
    the others only where they agree)."""
    groups: dict[frozenset, list] = {}
    seen: dict[str, Any] = {}
    for key, values in keys:
        for v in values:
            seen.setdefault(json_key(v), v)
    for name, v in seen.items():
        allowing = frozenset(key for key, values in keys if any(json_key(w) == name for w in values))
        groups.setdefault(allowing, []).append(v)
    groups.setdefault(frozenset(), [])
    names = [key for key, _ in keys]
    branches = [{"properties": {prop: False}, **opened}]
    for allowing, values in groups.items():
        if prop in names and prop not in allowing:
            continue  # prop's own dependency excludes these values
        value = {"enum": values} if allowing else True  # with every key absent, any value
        closed = {key: False for key in names if key not in allowing}
        branches.append({"required": [prop], "properties": {**closed, prop: value}, **opened})
    return {"anyOf": branches}


def discriminated(parts: list[tuple[Any, tuple]]) -> list[tuple[Any, tuple]]:
    """allOf parts `{"if": {"properties": {"kind": {"const": c_i}}}, "then": T_i, "else": E_i}` with one
    key and different constants (a discriminator, as in GitHub's issue forms) as one choice: objects with
    kind c_i, T_i and every other part's E_i. Through `if` alone, every part's T_i would apply at once."""
    def key_const(part):
        cond = part.get("if") if isinstance(part, dict) else None
        if (isinstance(cond, dict) and set(cond) <= {"properties", "required", "type"}
                and cond.get("type", "object") == "object"):
            props = cond.get("properties")
            if isinstance(props, dict) and len(props) == 1:
                (key, sub), = props.items()
                if isinstance(sub, dict) and set(sub) == {"const"} and set(cond.get("required", [key])) == {key}:
                    return key, json_key(sub["const"])
        return None
    found = [(i, key_const(p)) for i, (p, _) in enumerate(parts)]
    found = [(i, kc) for i, kc in found if kc is not None]
    keys = {kc[0] for _, kc in found}
    if len(found) < 2 or len(keys) != 1 or len({kc[1] for _, kc in found}) != len(found):
        return parts
    chosen = [i for i, _ in found]
    branches = []
    for i in chosen:
        part = parts[i][0]
        elses = [parts[j][0]["else"] for j in chosen if j != i and "else" in parts[j][0]]
        branches.append({"allOf": [{**part["if"], "required": [next(iter(keys))]}, part.get("then", True), *elses]})
    out = []  # in place of the first part chosen, the choice; of each chosen one, its other keywords
    for i, (part, refs) in enumerate(parts):
        if i == chosen[0]:
            out.append(({"anyOf": branches}, refs))
        rest = {k: v for k, v in part.items() if k not in ("if", "then", "else")} if i in chosen else part
        if i not in chosen or rest:
            out.append((rest, refs))
    return out


def through_if_branch(schema: dict) -> dict:
    """if/then/else generated through its `if` branch: instances of if and then (a sound subset)."""
    rest = {k: v for k, v in schema.items() if k not in ("if", "then", "else")}
    if "then" not in schema and "else" not in schema:  # an `if` alone constrains nothing
        return rest
    if schema["if"] is False:  # no value matches `if`: every value takes `else`
        return with_parts(rest, schema.get("else", True))
    return with_parts(rest, schema["if"], schema.get("then", True))
