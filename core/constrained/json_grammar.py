"""JSON schema -> a Grammar (grammar.py) whose every output is a compact JSON document valid under it.

Terminals are small regexes (a string, a number, `"key":`, punctuation); `$ref` targets become rules,
so recursion needs no depth bound and nothing is inlined. An object's optional properties cost one
small rule each ("the rest of the object after member i"), not a copy of the object per alternative.

Keywords: type, enum, const, properties, required, additionalProperties (false, true or a schema),
patternProperties, minProperties/maxProperties, items, prefixItems, minItems/maxItems, uniqueItems (an
approximation that stays sound: at most one item), minLength/maxLength, pattern (ECMA-262 search
semantics, `\\d` and `\\w` ASCII), format (date, time, date-time, duration, uuid, email, hostname, ipv4,
ipv6, uri), numeric bounds, multipleOf (whole, or p/q on integers), anyOf, oneOf (exclusive: branches
told apart by types, constants or properties, else each excluding the others with `not`), allOf
(merged), not (of types, required keys, string patterns/constants, numeric bounds), if/then/else, $ref
and $dynamicRef (schema_refs.py; recursion allowed), OpenAPI's nullable; annotations ignored.
Objects with `properties` and no `additionalProperties` get exactly their listed properties (a
documented strictness). Anything refused raises ValueError naming the keyword and its JSON pointer.
"""

from __future__ import annotations

import fractions
import functools
import itertools
import json
import math
import re
from typing import TYPE_CHECKING, Any

import numpy as np

from radixlm.core.constrained import json_schema as js
from radixlm.core.constrained import number_ranges
from radixlm.core.constrained.counted_string import counted_states, counted_string_dfa
from radixlm.core.constrained.grammar import EMPTY, Alt, Expr, Grammar, Ref, Repeat, Terminal, alt, lit, opt, seq
from radixlm.core.constrained.grammar_compiler import DEFAULT_BUDGET, Deadline, GrammarBudget, terminal_dfa
from radixlm.core.constrained.regex_dfa import ByteDFA, dfa_difference, dfa_intersection, literals_dfa

if TYPE_CHECKING:
    from radixlm.core.constrained.schema_refs import SchemaRefs

CHAR = Terminal(regex=js.STRING_CHAR)
NUMBER = Terminal(regex=js.NUMBER)
# Integers are generated canonically ("1", never "1.0"), though JSON Schema (draft 6 on) counts 1.0 as an
# integer too: programs read the output with json.loads, where 1.0 is a float (range(x) fails on it).
INTEGER = Terminal(regex=js.INTEGER)
NULL = lit("null")
BOOLEAN = Terminal(regex="true|false")
NOTHING = Alt(())  # no output at all

_IPV4_PART = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_H16 = r"[0-9A-Fa-f]{1,4}"
_IPV6 = "|".join([
    rf"(?:{_H16}:){{7}}{_H16}", rf"(?:{_H16}:){{1,7}}:",
    *(rf"(?:{_H16}:){{1,{6 - k}}}(?::{_H16}){{1,{k + 1}}}" for k in range(6)),
    rf":(?::{_H16}){{1,7}}", "::",
])
FORMATS = js.FORMATS | {
    "duration": r"P(?:[0-9]+W|(?=[0-9T])(?:[0-9]+Y)?(?:[0-9]+M)?(?:[0-9]+D)?(?:T(?=[0-9])(?:[0-9]+H)?(?:[0-9]+M)?(?:[0-9]+S)?)?)",
    "hostname": r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*",
    "ipv4": rf"{_IPV4_PART}(?:\.{_IPV4_PART}){{3}}",
    "ipv6": f"(?:{_IPV6})",
}
# Lookahead is not regular in our engine: durations are "P", then at least one component.
FORMATS["duration"] = (r"P(?:[0-9]+W|[0-9]+Y(?:[0-9]+M)?(?:[0-9]+D)?(?:T_TIME)?|[0-9]+M(?:[0-9]+D)?(?:T_TIME)?"
                       r"|[0-9]+D(?:T_TIME)?|T_TIME)").replace(
    "T_TIME", r"T(?:[0-9]+H(?:[0-9]+M)?(?:[0-9]+S)?|[0-9]+M(?:[0-9]+S)?|[0-9]+S)")

_TYPES = ("null", "boolean", "object", "array", "string", "number")
_IGNORED = {
    "title", "description", "default", "examples", "$schema", "$id", "$anchor", "$comment", "$defs", "definitions",
    "readOnly", "writeOnly", "deprecated", "contentMediaType", "contentEncoding", "contentSchema", "discriminator",
    "format", "$vocabulary", "$dynamicAnchor", "x-", "externalDocs", "xml", "example",
}
_REFUSED = {"$dynamicRef": "a $dynamicRef that does not resolve, or whose target depends on the path taken "
                           "(the dynamic scope),",
            "$recursiveRef": "keyword '$recursiveRef'"}
_DEPENDENT = ("dependentRequired", "dependentSchemas", "dependencies")
_LOWER_BOUNDS = {"minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties", "minContains"}
_UPPER_BOUNDS = {"maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties", "maxContains"}
_CONFLICT = object()  # internal: the `const` of allOf parts with different constants (no value)
_NOT_STRINGS = "x-radixlm-not-strings"  # internal: regexes of the JSON strings a `not` excludes
_SCHEMA_VALUED = {"items", "additionalProperties", "propertyNames", "additionalItems"}


def string_terminal(lo: int = 0, hi: int | None = None) -> Terminal:
    """A JSON string of lo..hi characters, quotes included; its masks are counted (counted_string.py)."""
    return Terminal(key=f"counted:{lo}:{hi}", dfa=counted_string_dfa(lo, hi))


class SchemaError(ValueError):
    """A schema the converter refuses; the message names the keyword and its JSON pointer."""


def json_schema_to_grammar(schema: Any, whitespace_pattern: str | None = None,
                           budget: GrammarBudget = DEFAULT_BUDGET, deadline: Deadline | None = None) -> Grammar:
    """The grammar of compact JSON documents valid under `schema` (a JSON string, dict, bool or pydantic
    model class). ValueError naming the keyword and where (JSON pointer) for whatever is refused."""
    # Imported here: `referencing` takes ~0.3 s to import, which the engine's start need not pay.
    from radixlm.core.constrained.schema_refs import SchemaRefs

    refs = SchemaRefs(js._load_schema(schema))
    if whitespace_pattern:
        try:
            re.compile(whitespace_pattern)
        except re.error as e:
            raise ValueError(f"invalid whitespace_pattern {whitespace_pattern!r}: {e}") from None
    conv = _Converter(refs, whitespace_pattern or "", budget, deadline or Deadline(budget))
    conv.rules["start"] = conv.value(refs.root, "#")
    return Grammar(conv.rules, "start")


def _scalar_keywords_admit(value: Any, schema: dict) -> bool:
    """Whether a string or number constant meets its schema's length, pattern and range keywords (the
    siblings of enum/const that apply to a constant; object and array keywords are not checked here).
    Numbers compare as Python does (ints and floats exactly); multipleOf as jsonschema computes it."""
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0) or len(value) > schema.get("maxLength", math.inf):
            return False
        pattern = schema.get("pattern")
        try:
            return not isinstance(pattern, str) or re.search(pattern, value) is not None
        except re.error:  # a pattern Python cannot read: the pattern's own converter reports it
            return True
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return True

    def number(key: str) -> int | float | None:
        bound = schema.get(key)
        return bound if isinstance(bound, (int, float)) and not isinstance(bound, bool) else None

    low, high = number("minimum"), number("maximum")
    if low is not None and (value < low or (schema.get("exclusiveMinimum") is True and value == low)):
        return False  # (a boolean exclusiveMinimum is draft 4's form)
    if high is not None and (value > high or (schema.get("exclusiveMaximum") is True and value == high)):
        return False
    low, high = number("exclusiveMinimum"), number("exclusiveMaximum")
    if (low is not None and value <= low) or (high is not None and value >= high):
        return False
    step = number("multipleOf")
    if step is None or step <= 0:
        return True
    if isinstance(step, int) and isinstance(value, int):
        return value % step == 0
    quotient = value / step
    return math.isfinite(quotient) and quotient == int(quotient)


class _Converter(js._Converter):
    """Reuses the regex converter's $ref resolution, allOf merging and ref expansion (for merges)."""

    def __init__(self, refs: SchemaRefs, ws: str, budget: GrammarBudget, deadline: Deadline) -> None:
        super().__init__(refs.root, ws, js.DEFAULT_MAX_RECURSION)
        self.refs = refs
        self.budget = budget
        self.deadline = deadline
        self.rules: dict[str, Expr] = {}
        self.ref_rules: dict[str, str] = {}
        self.ws_term = Terminal(regex=f"(?:{ws})") if ws else None
        self.formats_asserted = _asserts_formats(refs.root)

    # ---- helpers -------------------------------------------------------------------------------------
    def _punct(self, text: str) -> Expr:
        return seq(opt(self.ws_term), lit(text), opt(self.ws_term)) if self.ws_term else lit(text)

    def _rule(self, name: str, expr: Expr) -> Ref:
        """A rule holding `expr` (so that repetition refers to it instead of copying it)."""
        if name not in self.rules:
            self.rules[name] = expr
        return Ref(name)

    def _shared(self, expr: Expr, ptr: str) -> Expr:
        return expr if isinstance(expr, (Terminal, Ref)) else self._rule(f"{ptr}@{len(self.rules)}", expr)

    # ---- the conversion ----------------------------------------------------------------------------
    def value(self, schema: Any, ptr: str) -> Expr:
        self.deadline.check()
        if isinstance(schema, dict) and "$ref" in schema:
            ref = schema["$ref"]
            if not isinstance(ref, str):
                raise SchemaError(f"{ptr}/$ref: must be a string")
            rest = {k: v for k, v in schema.items() if k != "$ref" and k not in _IGNORED}
            if rest:  # sibling keywords: merged with the target (which is inlined for the merge)
                return self.value({"allOf": [self._target(ref, ptr), rest]}, ptr)
            name = self.ref_rules.get(ref)
            if name is None:
                name = self.ref_rules[ref] = f"ref:{ref}"
                self.rules[name] = NOTHING  # placeholder: recursion refers to the rule by name
                self.rules[name] = self.value(self._target(ref, ptr), ref)
            return Ref(name)
        if schema is True or schema == {}:
            return self._any()
        if schema is False:
            return NOTHING
        if not isinstance(schema, dict):
            raise SchemaError(f"{ptr}: a JSON schema must be an object or a boolean, got {schema!r}")
        for key in schema:
            if key in _REFUSED:
                raise SchemaError(f"{ptr}/{key}: {_REFUSED[key]} is not supported")
        if any(k in schema for k in _DEPENDENT):
            return self.value(self._dependents(schema, ptr), ptr)
        if "if" in schema:
            return self._conditional(schema, ptr)
        schema = {k: v for k, v in schema.items() if k not in ("then", "else")}
        if "not" in schema and not _types_only(schema["not"]):  # as positive keywords, merged in
            rest = {k: v for k, v in schema.items() if k != "not"}
            return self.value({"allOf": [self._negation(schema["not"], _opened(rest), f"{ptr}/not"), rest]}, ptr)
        if "allOf" in schema:
            try:
                merged = self._merge(schema["allOf"] + [{k: v for k, v in schema.items() if k != "allOf"}], ())
            except ValueError as e:
                raise SchemaError(f"{ptr}/allOf: {e}") from None
            return self.value(merged, ptr)
        if "anyOf" in schema or "oneOf" in schema:
            key = "anyOf" if "anyOf" in schema else "oneOf"
            if "anyOf" in schema and "oneOf" in schema:
                raise SchemaError(f"{ptr}: anyOf together with oneOf is not supported")
            branches = schema[key]
            if not isinstance(branches, list) or not branches:
                raise SchemaError(f"{ptr}/{key}: must be a non-empty list")
            rest = {k: v for k, v in schema.items() if k != key and k not in _IGNORED}
            subs = [{"allOf": [b, rest]} if rest else b for b in branches]
            if key == "oneOf":
                return alt(*self._exclusive(subs, branches, f"{ptr}/oneOf"))
            return alt(*(self.value(s, f"{ptr}/{key}/{i}") for i, s in enumerate(subs)))
        if schema.get("nullable") is True:
            return alt(self.value({k: v for k, v in schema.items() if k != "nullable"}, ptr), NULL)
        if "const" in schema:
            enum = schema.get("enum")  # both, from an allOf merge: the constant only if the enum has it
            if schema["const"] is _CONFLICT or isinstance(enum, list) and not any(
                    _same_json(schema["const"], v) for v in enum):
                return NOTHING
            return self._literal(schema["const"], schema, ptr)
        if "enum" in schema:
            if not isinstance(schema["enum"], list) or not schema["enum"]:
                raise SchemaError(f"{ptr}/enum: must be a non-empty list")
            return alt(*(self._literal(v, schema, ptr) for v in schema["enum"]))
        types = schema.get("type", list(_TYPES))
        types = [types] if isinstance(types, str) else list(types)
        if "not" in schema:
            types = self._without(types, schema["not"], ptr)
        handlers = {"string": self._string, "integer": self._integer, "number": self._number,
                    "fraction": functools.partial(self._number, fraction=True),
                    "boolean": lambda s, p: BOOLEAN, "null": lambda s, p: NULL, "object": self._object,
                    "array": self._array}
        out = []
        for t in types:
            if t not in handlers:
                raise SchemaError(f"{ptr}/type: unknown JSON schema type {t!r}")
            out.append(handlers[t](schema, ptr))
        return alt(*out) if out else NOTHING

    @staticmethod
    def _dependents(schema: dict, ptr: str) -> dict:
        """dependentRequired / dependentSchemas (and draft 7's dependencies) as an allOf of choices, one per
        key: the key absent, or present with what depends on it."""
        rest = {k: v for k, v in schema.items() if k not in _DEPENDENT}
        opened = _opened(schema)
        parts = []
        for keyword in _DEPENDENT:
            table = schema.get(keyword, {})
            if not isinstance(table, dict):
                raise SchemaError(f"{ptr}/{keyword}: must be an object")
            for key, then in table.items():
                if isinstance(then, list):  # dependentRequired (and dependencies' list form)
                    then = {"required": then}
                elif keyword == "dependentRequired":
                    raise SchemaError(f"{ptr}/{keyword}/{_escape(key)}: must be a list of property names")
                present = {"allOf": [{"required": [key], **opened}, then]}
                parts.append({"anyOf": [{"properties": {key: False}, **opened}, present]})
        return {"allOf": [rest, *parts]}

    def _target(self, ref: str, ptr: str) -> Any:
        try:
            return self._resolve(ref)
        except ValueError as e:
            raise SchemaError(f"{ptr}/$ref: {e}") from None

    def _resolve(self, ref: str) -> Any:
        return self.refs.resolve(ref)

    def _merge(self, schemas: list[Any], refs: tuple) -> dict | bool:
        """allOf merged; a part's additionalProperties also constrains the properties that only other
        parts list (it does not look into them), and its items the other parts' extra prefix items, so
        those carry it along before the merge."""
        parts = self._flat_parts(schemas, refs)
        choosing = [p for p in parts if isinstance(p, dict) and ("anyOf" in p or "oneOf" in p)]
        if len(choosing) > 1 or choosing and "anyOf" in choosing[0] and "oneOf" in choosing[0]:
            # Several choices in one allOf: distribute over the first one's branches (each branch an
            # in-place part of its schema, so it goes first and the parent stays last).
            first = choosing[0]
            key = "oneOf" if "oneOf" in first else "anyOf"
            index = parts.index(first)
            rest = {k: v for k, v in first.items() if k != key}
            alternatives = []
            for branch in first[key]:
                new = list(parts)
                new[index] = rest
                alternatives.append({"allOf": [branch, *new]})
            return {key: alternatives}
        # The last part is the parent: its unevaluated* keywords see the evaluations of every part. Any
        # other part's see only its own, which (stricter, so still sound) is what additionalProperties
        # and items mean.
        parts = [_own_evaluations_only(p) for p in parts[:-1]] + parts[-1:]
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
                                    _pattern_matches(p, name) for p in patterns):
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
        return super()._merge(parts, refs)

    def _combine(self, key: str, a: Any, b: Any) -> Any:
        """Two allOf parts' values of one keyword as one: the tighter bound, the schema keywords as an
        allOf of both (each part's additionalProperties and items were already carried onto the other
        parts' own properties and prefix items by _merge), prefixItems position by position, integer
        multipleOf as the least common multiple. Others are refused."""
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b))
        if key in _LOWER_BOUNDS and numbers:
            return max(a, b)
        if key in _UPPER_BOUNDS and numbers:
            return min(a, b)
        if key == "multipleOf" and numbers and float(a).is_integer() and float(b).is_integer():
            return math.lcm(int(a), int(b))
        if key in _SCHEMA_VALUED:
            return {"allOf": [a, b]}
        if key == "not":  # not A and not B: not (A or B)
            return {"anyOf": [a, b]}
        if key == _NOT_STRINGS:
            return a + b
        if key == "const":  # two different constants: no value
            return a if a is not _CONFLICT and b is not _CONFLICT and _same_json(a, b) else _CONFLICT
        if key == "prefixItems" and isinstance(a, list) and isinstance(b, list):
            short, long = sorted((a, b), key=len)
            return [{"allOf": [x, y]} for x, y in zip(short, long)] + long[len(short):]
        return super()._combine(key, a, b)

    def _flat_parts(self, schemas: list[Any], refs: tuple) -> list[Any]:
        """allOf's parts, dereferenced, with nested allOfs spliced in (so that a nested part's
        additionalProperties also sees the properties the outer parts list)."""
        parts = []
        derefed = [(_known_keywords(part), sub_refs) for part, sub_refs in (self._deref(s, refs) for s in schemas)]
        derefed = _discriminated(derefed)
        for part, sub_refs in derefed:
            if isinstance(part, dict) and "if" in part:
                part = _through_if(part)
            if isinstance(part, dict) and isinstance(part.get("allOf"), list):
                parts.extend(self._flat_parts(part["allOf"], sub_refs))
                part = {k: v for k, v in part.items() if k != "allOf"}
            parts.append(part)
        return parts

    def _literal(self, value: Any, schema: dict, ptr: str) -> Expr:
        """A constant; dropped (NOTHING) when the schema's type excludes it."""
        types = schema.get("type")
        if types is not None:
            types = {types} if isinstance(types, str) else set(types)
            kind = _json_type(value)
            if kind not in types and not (kind == "integer" and "number" in types):
                return NOTHING
        text = json.dumps(value, ensure_ascii=False)
        if isinstance(value, str) and any(re.fullmatch(r, text) for r in schema.get(_NOT_STRINGS, ())):
            return NOTHING  # a `not` excludes it
        if not _scalar_keywords_admit(value, schema):
            return NOTHING  # a sibling keyword excludes it: {"enum": ["abc"], "maxLength": 2}
        return self._constant(value)

    def _constant(self, value: Any) -> Expr:
        """Exactly `value` (a whole float as its integer: 0.0 equals 0 to JSON Schema)."""
        if isinstance(value, float) and value.is_integer() or isinstance(value, int) and not isinstance(value, bool):
            return Terminal(regex=re.escape(str(int(value))))
        if isinstance(value, list):
            items = [self._constant(v) for v in value]
            body = [seq(self._punct(","), v) if i else v for i, v in enumerate(items)]
            return seq(self._punct("["), *body, self._punct("]"))
        if isinstance(value, dict):
            members = [seq(self._key(k), self._constant(v)) for k, v in value.items()]
            body = [seq(self._punct(","), m) if i else m for i, m in enumerate(members)]
            return seq(self._punct("{"), *body, self._punct("}"))
        return lit(json.dumps(value, ensure_ascii=False))

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

    def _any(self) -> Ref:
        if "any" not in self.rules:
            value = Ref("any")
            comma = self._punct(",")
            items = seq(value, Repeat(seq(comma, value)))
            member = seq(string_terminal(), self._punct(":"), value)
            members = seq(member, Repeat(seq(comma, member)))
            self.rules["any"] = alt(string_terminal(), NUMBER, BOOLEAN, NULL,
                                    seq(self._punct("["), opt(items), self._punct("]")),
                                    seq(self._punct("{"), opt(members), self._punct("}")))
        return Ref("any")

    # ---- scalars -----------------------------------------------------------------------------------
    def _string(self, schema: dict, ptr: str) -> Expr:
        """The strings `schema` allows, less those a `not` excluded (_negation)."""
        expr = self._string_body(schema, ptr)
        excluded = schema.get(_NOT_STRINGS)
        if not excluded or expr is NOTHING:
            return expr
        if not isinstance(expr, Terminal):
            raise SchemaError(f"{ptr}/not: excluding strings from one of over {self.budget.max_terminal_states} "
                              "states is not supported")
        budget = self.budget.max_terminal_states
        dfa = expr.dfa if expr.dfa is not None else terminal_dfa(expr.regex, budget)
        for regex in excluded:
            other = terminal_dfa(regex, budget) if dfa is not None else None
            dfa = dfa_difference(dfa, other, budget, self.deadline.check) if other is not None else dfa
        return NOTHING if dfa is None else Terminal(key=f"{expr.ident}\0not:" + "\0".join(excluded), dfa=dfa)

    def _string_body(self, schema: dict, ptr: str) -> Expr:
        lo, hi = _counts(schema, "minLength", "maxLength", ptr)
        if hi is not None and hi < lo:
            return NOTHING
        fmt, pattern = schema.get("format"), schema.get("pattern")
        bounded = "minLength" in schema or "maxLength" in schema
        regexes = []  # the pattern and the format both hold where both are given
        if pattern is not None:
            try:
                regexes.append(f'"{ecma_string_pattern(pattern)}"')
            except ValueError as e:
                raise SchemaError(f"{ptr}/pattern: {e}") from None
        if fmt in FORMATS and self.formats_asserted:
            regexes.append(f'"{FORMATS[fmt]}"')
        if len(regexes) == 1 and not bounded:
            return Terminal(regex=regexes[0])
        if regexes:
            where = f"{ptr}/pattern" if pattern is not None else f"{ptr}/format"
            return self._within(regexes, lo, hi, bounded, where)
        if counted_states(lo, hi) <= self.budget.max_terminal_states:
            return string_terminal(lo, hi)
        tail = Repeat(CHAR, 0, hi - lo) if hi is not None else Terminal(regex=f"{js.STRING_CHAR}*")
        return seq(lit('"'), Repeat(CHAR, lo, lo), tail, lit('"')) if lo else seq(lit('"'), tail, lit('"'))

    def _within(self, regexes: list[str], lo: int, hi: int | None, bounded: bool, ptr: str) -> Expr:
        """The JSON strings matching every regex of `regexes` (quotes included), with lo..hi characters
        if `bounded`: their DFAs intersected (with the counted string's)."""
        budget = self.budget.max_terminal_states
        if bounded and max(lo, hi or 0) > MAX_PRODUCT_LENGTH:
            raise SchemaError(f"{ptr}: minLength/maxLength over {MAX_PRODUCT_LENGTH} together with it is not supported")
        dfa = terminal_dfa(regexes[0], budget)
        for other in [terminal_dfa(r, budget) for r in regexes[1:]] + ([counted_string_dfa(lo, hi)] if bounded else []):
            if dfa is not None:
                dfa = dfa_intersection(dfa, other, budget, self.deadline.check) if other is not None else None
        key = "re:" + "\0and:".join(regexes) + (f"\0length:{lo}:{hi}" if bounded else "")
        return NOTHING if dfa is None else Terminal(key=key, dfa=dfa)

    def _integer(self, schema: dict, ptr: str) -> Expr:
        step = schema.get("multipleOf", 1)
        if isinstance(step, bool) or not isinstance(step, (int, float)) or step <= 0:
            raise SchemaError(f"{ptr}/multipleOf: must be a positive number")
        # An integer is a multiple of p/q (in lowest terms, from the decimal as written: 1.5 is 3/2)
        # exactly when p divides it.
        step = fractions.Fraction(repr(step)).numerator
        if step > MAX_MODULUS:
            raise SchemaError(f"{ptr}/multipleOf: multipleOf is supported where its numerator (in lowest terms) "
                              f"is at most {MAX_MODULUS}")
        try:
            lo, hi = js._int_bounds(schema)
        except ValueError as e:
            raise SchemaError(f"{ptr}: {e}") from None
        if lo is not None and hi is not None and lo > hi:
            return NOTHING
        if int(step) == 1:
            return INTEGER if lo is None and hi is None else Terminal(regex=f"(?:{js.int_range_regex(lo, hi)})")
        dfa = multiples_dfa(int(step))
        if lo is not None or hi is not None:
            budget = self.budget.max_terminal_states
            bounds = terminal_dfa(f"(?:{js.int_range_regex(lo, hi)})", budget)
            dfa = dfa_intersection(dfa, bounds, budget, self.deadline.check)
        return NOTHING if dfa is None else Terminal(key=f"multiples:{int(step)}:{lo}:{hi}", dfa=dfa)

    def _number(self, schema: dict, ptr: str, fraction: bool = False) -> Expr:
        """Numbers within the bounds (any decimal bound, exclusive or not); with `fraction`, only those
        that are not integers."""
        # Multiples of a whole number are integers; of p/q, the integer ones are generated (a sound subset).
        if "multipleOf" in schema:
            return NOTHING if fraction else self._integer(schema, ptr)
        lower = self._bound(schema, "minimum", "exclusiveMinimum", max, ptr)
        upper = self._bound(schema, "maximum", "exclusiveMaximum", min, ptr)
        try:
            sides = [number_ranges.above(*lower)] if lower else []
            sides += [number_ranges.below(*upper)] if upper else []
        except ValueError as e:
            raise SchemaError(f"{ptr}: {e}") from None
        sides += [number_ranges.FRACTIONAL] if fraction else []
        if fraction or any(b and (not b[1] or b[0] != int(b[0])) for b in (lower, upper)):
            sides.append(number_ranges.ROUND_TRIP)
        if not sides:
            return NUMBER
        if len(sides) == 1:
            return Terminal(regex=sides[0])
        budget = self.budget.max_terminal_states
        dfa = terminal_dfa(sides[0], budget)
        for side in sides[1:]:
            if dfa is not None:
                dfa = dfa_intersection(dfa, terminal_dfa(side, budget), budget, self.deadline.check)
        return NOTHING if dfa is None else Terminal(key=f"number:{lower}:{upper}:{fraction}", dfa=dfa)

    @staticmethod
    def _bound(schema: dict, inclusive: str, exclusive: str, tighter, ptr: str) -> tuple[Any, bool] | None:
        """(the tighter of the two bounds, whether it is inclusive), or None if neither is given."""
        found = []
        for key, closed in ((inclusive, True), (exclusive, False)):
            if key in schema:
                value = schema[key]
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise SchemaError(f"{ptr}/{key}: must be a number (draft 4's boolean form is not supported)")
                found.append((value, closed))
        if not found:
            return None
        best = tighter(v for v, _ in found)
        return best, all(closed for v, closed in found if v == best)  # an equal exclusive bound wins

    # ---- objects -----------------------------------------------------------------------------------
    def _object(self, schema: dict, ptr: str) -> Expr:
        props = schema.get("properties") or {}
        if not isinstance(props, dict):
            raise SchemaError(f"{ptr}/properties: must be an object")
        required = schema.get("required") or []
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise SchemaError(f"{ptr}/required: must be a list of strings")
        patterns = schema.get("patternProperties") or {}
        if not isinstance(patterns, dict):
            raise SchemaError(f"{ptr}/patternProperties: must be an object")
        # Keys no other keyword evaluates fall to unevaluatedProperties. Without either, an object that
        # lists its keys (properties or required) gets exactly those (the documented strictness).
        explicit = schema.get("additionalProperties", schema.get("unevaluatedProperties"))
        extra = explicit if explicit is not None else not props and not patterns and not required
        lo, hi = _counts(schema, "minProperties", "maxProperties", ptr)
        names = list(props) + [r for r in required if r not in props]
        key_filter = schema.get("propertyNames", True)
        if key_filter is not True:
            names = self._property_names(names, key_filter, required, ptr)
            if names is None:
                return NOTHING
        key_names = None  # the keys propertyNames allows beyond the listed ones
        if key_filter is not True and (extra is not False or patterns):
            key_names = self._names_dfa(key_filter, ptr)
        members: list[tuple[Expr, bool]] = []
        for name in names:
            matching = [ps for pattern, ps in patterns.items() if _pattern_matches(pattern, name, ptr)]
            # A key listed only in required: its value is additional unless a pattern matches the key.
            sub = props.get(name, True if matching or explicit is None else explicit)
            if matching:  # patternProperties apply to listed properties too
                sub = {"allOf": [sub, *matching]}
            key_ptr = f"{ptr}/properties/{_escape(name)}"
            value = self.value(sub, key_ptr)
            members.append((seq(self._key(name), self._shared(value, key_ptr)), name in required))
        extras: list[Expr] = []  # one '"key":value' alternative per kind of extra key
        listed = [json.dumps(n, ensure_ascii=False) for n in names]
        for i, (pattern, sub) in enumerate(patterns.items()):
            try:
                body = ecma_string_pattern(pattern)
            except ValueError as e:
                raise SchemaError(f"{ptr}/patternProperties: {e}") from None
            others = [f'"{ecma_string_pattern(p)}"' for j, p in enumerate(patterns) if j != i]
            key = self._key_terminal(f'"{body}"', listed, others, key_names)
            if key is not None:
                p2 = f"{ptr}/patternProperties/{_escape(pattern)}"
                extras.append(seq(key, self._punct(":"), self._shared(self.value(sub, p2), p2)))
        if extra is not False:
            others = [f'"{ecma_string_pattern(p)}"' for p in patterns]
            key = self._key_terminal(js.STRING, listed, others, key_names)
            if key is not None:
                value = self._any() if extra is True else self.value(extra, f"{ptr}/additionalProperties")
                extras.append(seq(key, self._punct(":"), self._shared(value, f"{ptr}/additionalProperties")))
        # Keys listed only in `required` have no schema order: a few of them are taken in any order.
        loose = sum(1 for name in names if name not in props)
        orders = [members]
        if 2 <= loose <= MAX_ANY_ORDER:
            fixed = members[:len(members) - loose]
            orders = [fixed + list(p) for p in itertools.permutations(members[len(members) - loose:])]
        body = alt(*(self._members(order, extras, lo, hi, ptr) for order in orders))
        return seq(self._punct("{"), body, self._punct("}"))

    @staticmethod
    def _property_names(names: list[str], rule: Any, required: list[str], ptr: str) -> list[str] | None:
        """The listed names `propertyNames` allows (None if it rejects a required one)."""
        if rule is False:
            keep = []
        elif isinstance(rule, dict) and set(rule) - _IGNORED <= {"pattern", "maxLength", "minLength", "enum", "const"}:
            def ok(name: str) -> bool:
                return (len(name) <= rule.get("maxLength", len(name)) and len(name) >= rule.get("minLength", 0)
                        and ("pattern" not in rule or _pattern_matches(rule["pattern"], name, ptr))
                        and ("enum" not in rule or name in rule["enum"])
                        and ("const" not in rule or name == rule["const"]))
            keep = [n for n in names if ok(n)]
        else:
            raise SchemaError(f"{ptr}/propertyNames: only pattern, lengths, enum and const are supported")
        return None if any(r not in keep for r in required) else keep

    def _members(self, members: list[tuple[Expr, bool]], extras: list[Expr], lo: int, hi: int | None,
                 ptr: str) -> Expr:
        """The object's body: members in order (optional ones may be left out), then any extras, with
        commas between, between lo and hi members in all. Rule (i, n) is the rest of the body after i
        listed members were considered and n written (n counted only as far as the bounds need)."""
        cap = max(lo, hi if hi is not None else 0, 1)
        base = f"{ptr}@obj{len(self.rules)}"
        extra = alt(*extras) if extras else None

        def rest(i: int, n: int) -> Expr:
            name = f"{base}/{i}/{n}"
            if name in self.rules:
                return Ref(name)
            self.rules[name] = NOTHING
            comma = self._punct(",") if n else EMPTY
            nxt = min(n + 1, cap)
            if i < len(members):
                member, req = members[i]
                take = seq(comma, member, rest(i + 1, nxt)) if hi is None or n < hi else NOTHING
                body = take if req else alt(take, rest(i + 1, n))
            else:
                can_stop = n >= lo
                more = seq(comma, extra, rest(i, nxt)) if extra is not None and (hi is None or n < hi) else NOTHING
                body = alt(EMPTY, more) if can_stop else more
            self.rules[name] = body
            return Ref(name)

        return rest(0, 0)

    def _key(self, name: str) -> Expr:
        text = json.dumps(name, ensure_ascii=False)
        return lit(text + ":") if not self.ws_term else seq(lit(text), self._punct(":"))

    def _names_dfa(self, rule: Any, ptr: str) -> tuple[ByteDFA | bool, str]:
        """The keys (JSON-quoted) `propertyNames` allows beyond the listed properties: (a DFA, or False
        for none; a name for it)."""
        label = json.dumps(rule, sort_keys=True)
        if rule is False:
            return False, label
        budget = self.budget.max_terminal_states
        lo, hi = rule.get("minLength", 0), rule.get("maxLength")
        if lo > MAX_PRODUCT_LENGTH:
            raise SchemaError(f"{ptr}/propertyNames/minLength: over {MAX_PRODUCT_LENGTH} is not supported")
        hi = None if hi is None and lo == 0 else min(MAX_PRODUCT_LENGTH if hi is None else hi, MAX_PRODUCT_LENGTH)
        dfa = counted_string_dfa(lo, hi)
        parts = []
        if "pattern" in rule:
            try:
                parts.append(terminal_dfa(f'"{ecma_string_pattern(rule["pattern"])}"', budget))
            except ValueError as e:
                raise SchemaError(f"{ptr}/propertyNames/pattern: {e}") from None
        for key in ("enum", "const"):
            if key in rule:
                values = rule[key] if key == "enum" else [rule[key]]
                words = [json.dumps(v, ensure_ascii=False).encode() for v in values if isinstance(v, str)]
                parts.append(literals_dfa(words) if words else None)
        for part in parts:
            if dfa is not None:
                dfa = dfa_intersection(dfa, part, budget, self.deadline.check) if part is not None else None
        return (dfa if dfa is not None else False), label

    def _key_terminal(self, regex: str, names: list[str], patterns: list[str],
                      allowed: tuple[ByteDFA | bool, str] | None = None) -> Terminal | None:
        """Keys matching `regex` (and propertyNames' `allowed` keys, _names_dfa) but none of the listed
        `names` (JSON-quoted) nor other `patterns` (regexes); None if no key is left."""
        if allowed is not None and allowed[0] is False:
            return None
        budget = self.budget.max_terminal_states
        dfa = terminal_dfa(regex, budget)
        if dfa is not None and allowed is not None:
            dfa = dfa_intersection(dfa, allowed[0], budget, self.deadline.check)
        if dfa is not None and names:
            dfa = dfa_difference(dfa, literals_dfa([n.encode() for n in names]), budget, self.deadline.check)
        for pattern in patterns:
            if dfa is not None:
                other = terminal_dfa(pattern, budget)
                dfa = dfa_difference(dfa, other, budget, self.deadline.check) if other is not None else dfa
        if dfa is None:
            return None
        excluded = names + patterns
        if allowed is not None:  # terminals are shared by key: name the filter too
            excluded.append(f"propertyNames:{allowed[1]}")
        return Terminal(key=f"key:{regex}\0" + "\0".join(excluded), dfa=dfa)

    # ---- arrays ------------------------------------------------------------------------------------
    def _array(self, schema: dict, ptr: str) -> Expr:
        lo, hi = _counts(schema, "minItems", "maxItems", ptr)
        if schema.get("uniqueItems") is True:  # sound approximation: arrays of at most one item
            if lo > 1:
                raise SchemaError(f"{ptr}/uniqueItems: uniqueItems with minItems > 1 is not supported")
            hi = 1 if hi is None else min(hi, 1)
        # Items past the prefix that `items` does not cover are the unevaluated ones.
        items, prefix = schema.get("items", schema.get("unevaluatedItems", True)), schema.get("prefixItems")
        if isinstance(items, list):  # draft 4-2019 tuple form
            prefix, items = items, schema.get("additionalItems", True)
        if "contains" in schema:
            contains_lo, contains_hi = _counts(schema, "minContains", "maxContains", ptr)
            if "minContains" not in schema:
                contains_lo = 1
            if contains_lo or contains_hi is not None:
                return self._contains(schema, items, prefix, lo, hi, contains_lo, contains_hi, ptr)
        parts = [self._shared(self.value(p, f"{ptr}/prefixItems/{i}"), f"{ptr}/prefixItems/{i}")
                 for i, p in enumerate(prefix or [])]
        rest = self._shared(self.value(items, f"{ptr}/items"), f"{ptr}/items") if items is not False else NOTHING
        return self._items(parts, rest, lo, hi)

    def _items(self, parts: list[Expr], rest: Expr, lo: int, hi: int | None) -> Expr:
        """`[`, the prefix items `parts`, then `rest` items, lo..hi in all, `]`."""
        if parts:
            body = self._prefix_body(parts, rest, lo, hi)
        elif hi is not None and hi < max(lo, 1):
            body = EMPTY if lo == 0 else NOTHING
        else:
            more = Repeat(seq(self._punct(","), rest), max(lo - 1, 0), None if hi is None else hi - 1)
            body = seq(rest, more) if lo else opt(seq(rest, more))
        return seq(self._punct("["), body, self._punct("]"))

    def _contains(self, schema: dict, items: Any, prefix: Any, lo: int, hi: int | None, contains_lo: int,
                  contains_hi: int | None, ptr: str) -> Expr:
        """Arrays with contains_lo..contains_hi items valid under `contains`. Unbounded: [item, ...,
        match, ..., match, item, ...] (contains_lo matches in a row); otherwise (maxContains, maxItems,
        minItems > 1, prefixItems) every item matches and the length stays within both ranges: a
        sound subset, since telling a non-matching item apart would need the complement of `contains`."""
        match_ptr = f"{ptr}/contains"
        if not prefix and hi is None and lo <= contains_lo and contains_hi is None:
            item = self._shared(self.value(items, f"{ptr}/items"), f"{ptr}/items")
            match = self._shared(self.value({"allOf": [items, schema["contains"]]}, match_ptr), match_ptr)
            comma = self._punct(",")
            matches = seq(match, Repeat(seq(comma, match), contains_lo - 1, contains_lo - 1))
            return seq(self._punct("["), Repeat(seq(item, comma)), matches, Repeat(seq(comma, item)),
                       self._punct("]"))
        lo = max(lo, contains_lo)
        hi = contains_hi if hi is None else hi if contains_hi is None else min(hi, contains_hi)
        if hi is not None and hi < lo:
            return NOTHING
        parts = [self._shared(self.value({"allOf": [p, schema["contains"]]}, f"{ptr}/prefixItems/{i}"),
                              f"{ptr}/prefixItems/{i}") for i, p in enumerate(prefix or [])]
        rest = self._shared(self.value({"allOf": [items, schema["contains"]]}, match_ptr), match_ptr) \
            if items is not False else NOTHING
        return self._items(parts, rest, lo, hi)

    def _prefix_body(self, parts: list[Expr], rest: Expr, lo: int, hi: int | None) -> Expr:
        comma = self._punct(",")
        n = len(parts)
        if hi is not None and hi < n:
            parts = parts[:hi]
            n = hi
        more_lo = max(lo - n, 0)
        more_hi = None if hi is None else hi - n
        more = EMPTY if rest is NOTHING or more_hi == 0 else Repeat(seq(comma, rest), more_lo, more_hi)
        if more is EMPTY and more_lo > 0:
            return NOTHING
        body = more
        for j in range(n - 1, -1, -1):
            item = seq(comma, parts[j]) if j else parts[j]
            body = seq(item, body)
            if j >= lo:  # j items are enough: the rest may be left out
                body = opt(body)
        return body

    # ---- oneOf -------------------------------------------------------------------------------------
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

    def _conditional(self, schema: dict, ptr: str) -> Expr:
        """if/then/else: values of `if` and `then`, or of `not: if` and `else` where `not` can say it
        (else the former only: a sound subset)."""
        through_if = self.value(_through_if(schema), ptr)
        if schema["if"] is False or schema["if"] is True:
            return through_if
        rest = {k: v for k, v in schema.items() if k not in ("if", "then", "else")}
        other = self._attempt({"allOf": [{"not": schema["if"]}, schema.get("else", True), rest]}, f"{ptr}/else")
        return through_if if isinstance(other, SchemaError) else alt(through_if, other)

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


# The keywords that constrain values (JSON Schema 2020-12 and earlier drafts, OpenAPI's nullable);
# anything else is an annotation (description, markdownDescription, x-..., ...) and is ignored.
_KNOWN = {
    "type", "enum", "const", "properties", "required", "additionalProperties", "patternProperties",
    "minProperties", "maxProperties", "propertyNames", "unevaluatedProperties", "unevaluatedItems", "items",
    "prefixItems", "additionalItems", "minItems", "maxItems", "contains", "minContains", "maxContains",
    "uniqueItems", "minLength", "maxLength", "pattern", "format", "minimum", "maximum", "exclusiveMinimum",
    "exclusiveMaximum", "multipleOf", "anyOf", "oneOf", "allOf", "not", "if", "then", "else", "$ref",
    "nullable", "dependentRequired", "dependentSchemas", "dependencies", "$dynamicRef", "$recursiveRef",
    _NOT_STRINGS,
}


MAX_MODULUS = 10_000  # multipleOf's DFA has a state per remainder
MAX_ANY_ORDER = 3  # keys listed only in required: up to this many in any order (n! orders), more in theirs
# Length bounds intersected with another automaton (pattern, propertyNames): the product has a copy of it
# per character position and minimizing it is quadratic, so the bounds are kept small. propertyNames'
# maxLength is tightened to this for keys beyond the listed properties (sound: fewer keys), larger
# minLengths and string bounds next to a pattern or format are refused.
MAX_PRODUCT_LENGTH = 64


@functools.lru_cache(maxsize=64)
def multiples_dfa(m: int) -> ByteDFA:
    """JSON integers that are multiples of m: a state per remainder of the digits read so far."""
    start, minus, zero, rem = 0, 1, 2, 3  # rem + r: a nonzero start, remainder r
    trans = np.full((rem + m, 256), -1, dtype=np.int32)
    digits = np.arange(ord("0"), ord("9") + 1)
    trans[start, ord("-")] = minus
    for s in (start, minus):
        trans[s, ord("0")] = zero
        trans[s, digits[1:]] = rem + np.arange(1, 10) % m
    trans[rem:, digits] = rem + (10 * np.arange(m)[:, None] + np.arange(10)[None, :]) % m
    accepting = np.zeros(rem + m, dtype=bool)
    accepting[[zero, rem]] = True
    return ByteDFA(transitions=trans, accepting=accepting)


def _asserts_formats(root: Any) -> bool:
    """Whether `format` constrains strings: yes, unless the schema declares draft 2019-09 or 2020-12,
    where `format` is an annotation (only a metaschema's format-assertion vocabulary makes it assert,
    and metaschemas are remote)."""
    declared = root.get("$schema") if isinstance(root, dict) else None
    return not (isinstance(declared, str) and ("/draft/2019-09/" in declared or "/draft/2020-12/" in declared))


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


def _pattern_matches(pattern: str, name: str, ptr: str = "#") -> bool:
    """ECMA-262 search of `pattern` in a property name (Python's `re` with ASCII classes)."""
    try:
        return re.search(pattern, name, re.ASCII) is not None
    except re.error as e:
        raise SchemaError(f"{ptr}/patternProperties: invalid pattern {pattern!r}: {e}") from None


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


def _counts(schema: dict, low: str, high: str, ptr: str) -> tuple[int, int | None]:
    """(schema[low] or 0, schema[high] or None) as ints: whole numbers, 2.0 included (JSON Schema's
    non-negative integers may be written so)."""
    out = []
    for key, default in ((low, 0), (high, None)):
        value = schema.get(key, default)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or value != int(value):
                raise SchemaError(f"{ptr}/{key}: must be a non-negative integer, got {value!r}")
            value = int(value)
        out.append(value)
    return out[0], out[1]


def _types_only(sub: Any) -> bool:
    """Whether `not: sub` only removes types (value() filters the types for it)."""
    return sub is True or sub == {} or isinstance(sub, dict) and set(sub) - _IGNORED == {"type"}


def _opened(schema: dict) -> dict:
    """What a part added to `schema` by an allOf must carry so that an object listing no keys stays open
    (_object closes objects that list keys and say nothing of others: the documented strictness)."""
    listed = ("properties", "patternProperties", "additionalProperties", "unevaluatedProperties")
    return {} if any(k in schema for k in listed) else {"additionalProperties": True}


def _discriminated(parts: list[tuple[Any, tuple]]) -> list[tuple[Any, tuple]]:
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
                    return key, json.dumps(sub["const"], sort_keys=True)
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


def _through_if(schema: dict) -> dict:
    """if/then/else generated through its `if` branch: instances of if and then (a sound subset)."""
    rest = {k: v for k, v in schema.items() if k not in ("if", "then", "else")}
    if schema["if"] is False:  # no value matches `if`: every value takes `else`
        return {"allOf": [schema.get("else", True), rest]}
    return {"allOf": [schema["if"], schema.get("then", True), rest]}


def _same_json(a: Any, b: Any) -> bool:
    """Equal as JSON Schema compares values (1 == 1.0; true is not 1)."""
    return _json_type(a) in ("integer", "number") and _json_type(b) in ("integer", "number") and a == b or \
        json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "integer" if value.is_integer() else "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def ecma_string_pattern(pattern: str) -> str:
    """A JSON schema `pattern` (ECMA-262: a search, `\\d` `\\w` ASCII) as a regex over the JSON-escaped
    string content, for a full match between the quotes: an end without an anchor accepts any characters
    there. An end anchored on some alternatives only is treated as anchored (a subset: still sound)."""
    body = js.json_string_pattern(pattern, ascii_classes=True)
    tree = list(js.sre_p.parse(pattern))
    any_chars = f"{js.STRING_CHAR}*"
    if _anchor(tree, 0) == "none":
        body = any_chars + body
    if _anchor(tree, -1) == "none":
        body = body + any_chars
    return body


_STARTS = (js.sre_c.AT_BEGINNING, js.sre_c.AT_BEGINNING_STRING)
_ENDS = (js.sre_c.AT_END, js.sre_c.AT_END_STRING)


def _anchor(items: list, side: int) -> str:
    """'all', 'none' or 'mixed': whether the parsed pattern is anchored at its start (side 0) or end (-1)."""
    if not items:
        return "none"
    op, av = items[side]
    if op is js.sre_c.AT:
        return "all" if av in (_STARTS if side == 0 else _ENDS) else "none"
    if op is js.sre_c.SUBPATTERN:
        return _anchor(list(av[3]), side)
    if op is js.sre_c.BRANCH:
        kinds = {_anchor(list(b), side) for b in av[1]}
        return kinds.pop() if len(kinds) == 1 else "mixed"
    return "none"
