"""Shared vocabulary of the JSON schema -> grammar converter (json_grammar.py and its rule mixins):
the value terminals, keyword sets, SchemaError and small helpers on schemas and JSON values."""

from __future__ import annotations

import json
import re
from typing import Any

from radixlm.core.runtime.constrained.automata import json_lexical
from radixlm.core.runtime.constrained.tokens.counted_string import counted_string_dfa
from radixlm.core.runtime.constrained.automata.grammar import Alt, Terminal, lit


CHAR = Terminal(regex=json_lexical.STRING_CHAR)
NUMBER = Terminal(regex=json_lexical.NUMBER)
# Integers are generated canonically ("1", never "1.0"), though JSON Schema (draft 6 on) counts 1.0 as an
# integer too: programs read the output with json.loads, where 1.0 is a float (range(x) fails on it).
INTEGER = Terminal(regex=json_lexical.INTEGER)
NULL = lit("null")
BOOLEAN = Terminal(regex="true|false")
NOTHING = Alt(())  # no output at all

# internal: the keywords beside a $ref in drafts 3-7, which those drafts ignore (schema_refs.py); a JSON
# pointer into them no longer resolves
IGNORED_BESIDE_REF = "x-radixlm-ignored-beside-ref"
JSON_TYPES = ("null", "boolean", "object", "array", "string", "number")
IGNORED_KEYWORDS = {
    "title", "description", "default", "examples", "$schema", "$id", "$anchor", "$comment", "$defs", "definitions",
    "readOnly", "writeOnly", "deprecated", "contentMediaType", "contentEncoding", "contentSchema", "discriminator",
    "format", "$vocabulary", "$dynamicAnchor", "x-", "externalDocs", "xml", "example", IGNORED_BESIDE_REF,
}
REFUSED_KEYWORDS = {"$dynamicRef": "a $dynamicRef that does not resolve, or whose target depends on the path taken "
                           "(the dynamic scope),",
            "$recursiveRef": "keyword '$recursiveRef'"}
DEPENDENT_KEYWORDS = ("dependentRequired", "dependentSchemas", "dependencies")
LOWER_BOUNDS = {"minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties", "minContains"}
UPPER_BOUNDS = {"maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties", "maxContains"}
CONFLICT = object()  # internal: the `const` of allOf parts with different constants (no value)
NOT_STRINGS = "x-radixlm-not-strings"  # internal: regexes of the JSON strings a `not` excludes
# internal: [p, q] of a `not` of multipleOf p/q (the integers p does not divide)
NOT_MULTIPLE_OF = "x-radixlm-not-multiple-of"
# internal: a `not`'s positive form (json_exclusion.py), whose keys and items a validator does not count
# as evaluated (json_allof.py holds them to the parent's unevaluatedProperties/Items)
NEGATED = "x-radixlm-negated"
SCHEMA_VALUED = {"items", "additionalProperties", "propertyNames", "additionalItems"}


def string_terminal(lo: int = 0, hi: int | None = None) -> Terminal:
    """A JSON string of lo..hi characters, quotes included; its masks are counted (counted_string.py)."""
    regex = f'"{json_lexical.STRING_CHAR}{{{lo},{"" if hi is None else hi}}}"'
    return Terminal(regex=regex, key=f"counted:{lo}:{hi}", dfa=counted_string_dfa(lo, hi))


class SchemaError(ValueError):
    """A schema the converter refuses; the message names the keyword and its JSON pointer."""


def pattern_matches(pattern: str, name: str, ptr: str = "#") -> bool:
    """ECMA-262 search of `pattern` in a property name (Python's `re` with ASCII classes)."""
    try:
        return re.search(pattern, name, re.ASCII) is not None
    except re.error as e:
        raise SchemaError(f"{ptr}/patternProperties: invalid pattern {pattern!r}: {e}") from None


def count_bounds(schema: dict, low: str, high: str, ptr: str) -> tuple[int, int | None]:
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


def with_parts(schema: Any, *parts: Any) -> Any:
    """`schema` with `parts` applied in place (an allOf beside its keywords: a $ref target, an anyOf
    branch, the `if` taken). Its keywords stay the allOf's parent (json_allof.py), so its
    unevaluatedProperties/Items see what the parts evaluate. Not for a `not`'s positive form, whose
    properties a validator does not count as evaluated."""
    if not isinstance(schema, dict):
        return {"allOf": [*parts, schema]}
    return {**schema, "allOf": [*parts, *schema.get("allOf", [])]}


def mark_negated(schema: Any) -> Any:
    """A `not`'s positive form, marked as such (NEGATED), its anyOf/allOf branches too."""
    if not isinstance(schema, dict):
        return schema
    out = {**schema, NEGATED: True}
    for key in ("anyOf", "allOf"):
        if isinstance(schema.get(key), list):
            out[key] = [mark_negated(b) for b in schema[key]]
    return out


def open_part(schema: dict) -> dict:
    """What a part added to `schema` by an allOf must carry so that an object listing no keys stays open
    (_object closes objects that list keys and say nothing of others: the documented strictness)."""
    listed = ("properties", "patternProperties", "additionalProperties", "unevaluatedProperties")
    return {} if any(k in schema for k in listed) else {"additionalProperties": True}


def json_key(value: Any) -> str:
    """A value's text as JSON Schema compares values (1 and 1.0 the same, inside arrays and objects too; true
    is not 1): a hashable key."""
    return json.dumps(whole_numbers(value), sort_keys=True)


def whole_numbers(value: Any) -> Any:
    """`value` with every float that is a whole number as an int, inside arrays and objects too."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [whole_numbers(v) for v in value]
    if isinstance(value, dict):
        return {k: whole_numbers(v) for k, v in value.items()}
    return value


def same_json(a: Any, b: Any) -> bool:
    """Equal as JSON Schema compares values (1 == 1.0; true is not 1)."""
    return json_key(a) == json_key(b)


def type_set(keyword: Any) -> set[str]:
    """The types a `type` keyword names (every type where it names none), integers among numbers."""
    types = {keyword} if isinstance(keyword, str) else set(keyword) if isinstance(keyword, list) else set(JSON_TYPES)
    return types | {"integer"} if "number" in types else types


def json_type(value: Any) -> str:
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


def escape_pointer(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")
