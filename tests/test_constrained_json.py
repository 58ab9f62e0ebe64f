"""JSON schema constraints: every random walk must json.loads and validate with `jsonschema`."""

from __future__ import annotations

import datetime
import enum
import json
import re
import urllib.parse
import uuid
from typing import Literal, Optional

import jsonschema
import numpy as np
import pydantic
import pytest

from radixlm.core.runtime.constrained import build_constraint, grammar_to_regex, json_schema_to_grammar, regex_to_dfa
from radixlm.core.runtime.constrained.schema.number_ranges import int_range_regex
from radixlm.core.runtime.constrained.schema.string_patterns import json_string_pattern
from radixlm.testing.constrained import qwen2_tokenizer, random_walk

STR = {"type": "string"}
INT = {"type": "integer"}


class Color(str, enum.Enum):
    red = "red"
    green = "green"


class Address(pydantic.BaseModel):
    street: str
    zip_code: int = pydantic.Field(ge=0, le=99999)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(min_length=1, max_length=12)
    age: int = pydantic.Field(ge=0, le=150)
    color: Color
    kind: Literal["a", "b"]
    nickname: Optional[str] = None
    addresses: list[Address] = pydantic.Field(max_length=2)


SCHEMAS = [
    {"type": "object", "properties": {"name": STR, "age": INT}, "required": ["name", "age"]},
    {"type": "object", "properties": {"s": STR, "i": INT, "n": {"type": "number"}, "b": {"type": "boolean"},
                                      "z": {"type": "null"}}, "required": ["s", "i", "n", "b", "z"]},
    {"type": "string", "enum": ["red", "green", "blue", "dark \"red\""]},
    {"const": {"version": 2, "tags": ["x", "y"]}},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"id": INT, "email": STR},
                                               "required": ["id"]}}, "required": ["user"]},
    {"type": "array", "items": INT, "minItems": 2, "maxItems": 4},
    {"type": "array", "items": {"type": "object", "properties": {"x": INT, "y": INT}, "required": ["x", "y"]},
     "maxItems": 3},
    {"type": "string", "minLength": 3, "maxLength": 6},
    {"type": "string", "pattern": r"^\(\d{3}\) \d{3}-\d{4}$"},
    {"type": "string", "format": "date"},
    {"type": "string", "format": "time"},
    {"type": "string", "format": "date-time"},
    {"type": "string", "format": "uuid"},
    {"type": "string", "format": "email"},
    {"type": "string", "format": "uri"},
    {"type": "integer", "minimum": -40, "maximum": 1234},
    {"type": "integer", "exclusiveMinimum": -1000, "exclusiveMaximum": -7},
    {"type": "number", "minimum": -5, "maximum": 12},
    {"type": "object", "properties": {"flag": {"type": "boolean"}, "nothing": {"type": "null"}},
     "required": ["flag", "nothing"], "additionalProperties": False},
    {"anyOf": [STR, INT]},
    {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "number"}},
         "required": ["kind", "r"], "additionalProperties": False},
        {"type": "object", "properties": {"kind": {"const": "square"}, "side": INT},
         "required": ["kind", "side"], "additionalProperties": False}]},
    {"allOf": [{"type": "object", "properties": {"a": INT}, "required": ["a"]},
               {"properties": {"b": STR}, "required": ["b"]}]},
    {"$defs": {"pt": {"type": "object", "properties": {"x": INT, "y": INT}, "required": ["x", "y"]}},
     "type": "object", "properties": {"from": {"$ref": "#/$defs/pt"}, "to": {"$ref": "#/$defs/pt"}},
     "required": ["from", "to"]},
    {"$defs": {"node": {"type": "object", "properties": {"v": INT, "children": {
        "type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}}, "required": ["v", "children"]}},
     "$ref": "#/$defs/node"},
    {"type": "object", "properties": {"note": {"type": "string", "nullable": True, "maxLength": 5}},
     "required": ["note"]},
    {"type": ["string", "null"], "maxLength": 4},
    {"type": "object", "properties": {"a": INT, "b": STR, "c": {"type": "boolean"}, "d": INT},
     "required": ["b", "d"]},
    {"type": "object", "properties": {"a": INT, "b": STR, "c": {"type": "boolean"}}},
    {"type": "object", "additionalProperties": False},
    {"type": "object", "additionalProperties": INT},
    {"type": "array", "prefixItems": [STR, INT, {"type": "boolean"}], "items": False},
    {"enum": [1, 2.5, None, True, "x", {"k": [1, 2]}, [3]]},
    {"type": "object", "properties": {"naïve key": STR, "ключ": {"enum": ["é", "日本", "a\\b"]}},
     "required": ["naïve key", "ключ"]},
    {"type": "string", "pattern": r'^[a"\\\n]{1,4}$'},
    Person,
    {},
    {"type": "array", "items": {"type": "array", "items": {"type": "array", "items": INT, "maxItems": 2},
                                "maxItems": 2}, "maxItems": 2},
    {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"},
                                      "at": {"type": "string", "format": "date-time"},
                                      "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}},
     "required": ["id", "at", "tags"]},
    True,
]

# Formats the validator's format checker skips without extra packages (date-time, time, uri) are checked
# here, the others a second time.
def _check_formats(instance, schema) -> None:
    if isinstance(schema, dict) and isinstance(instance, str):
        fmt = schema.get("format")
        if fmt == "date-time":
            parsed = datetime.datetime.fromisoformat(instance.replace("Z", "+00:00"))
            assert parsed.tzinfo is not None
        elif fmt == "date":
            datetime.date.fromisoformat(instance)
        elif fmt == "time":
            assert datetime.time.fromisoformat(instance.replace("Z", "+00:00")).tzinfo is not None
        elif fmt == "uuid":
            uuid.UUID(instance)
        elif fmt == "uri":
            parts = urllib.parse.urlsplit(instance)
            assert parts.scheme and parts.netloc, instance
        elif fmt == "email":
            local, _, domain = instance.rpartition("@")
            assert local and "." in domain and not domain.startswith("."), instance


def _schema_dict(schema):
    """The schema as jsonschema reads it: a pydantic model's JSON schema; OpenAPI's `nullable: true`
    (which jsonschema does not know) spelled as anyOf [schema, null]."""
    if isinstance(schema, type):
        return schema.model_json_schema()
    if isinstance(schema, list):
        return [_schema_dict(v) for v in schema]
    if isinstance(schema, dict):
        out = {k: _schema_dict(v) for k, v in schema.items() if k != "nullable"}
        return {"anyOf": [out, {"type": "null"}]} if schema.get("nullable") is True else out
    return schema


def _validate(text: str, schema) -> None:
    instance = json.loads(text)
    as_dict = _schema_dict(schema)
    validator = jsonschema.validators.validator_for(as_dict)
    validator(as_dict, format_checker=validator.FORMAT_CHECKER).validate(instance)
    if isinstance(as_dict, dict):
        _check_formats(instance, as_dict)
        for name, sub in (as_dict.get("properties") or {}).items():
            if isinstance(instance, dict) and name in instance:
                _check_formats(instance[name], sub)


@pytest.fixture(scope="module")
def tiny_tokenizer(tokenizer_path):
    """The test checkpoints' byte-level BPE tokenizer (1000 tokens)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(tokenizer_path)


def test_enough_schemas():
    assert len(SCHEMAS) >= 30


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_random_walks_validate(index, tiny_tokenizer):
    schema = SCHEMAS[index]
    rng = np.random.default_rng(index)
    for _ in range(120):
        constraint = build_constraint("json_schema", schema, tiny_tokenizer)
        ids = random_walk(constraint, rng, max_tokens=40)
        text = tiny_tokenizer.decode(ids, clean_up_tokenization_spaces=False)
        _validate(text, schema)


@pytest.mark.parametrize("index", [0, 6, 11, 20, 23, 32, 34])
def test_random_walks_validate_qwen_vocab(index):
    tokenizer = qwen2_tokenizer()
    schema = SCHEMAS[index]
    rng = np.random.default_rng(index)
    for _ in range(20):
        constraint = build_constraint("json_schema", schema, tokenizer)
        text = tokenizer.decode(random_walk(constraint, rng, max_tokens=24))
        _validate(text, schema)


def schema_regex(schema, whitespace_pattern=None) -> str:
    """The schema's grammar written out as one regex (recursion cut at grammar_to_regex's depth)."""
    return grammar_to_regex(json_schema_to_grammar(schema, whitespace_pattern))


def test_whitespace_pattern(tiny_tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": INT}}, "required": ["a"]}
    compact = schema_regex(schema)
    assert re.fullmatch(compact, '{"a":[1,2]}') and not re.fullmatch(compact, '{"a": [1, 2]}')
    spaced = schema_regex(schema, whitespace_pattern=r"[ \n]{0,2}")
    assert re.fullmatch(spaced, '{ "a" : [1,\n 2] }')
    rng = np.random.default_rng(1)
    for _ in range(50):
        c = build_constraint("json_schema", schema, tiny_tokenizer, whitespace_pattern=r"[ \n]{0,2}")
        _validate(tiny_tokenizer.decode(random_walk(c, rng), clean_up_tokenization_spaces=False), schema)


def test_optional_properties_keep_order_and_commas():
    regex = schema_regex({"type": "object", "properties": {"a": INT, "b": INT, "c": INT}, "required": ["b"]})
    good = ['{"b":1}', '{"a":1,"b":2}', '{"b":1,"c":2}', '{"a":1,"b":2,"c":3}']
    bad = ['{}', '{"a":1}', '{"b":1,"a":2}', '{,"b":1}', '{"b":1,}', '{"a":1"b":2}']
    assert all(re.fullmatch(regex, s) for s in good)
    assert not any(re.fullmatch(regex, s) for s in bad)


@pytest.mark.parametrize("lo, hi", [(None, None), (0, None), (-5, None), (None, 0), (None, -3), (-40, 1234),
                                    (7, 7), (-1000, -8), (0, 9), (10, 99), (5, 10050), (-99, 99)])
def test_integer_ranges_exactly(lo, hi):
    pattern = re.compile(int_range_regex(lo, hi)) if (lo, hi) != (None, None) else None
    for n in list(range(-1200, 1300)) + [10049, 10050, 10051, 123456, -123456]:
        expected = (lo is None or n >= lo) and (hi is None or n <= hi)
        if pattern is not None:
            assert bool(pattern.fullmatch(str(n))) == expected, n
    if pattern is not None:
        assert not any(pattern.fullmatch(s) for s in ("-0", "01", "+1", "", "1.0"))


@pytest.mark.parametrize("schema, problem", [
    ("{not json", "not valid JSON"),
    (42, "must be an object or a boolean"),
    ({"not": {"format": "email"}}, "#/not: 'not' of format is not supported"),
    ({"type": "array", "uniqueItems": True, "minItems": 8}, "#/uniqueItems"),  # 7 kinds of JSON values
    ({"properties": {"a": {"dependentRequired": {"x": "y"}}}}, "#/properties/a/dependentRequired/x"),
    ({"oneOf": [{"type": "string"}, {"type": "string", "format": "email"}]},
     "#/oneOf: no value matches exactly one branch that 'not' can express (its branches may overlap)"),
    ({"$ref": "http://example.com/s.json"}, "does not resolve"),
    ({"$ref": "#/$defs/missing"}, "does not resolve"),
    ({"type": "date"}, "unknown JSON schema type"),
    ({"type": "string", "pattern": "(?=a)a"}, "lookahead"),
    ({"type": "number", "exclusiveMinimum": True}, "boolean form"),
    ({"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}},
      "$ref": "#/$defs/n"}, "admits no value"),
    ({"type": "integer", "minimum": 5, "maximum": 4}, "admits no value"),
    ({"$defs": {"a": {"not": {"not": {"$ref": "#/$defs/a"}}}}, "$ref": "#/$defs/a"},  # `not`s without end
     "nested deeper than 8 levels"),
    ({"enum": []}, "enum"),
])
def test_invalid_or_unsupported_schema_raises_naming_it(schema, problem, tiny_tokenizer):
    with pytest.raises(ValueError, match=re.escape(problem)):
        build_constraint("json_schema", schema, tiny_tokenizer)


def test_invalid_whitespace_pattern_raises(tiny_tokenizer):
    with pytest.raises(ValueError, match="whitespace_pattern"):
        build_constraint("json_schema", {"type": "object"}, tiny_tokenizer, whitespace_pattern="(")


def test_schema_regex_accepts_known_good_documents():
    """Documents written by hand (and by pydantic) are in the language, so the regex is not too narrow."""
    cases = [
        (SCHEMAS[0], {"name": "x", "age": -3}),
        (SCHEMAS[11], "2024-02-29T23:59:59.123456+05:30"),
        (SCHEMAS[9], "2000-02-29"),
        (SCHEMAS[14], "https://example.com/a/b?c=d#e"),
        (SCHEMAS[23], {"v": 1, "children": [{"v": 2, "children": []}]}),
        (Person, Person(name="Al", age=3, color=Color.red, kind="a", addresses=[
            Address(street="Main \"St\"", zip_code=12345)]).model_dump(mode="json")),
    ]
    for schema, doc in cases:
        dfa = regex_to_dfa(schema_regex(schema))
        assert dfa.fullmatch(json.dumps(doc, separators=(",", ":"), ensure_ascii=False)), doc
    date = regex_to_dfa(schema_regex(SCHEMAS[9]))
    for bad in ("2023-02-29", "1900-02-29", "2024-04-31", "0000-01-01", "2024-13-01"):
        assert not date.fullmatch(json.dumps(bad)), bad
    assert date.fullmatch('"2000-02-29"') and date.fullmatch('"2024-12-31"')


def test_schema_given_as_string_dict_or_model_gives_one_regex():
    as_dict = Person.model_json_schema()
    assert schema_regex(as_dict) == schema_regex(json.dumps(as_dict)) == schema_regex(Person)



@pytest.mark.parametrize("pattern", [".", "[^a]", r"\S", '[\\x00-\\x1f"\\\\]', "a", r"[\s\S]", "[^\\n]", '[\\t"]'])
def test_string_patterns_read_escaped_characters_as_python_reads_them(pattern):
    """A pattern's character set over JSON string content: the text json.dumps writes for a character
    (its escape, for quote, backslash and controls) matches exactly when the character matches the
    pattern (Python's re the oracle)."""
    emitted = re.compile(json_string_pattern(pattern))
    for c in [*range(0x80), 0xE9, 0x2028, 0x1F600]:
        text = json.dumps(chr(c), ensure_ascii=False)[1:-1]
        assert (emitted.fullmatch(text) is not None) == (re.fullmatch(pattern, chr(c)) is not None), (pattern, c)


@pytest.mark.parametrize("pattern", ["a{2,3}", "^\\$[a-z]{1,3}", "(x|a+)", "ab{1,2}", "b{0,2}a", "^a{1,2}b$",
                                     "(?:ab|a{2,})$", "[ab]{1,3}?x", "^(a|b{2,4})"])
def test_searched_patterns_keep_their_language_with_repeats_at_free_ends_cut(pattern):
    """ECMA-262 `pattern` is a search: at an end without an anchor, a repetition needs only its least
    count (ecma_string_pattern builds the smaller automaton so). Every string over a few characters up to
    5 long is accepted exactly when Python's re.search finds the pattern in it."""
    import itertools

    from radixlm.core.runtime.constrained.schema.json_strings import ecma_string_pattern

    body = re.compile(ecma_string_pattern(pattern))
    for n in range(6):
        for chars in itertools.product('ab$x"', repeat=n):
            text = "".join(chars)
            found = re.search(pattern, text, re.ASCII) is not None
            assert (body.fullmatch(json.dumps(text)[1:-1]) is not None) == found, (pattern, text)
