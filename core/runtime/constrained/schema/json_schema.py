"""JSON schema -> a regex whose every full match is a JSON document valid under the schema.

Supported: type (one or a list), enum, const, properties (in schema order), required, additionalProperties,
nested objects and arrays (items, prefixItems, minItems, maxItems), string minLength/maxLength, pattern,
format (date, time, date-time, uuid, email, uri), integer (with minimum/maximum, exclusive or not),
number (integer bounds), boolean, null, anyOf, oneOf, allOf, local $ref (recursion cut at a depth),
OpenAPI's nullable; a pydantic model class is read through its model_json_schema().

Output is compact by default; `whitespace_pattern` (a regex) goes between structural tokens instead.
Objects contain exactly the listed properties (optional ones may be left out); objects without
properties take any keys. Keywords that constrain values in ways a regex here does not capture
(not, if/then/else, multipleOf, uniqueItems, ...) raise ValueError rather than give invalid output.
oneOf is generated like anyOf: its branches should be disjoint.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any
from urllib.parse import unquote

from radixlm.core.runtime.constrained.automata import charsets
from radixlm.core.runtime.constrained.automata.regex_dfa import char_set_ranges, sre_c, sre_p, unsupported_construct

# One JSON string character: unescaped (no quote, backslash or control character) or an escape. \u
# escapes of surrogates are left out: they decode to lone surrogates, or a pair counts as two.
STRING_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u(?:[0-9a-cA-CefEF][0-9a-fA-F]{3}|[dD][0-7][0-9a-fA-F]{2}))'
STRING = f'"{STRING_CHAR}*"'
INTEGER = r"-?(?:0|[1-9][0-9]*)"
NUMBER = INTEGER + r"(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
BOOLEAN = r"(?:true|false)"
NULL = "null"

_YEAR = r"(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"
_LEAP_YEAR = r"(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_DATE = (
    rf"(?:{_YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
    rf"|02-(?:0[1-9]|1[0-9]|2[0-8]))|{_LEAP_YEAR}-02-29)"
)
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,6})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_URI_CHAR = r"(?:[A-Za-z0-9._~!$&'()*+,;=:@-]|%[0-9A-Fa-f]{2})"
_HOST_CHAR = r"(?:[A-Za-z0-9._~!$&'()*+,;=-]|%[0-9A-Fa-f]{2})"
# RFC 3986's authority: [userinfo "@"] host [":" port], the port digits only (a ':' in the host is a port).
_AUTHORITY = rf"(?:(?:{_HOST_CHAR}|:)*@)?{_HOST_CHAR}+(?::[0-9]*)?"
FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": f"{_DATE}T{_TIME}",
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    "email": r"[A-Za-z0-9!#$%&'*+=?^_`{|}~-]+(?:\.[A-Za-z0-9!#$%&'*+=?^_`{|}~-]+)*"
             r"@(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?\.)+[A-Za-z]{2,}",
    "uri": rf"[A-Za-z][A-Za-z0-9+.-]*://{_AUTHORITY}(?:/{_URI_CHAR}*)*(?:\?(?:{_URI_CHAR}|[/?])*)?(?:#(?:{_URI_CHAR}|[/?])*)?",
}

# Keywords that only annotate, or hold definitions: ignored.
_ANNOTATIONS = {
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "$defs", "definitions",
    "readOnly", "writeOnly", "deprecated", "contentMediaType", "contentEncoding", "discriminator", "format",
}
_UNSUPPORTED = {
    "not", "if", "then", "else", "multipleOf", "minProperties", "maxProperties", "patternProperties",
    "dependentRequired", "dependentSchemas", "dependencies", "propertyNames", "contains", "minContains",
    "maxContains", "unevaluatedProperties", "unevaluatedItems", "$dynamicRef", "$recursiveRef",
}
DEFAULT_MAX_RECURSION = 3
ANY_VALUE_DEPTH = 2  # nesting allowed inside values of unconstrained type


def json_schema_to_regex(schema: Any, whitespace_pattern: str | None = None,
                         max_recursion_depth: int = DEFAULT_MAX_RECURSION) -> str:
    """A regex for JSON documents valid under `schema` (a JSON string, a dict, a bool or a pydantic model
    class). ValueError naming the problem when the schema is invalid or uses something unsupported."""
    root = _load_schema(schema)
    ws = whitespace_pattern or ""
    if ws:
        try:
            re.compile(ws)
        except re.error as e:
            raise ValueError(f"invalid whitespace_pattern {ws!r}: {e}") from None
    out = _Converter(root, ws, max_recursion_depth).regex(root, ())
    if out is None:
        raise ValueError("the JSON schema admits no value that can be generated "
                         "(contradictory constraints, or recursion without a way to stop)")
    return out


def _load_schema(schema: Any) -> Any:
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):  # a pydantic model class
        return schema.model_json_schema()
    if isinstance(schema, (str, bytes)):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"json_schema is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"a JSON schema must be an object or a boolean, got {type(schema).__name__}")
    return schema


def _literal(value: Any) -> str:
    return re.escape(json.dumps(value, separators=(",", ":"), ensure_ascii=False))


def _alternation(parts: list[str | None]) -> str | None:
    parts = list(dict.fromkeys(p for p in parts if p is not None))
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


def _repeat(item: str, lo: int, hi: int | None) -> str:
    if hi is None:
        return f"(?:{item}){{{lo},}}" if lo else f"(?:{item})*"
    return f"(?:{item}){{{lo},{hi}}}" if lo != hi else f"(?:{item}){{{lo}}}"


class _Converter:
    def __init__(self, root: Any, ws: str, max_recursion: int) -> None:
        self.root = root
        self.ws = ws
        self.max_recursion = max_recursion

    # -- helpers ------------------------------------------------------------------------------------
    def _resolve(self, ref: str) -> Any:
        if not ref.startswith("#"):
            raise ValueError(f"only local $ref ('#/...') is supported, got {ref!r}")
        node = self.root
        for part in [p for p in unquote(ref[1:]).split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise ValueError(f"$ref {ref!r} does not resolve")
        return node

    def _merge(self, schemas: list[Any], refs: tuple) -> dict | bool:
        """allOf: one schema holding every constraint (properties merged, required united, types intersected)."""
        merged: dict[str, Any] = {}
        for sub in schemas:
            sub, sub_refs = self._deref(sub, refs)
            if sub is True:
                continue
            if isinstance(sub, dict) and "allOf" in sub:
                sub = self._merge(sub["allOf"] + [{k: v for k, v in sub.items() if k != "allOf"}], sub_refs)
            if sub is False:
                return False
            if not isinstance(sub, dict):
                raise ValueError(f"a JSON schema must be an object or a boolean, got {sub!r}")
            for key, value in sub.items():
                if key in _ANNOTATIONS and key != "format":
                    continue
                if key not in merged:
                    merged[key] = value
                elif key == "properties":
                    props = dict(merged[key])
                    for name, s in value.items():
                        props[name] = {"allOf": [props[name], s]} if name in props else s
                    merged[key] = props
                elif key == "required":
                    merged[key] = list(dict.fromkeys(list(merged[key]) + list(value)))
                elif key == "type":
                    a = set(merged[key]) if isinstance(merged[key], list) else {merged[key]}
                    b = set(value) if isinstance(value, list) else {value}
                    if "number" in a and "integer" in b or "number" in b and "integer" in a:
                        a |= {"integer"}
                        b |= {"integer"}
                    merged[key] = sorted(a & b)
                elif merged[key] != value:
                    merged[key] = self._combine(key, merged[key], value)
        return merged

    def _combine(self, key: str, a: Any, b: Any) -> Any:
        """One value of `key` meaning both `a` and `b` (two parts of an allOf disagree)."""
        raise ValueError(f"allOf with different values for {key!r} is not supported")

    def _deref(self, schema: Any, refs: tuple) -> tuple[Any, tuple]:
        """Follows $ref (with sibling keywords merged in); `refs` is the chain of refs being expanded."""
        while isinstance(schema, dict) and "$ref" in schema:
            ref = schema["$ref"]
            if refs.count(ref) >= self.max_recursion:
                return False, refs
            target = self._resolve(ref)
            refs = refs + (ref,)
            rest = {k: v for k, v in schema.items() if k != "$ref" and k not in _ANNOTATIONS}
            schema = {"allOf": [target, rest]} if rest else target
        return schema, refs

    def _sep(self, token: str) -> str:
        return f"{self.ws}{token}{self.ws}" if self.ws else token

    # -- the conversion -----------------------------------------------------------------------------
    def regex(self, schema: Any, refs: tuple) -> str | None:
        """A regex for the instances of `schema`, or None if it admits none we can generate."""
        schema, refs = self._deref(schema, refs)
        if schema is True or schema == {}:
            return self._any_value(ANY_VALUE_DEPTH)
        if schema is False:
            return None
        if not isinstance(schema, dict):
            raise ValueError(f"a JSON schema must be an object or a boolean, got {schema!r}")
        bad = sorted(k for k in schema if k in _UNSUPPORTED)
        if bad:
            raise ValueError(f"JSON schema keyword(s) {bad} are not supported")
        if schema.get("uniqueItems"):
            raise ValueError("JSON schema keyword 'uniqueItems' is not supported")
        if "allOf" in schema:
            merged = self._merge(schema["allOf"] + [{k: v for k, v in schema.items() if k != "allOf"}], refs)
            return self.regex(merged, refs)
        for key in ("anyOf", "oneOf"):
            if key in schema:
                rest = {k: v for k, v in schema.items() if k != key and k not in _ANNOTATIONS}
                branches = [{"allOf": [b, rest]} if rest else b for b in schema[key]]
                return _alternation([self.regex(b, refs) for b in branches])
        if schema.get("nullable") is True:
            rest = {k: v for k, v in schema.items() if k != "nullable"}
            return _alternation([self.regex(rest, refs), NULL])
        if "const" in schema:
            return _literal(schema["const"])
        if "enum" in schema:
            if not isinstance(schema["enum"], list) or not schema["enum"]:
                raise ValueError("'enum' must be a non-empty list")
            return _alternation([_literal(v) for v in schema["enum"]])
        types = schema.get("type")
        if types is None:
            types = self._implied_type(schema)
        if isinstance(types, list):
            return _alternation([self.regex(schema | {"type": t}, refs) for t in types])
        handlers = {"string": self._string, "integer": self._integer, "number": self._number,
                    "boolean": lambda s, r: BOOLEAN, "null": lambda s, r: NULL,
                    "object": self._object, "array": self._array}
        if types not in handlers:
            raise ValueError(f"unknown JSON schema type {types!r}")
        return handlers[types](schema, refs)

    @staticmethod
    def _implied_type(schema: dict) -> Any:
        if any(k in schema for k in ("properties", "required", "additionalProperties")):
            return "object"
        if any(k in schema for k in ("items", "prefixItems", "minItems", "maxItems")):
            return "array"
        if any(k in schema for k in ("pattern", "minLength", "maxLength")):
            return "string"
        if any(k in schema for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")):
            return "number"
        return ["string", "number", "boolean", "null", "object", "array"]

    def _any_value(self, depth: int) -> str:
        scalars = [STRING, NUMBER, BOOLEAN, NULL]
        if depth == 0:
            return _alternation(scalars)
        inner = self._any_value(depth - 1)
        comma, colon = self._sep(","), self._sep(":")
        array = rf"\[{self.ws}(?:{inner}(?:{comma}{inner})*)?{self.ws}\]"
        member = f"{STRING}{colon}{inner}"
        obj = rf"\{{{self.ws}(?:{member}(?:{comma}{member})*)?{self.ws}\}}"
        return _alternation(scalars + [array, obj])

    def _string(self, schema: dict, refs: tuple) -> str | None:
        lo, hi = schema.get("minLength", 0), schema.get("maxLength")
        if not isinstance(lo, int) or hi is not None and not isinstance(hi, int):
            raise ValueError("minLength and maxLength must be integers")
        if hi is not None and hi < lo:
            return None
        fmt, pattern = schema.get("format"), schema.get("pattern")
        if pattern is not None:
            if "minLength" in schema or "maxLength" in schema:
                raise ValueError("'pattern' together with 'minLength'/'maxLength' is not supported")
            return f'"{json_string_pattern(pattern)}"'
        if fmt in FORMATS:
            if "minLength" in schema or "maxLength" in schema:
                raise ValueError(f"format {fmt!r} together with 'minLength'/'maxLength' is not supported")
            return f'"{FORMATS[fmt]}"'
        if lo == 0 and hi is None:
            return STRING
        return '"' + _repeat(STRING_CHAR, lo, hi) + '"'

    def _integer(self, schema: dict, refs: tuple) -> str | None:
        lo, hi = _int_bounds(schema)
        if lo is None and hi is None:
            return INTEGER
        if lo is not None and hi is not None and lo > hi:
            return None
        return int_range_regex(lo, hi)

    def _number(self, schema: dict, refs: tuple) -> str | None:
        if not any(k in schema for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")):
            return NUMBER
        if any(k in schema for k in ("exclusiveMinimum", "exclusiveMaximum")):
            raise ValueError("exclusiveMinimum/exclusiveMaximum on 'number' are not supported (use integer bounds)")
        lo, hi = schema.get("minimum"), schema.get("maximum")
        for bound in (lo, hi):
            if bound is not None and (not isinstance(bound, (int, float)) or bound != int(bound)):
                raise ValueError("minimum/maximum on 'number' are supported only when they are whole numbers")
        lo = None if lo is None else int(lo)
        hi = None if hi is None else int(hi)
        if lo is not None and hi is not None and lo > hi:
            return None
        return number_range_regex(lo, hi)

    def _object(self, schema: dict, refs: tuple) -> str | None:
        props = schema.get("properties") or {}
        if not isinstance(props, dict):
            raise ValueError("'properties' must be an object")
        required = schema.get("required") or []
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise ValueError("'required' must be a list of strings")
        colon, comma = self._sep(":"), self._sep(",")
        open_, close = rf"\{{{self.ws}", rf"{self.ws}\}}"
        extra = schema.get("additionalProperties", True)
        if not props and not required:
            if extra is False:
                return open_ + close
            value = self._any_value(ANY_VALUE_DEPTH - 1) if extra is True else self.regex(extra, refs)
            if value is None:
                return open_ + close
            member = f"{STRING}{colon}{value}"
            return f"{open_}(?:{member}(?:{comma}{member})*)?{close}"

        names = list(props) + [r for r in required if r not in props]
        items: list[tuple[str, bool]] = []  # (regex of '"key":value', required)
        for name in names:
            value = self.regex(props.get(name, True), refs)
            if value is None:
                if name in required:
                    return None
                continue
            items.append((_literal(name) + colon + value, name in required))
        if not items:
            return open_ + close
        # After the first present member every further one is ',member'; optional ones may be absent.
        # rest[i]: members i.. once one has been written. The body is an alternation over which member
        # comes first: any optional one before the first required one (or none at all if none is required).
        rest = [""] * (len(items) + 1)
        for i in range(len(items) - 1, -1, -1):
            item, req = items[i]
            rest[i] = (f"{comma}{item}" if req else f"(?:{comma}{item})?") + rest[i + 1]
        firsts, may_be_empty = [], True
        for i, (item, req) in enumerate(items):
            firsts.append(item + rest[i + 1])
            if req:
                may_be_empty = False
                break
        body = _alternation(firsts)
        if may_be_empty:
            body = f"(?:{body})?"
        return f"{open_}{body}{close}"

    def _array(self, schema: dict, refs: tuple) -> str | None:
        lo, hi = schema.get("minItems", 0), schema.get("maxItems")
        if not isinstance(lo, int) or hi is not None and not isinstance(hi, int):
            raise ValueError("minItems and maxItems must be integers")
        comma = self._sep(",")
        open_, close = rf"\[{self.ws}", rf"{self.ws}\]"
        items, prefix = schema.get("items", True), schema.get("prefixItems")
        if isinstance(items, list):  # draft 4-2019 tuple form
            prefix, items = items, schema.get("additionalItems", True)
        if prefix:
            return self._tuple(prefix, items, lo, hi, refs)
        if hi is not None and (hi < lo or hi == 0):
            return open_ + close if lo == 0 else None
        item = self.regex(items, refs)
        if item is None:
            return open_ + close if lo == 0 else None
        more = _repeat(f"{comma}{item}", max(lo - 1, 0), None if hi is None else hi - 1)
        if lo == 0:
            return f"{open_}(?:{item}{more})?{close}"
        return f"{open_}{item}{more}{close}"

    def _tuple(self, prefix: list, rest: Any, lo: int, hi: int | None, refs: tuple) -> str | None:
        """prefixItems: exactly the listed items, then (if allowed) more of `rest`, within [lo, hi]."""
        comma = self._sep(",")
        k = len(prefix)
        if hi is not None and hi < k or k < lo and rest is False:
            raise ValueError("prefixItems with minItems/maxItems that cut the tuple are not supported")
        parts = [self.regex(p, refs) for p in prefix]
        if any(p is None for p in parts):
            return None
        body = comma.join(parts)
        rest_item = self.regex(rest, refs) if rest is not False else None
        if rest_item is not None and (hi is None or hi > k):
            body += _repeat(f"{comma}{rest_item}", max(lo - k, 0), None if hi is None else hi - k)
        elif k < lo:
            return None
        return rf"\[{self.ws}{body}{self.ws}\]"


def _int_bounds(schema: dict) -> tuple[int | None, int | None]:
    lo = hi = None
    if "minimum" in schema:
        lo = math.ceil(schema["minimum"])
    if "exclusiveMinimum" in schema and not isinstance(schema["exclusiveMinimum"], bool):
        lo = max(lo if lo is not None else -math.inf, math.floor(schema["exclusiveMinimum"]) + 1)
    if "maximum" in schema:
        hi = math.floor(schema["maximum"])
    if "exclusiveMaximum" in schema and not isinstance(schema["exclusiveMaximum"], bool):
        hi = min(hi if hi is not None else math.inf, math.ceil(schema["exclusiveMaximum"]) - 1)
    if isinstance(schema.get("exclusiveMinimum"), bool) or isinstance(schema.get("exclusiveMaximum"), bool):
        raise ValueError("boolean exclusiveMinimum/exclusiveMaximum (draft 4) are not supported")
    return (None if lo is None else int(lo)), (None if hi is None else int(hi))


def _digits_range(a: str, b: str) -> list[str]:
    """Alternatives matching the digit strings of one length from a to b (a <= b, same length)."""
    n = len(a)
    if a == b:
        return [a]
    if a == "0" * n and b == "9" * n:
        return [f"[0-9]{{{n}}}" if n > 1 else "[0-9]"]
    if n == 1:
        return [f"[{a}-{b}]"]
    if a[0] == b[0]:
        return [a[0] + r for r in _digits_range(a[1:], b[1:])]
    out = [a[0] + r for r in _digits_range(a[1:], "9" * (n - 1))]
    if int(b[0]) - int(a[0]) > 1:
        out.append(f"[{int(a[0]) + 1}-{int(b[0]) - 1}][0-9]{{{n - 1}}}")
    out += [b[0] + r for r in _digits_range("0" * (n - 1), b[1:])]
    return out


def _natural_range(a: int, b: int | None) -> list[str]:
    """Alternatives for the canonical decimal forms of a..b (b None: unbounded), 0 <= a."""
    out = []
    top_len = len(str(b)) if b is not None else len(str(a))
    for length in range(len(str(a)), top_len + 1):
        lo = max(a, 10 ** (length - 1) if length > 1 else 0)
        hi = 10 ** length - 1 if b is None or length < len(str(b)) else b
        if lo <= hi:
            out += _digits_range(str(lo), str(hi))
    if b is None:
        out.append(f"[1-9][0-9]{{{len(str(a))},}}")
    return out


def int_range_regex(lo: int | None, hi: int | None) -> str:
    """The canonical JSON forms of the integers in [lo, hi] (None: unbounded on that side)."""
    parts = []
    if hi is None or hi >= 0:  # the non-negative part
        parts += _natural_range(max(lo, 0) if lo is not None else 0, hi)
    if lo is None or lo < 0:  # the negative part: '-' and a magnitude in [max(1, -hi), -lo]
        mags = _natural_range(max(1, -hi) if hi is not None else 1, None if lo is None else -lo)
        parts += ["-" + m for m in mags]
    return "(?:" + "|".join(parts) + ")"


def number_range_regex(lo: int | None, hi: int | None) -> str:
    """JSON numbers in [lo, hi] for whole-number bounds: integers, and decimals whose integer part
    keeps every fraction inside the range. No exponent forms."""
    alternatives = [int_range_regex(lo, hi)]
    frac = r"\.[0-9]+"
    # x = I.f >= 0 lies in [I, I+1): needs lo <= I and I+1 <= hi.
    if hi is None or hi >= 1:
        top, low = (None if hi is None else hi - 1), max(lo or 0, 0)
        if top is None or low <= top:
            alternatives.append(f"(?:{'|'.join(_natural_range(low, top))}){frac}")
    # x = -I.f lies in (-(I+1), -I]: needs -(I+1) >= lo and -I <= hi.
    if lo is None or lo <= -1:
        top = None if lo is None else -lo - 1
        low = max(0, -hi) if hi is not None else 0
        if top is None or low <= top:
            alternatives.append(f"-(?:{'|'.join(_natural_range(low, top))}){frac}")
    return "(?:" + "|".join(alternatives) + ")"


_JSON_SPECIALS: charsets.Ranges = ((0, 0x1F), (0x22, 0x22), (0x5C, 0x5C))


def json_string_pattern(pattern: str, ascii_classes: bool = False, free: tuple[bool, bool] = (False, False)) -> str:
    """`pattern` (a regex over decoded string content) rewritten over the JSON-escaped content: every
    character set loses quote, backslash and control characters, and matches their escapes instead.
    Anchors at the ends are dropped (the string's quotes anchor it). `ascii_classes`: `\\d \\w \\s`
    match ASCII only (ECMA-262's `\\d` and `\\w`; its `\\s` is wider, so `\\S` may admit Unicode spaces).
    `free` (start, end): any characters may come before / after the match (a search, unanchored there);
    a repetition at such an end then needs only its least count (the same language, a smaller automaton:
    "$[a-z]{1,255}" searched is "$[a-z]" searched)."""
    try:
        tree = sre_p.parse(pattern)
    except re.error as e:
        raise ValueError(f"invalid 'pattern' {pattern!r}: {e}") from None
    return _emit(tree, tree.state.flags | (re.ASCII if ascii_classes else 0), True, True, free)


def _emit(seq, flags: int, at_start: bool, at_end: bool, free: tuple[bool, bool] = (False, False)) -> str:
    items = list(seq)
    out = []
    for i, (op, av) in enumerate(items):
        first = at_start and all(o is sre_c.AT for o, _ in items[:i])
        last = at_end and all(o is sre_c.AT for o, _ in items[i + 1:])
        out.append(_emit_node(op, av, flags, first, last, (free[0] and i == 0, free[1] and i == len(items) - 1)))
    return "".join(out)


def _emit_node(op, av, flags: int, at_start: bool, at_end: bool, free: tuple[bool, bool]) -> str:
    if op in (sre_c.LITERAL, sre_c.NOT_LITERAL, sre_c.ANY, sre_c.IN):
        return _escaped_char_set(char_set_ranges(op, av, flags))
    if op is sre_c.SUBPATTERN:
        _group, add_flags, del_flags, sub = av
        return f"(?:{_emit(sub, (flags | add_flags) & ~del_flags, at_start, at_end, free)})"
    if op is sre_c.BRANCH:
        return "(?:" + "|".join(_emit(alt, flags, at_start, at_end, free) for alt in av[1]) + ")"
    if op in (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT):
        lo, hi, sub = av
        if any(free):  # a match with more repetitions holds one with `lo` of them
            return _repeat(_emit(sub, flags, False, False), lo, lo) if lo else ""
        return _repeat(_emit(sub, flags, False, False), lo, None if hi == sre_c.MAXREPEAT else hi)
    if op is sre_c.AT:
        if av in (sre_c.AT_BEGINNING, sre_c.AT_BEGINNING_STRING) and at_start:
            return ""
        if av in (sre_c.AT_END, sre_c.AT_END_STRING) and at_end:
            return ""
        raise ValueError(f"unsupported construct in 'pattern': anchor or boundary {av}")
    name = unsupported_construct(op, av)
    raise ValueError(f"unsupported construct in 'pattern': {name or op}")


def _escaped_char_set(ranges: charsets.Ranges) -> str:
    plain = charsets.subtract(ranges, _JSON_SPECIALS)
    alternatives = []
    if plain:
        alternatives.append("[" + "".join(
            f"\\U{lo:08x}" if lo == hi else f"\\U{lo:08x}-\\U{hi:08x}" for lo, hi in plain) + "]")
    # The escapes json.dumps writes for quote, backslash and controls, grouped: a backslash and one of
    # the letters, or "\u00" and hex digits by the third one (was one alternative per character: ~34
    # per `.` of a pattern, which made its automaton's construction several times slower).
    escapes = [json.dumps(chr(c))[1:-1] for lo, hi in charsets.intersect(ranges, _JSON_SPECIALS)
               for c in range(lo, hi + 1)]
    letters = "".join(e[1] for e in escapes if len(e) == 2)
    if letters:
        alternatives.append(r"\\[" + re.escape(letters) + "]")
    by_digit: dict[str, str] = {}
    for e in escapes:
        if len(e) == 6:  # \u00XY
            by_digit[e[4]] = by_digit.get(e[4], "") + e[5]
    if by_digit:
        alternatives.append(r"\\u00(?:" + "|".join(f"{x}[{ys}]" for x, ys in by_digit.items()) + ")")
    if not alternatives:
        return "[^\\x00-\\U0010ffff]"  # matches nothing
    return alternatives[0] if len(alternatives) == 1 else "(?:" + "|".join(alternatives) + ")"
