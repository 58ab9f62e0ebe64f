"""The grammar engine (grammar.py, json_grammar.py, grammar_compiler.py, pda.py) against independent
oracles: `jsonschema` (with format checks) for what it generates and accepts, Python `re` and the
`regex` package's partial matches for its masks."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import numpy as np
import pytest

from radixlm.core.runtime.constrained import GrammarBudget, build_constraint, compile_grammar, json_schema_to_grammar
from radixlm.core.runtime.constrained.automata.grammar import Grammar, Ref, Repeat, alt, lit, opt, seq
from radixlm.testing.constrained import random_walk
from radixlm.core.runtime.constrained.tokens.token_classes import EXITS, INSIDE
from radixlm.core.errors import GrammarBudgetError
from radixlm.testing.constrained import accepts_text

INT = {"type": "integer"}
STR = {"type": "string"}


@pytest.fixture(scope="module")
def tiny_tokenizer(tokenizer_path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(tokenizer_path)


def _validator(schema):
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


# Schemas the regex-DFA converter refused or got wrong, each with documents the schema accepts and rejects.
DISCRIMINATED = {"type": "object", "properties": {"kind": {"enum": ["s", "b", "n"]}, "value": True},
                 "additionalProperties": False,
                 "oneOf": [{"properties": {"kind": {"const": "s"}, "value": STR}, "required": ["kind"]},
                           {"properties": {"kind": {"const": "b"}, "value": {"type": "boolean"}}, "required": ["kind"]}]}

CASES = [
    ({"oneOf": [INT, STR]}, [1, "a"], [1.5, None]),
    ({"oneOf": [{"type": ["string", "null"]}, {"type": ["number", "null"]}]}, ["a", 1.5, 2], [None, True]),
    ({"allOf": [{"anyOf": [INT, STR]}, {"oneOf": [{"type": "integer", "minimum": 5},
                                                  {"type": "string", "maxLength": 2}]}]}, [7, "ab"], [3, "abc"]),
    ({"type": "object", "properties": {"a": INT}, "additionalProperties": STR},
     [{"a": 1, "x": "y"}, {"b": "c"}, {}], [{"a": "1"}, {"x": 1}]),
    ({"type": "object", "patternProperties": {"^x-": INT}, "additionalProperties": False},
     [{"x-a": 1}, {}], [{"y": 1}, {"x-a": "s"}]),
    ({"type": "object", "properties": {"a": INT, "b": INT, "c": INT}, "minProperties": 2, "maxProperties": 2},
     [{"a": 1, "b": 2}, {"a": 1, "c": 2}, {"b": 1, "c": 2}], [{"a": 1}, {"a": 1, "b": 2, "c": 3}]),
    ({"type": "string", "pattern": r"\d{3}"}, ["123", "a123b"], ["12", "1a2"]),
    ({"type": "string", "pattern": r"^\w+$"}, ["ab_1"], ["", "a b"]),
    ({"not": {"type": "string"}, "type": ["string", "integer"]}, [1], ["s"]),
    # Keywords that hold for every value of other types: their `not` is of their own type only.
    ({"not": {"pattern": "^a"}}, ["b"], ["a", 1, None]),
    ({"not": {"required": ["a"]}}, [{}, {"b": 1}], [{"a": 1}, 1, "s"]),
    ({"oneOf": [{"properties": {"bar": True, "baz": True}, "required": ["bar"]},
                {"properties": {"foo": True}, "required": ["foo"]}]},
     [{"bar": 1}, {"foo": 1}], [{"foo": 1, "bar": 2}, "s", 20.6, {}]),
    ({"type": "array", "items": {"not": {"minimum": 3, "exclusiveMaximum": 5.5}}}, [[2, 5.5]], [[3], [4.9], ["s"]]),
    ({"not": {"type": "number", "maximum": 0}}, [1, "s", None], [0, -2.5]),
    ({"type": "string", "format": "ipv4"}, ["192.168.0.1"], ["256.1.1.1", "1.2.3"]),
    ({"type": "string", "format": "ipv6"}, ["::1", "fe80::1:2", "1:2:3:4:5:6:7:8"], ["1:2", ":::"]),
    ({"type": "string", "format": "hostname"}, ["example.com", "a-b.c"], ["-a.com", "a..b"]),
    ({"type": "string", "format": "duration"}, ["P1D", "PT1H30M", "P2W"], ["P", "PT", "1D"]),
    ({"type": "array", "items": INT, "uniqueItems": True}, [[], [3]], [[1, 1]]),
    # A key matching two patternProperties takes both schemas; merged properties: the parent's first.
    ({"type": "object", "patternProperties": {"a*": INT, "aaa*": {"maximum": 20}}, "additionalProperties": False},
     [{"aaaa": 18}, {"a": 21, "aaaa": 18}, {"b": 30}], [{"aaaa": 31}, {"aaa": "x"}]),
    ({"type": "object", "properties": {"foo": STR}, "allOf": [{"properties": {"bar": STR}}],
      "unevaluatedProperties": False}, [{"foo": "x", "bar": "y"}, {"bar": "y"}], [{"baz": 1}, {"foo": 1}]),
    # unevaluatedProperties sees what a $ref target, an anyOf branch or the `if` taken evaluates, never
    # what a `not` (the else path) says of a key.
    ({"$ref": "#/$defs/bar", "properties": {"foo": STR}, "unevaluatedProperties": False,
      "$defs": {"bar": {"properties": {"bar": STR}}}}, [{"foo": "a", "bar": "b"}, {}], [{"baz": 1}, {"bar": 1}]),
    ({"type": "object", "properties": {"foo": STR}, "unevaluatedProperties": False,
      "anyOf": [{"properties": {"bar": {"const": "bar"}}, "required": ["bar"]},
                {"properties": {"baz": {"const": "baz"}}, "required": ["baz"]}]},
     [{"foo": "f", "bar": "bar"}, {"baz": "baz"}], [{"foo": "f", "bar": "bar", "quux": 1}, {"foo": "f"}]),
    ({"type": "object", "if": {"properties": {"foo": {"const": "then"}}, "required": ["foo"]},
      "then": {"properties": {"bar": STR}, "required": ["bar"]}, "else": {"properties": {"baz": STR}, "required": ["baz"]},
      "unevaluatedProperties": False}, [{"foo": "then", "bar": "b"}, {"baz": "z"}],
     [{"foo": "else", "baz": "z"}, {"foo": "then"}]),
    ({"properties": {"foo": STR}, "unevaluatedProperties": False,
      "oneOf": [{"properties": {"bar": {"const": "bar"}}, "required": ["bar"]},
                {"properties": {"baz": {"const": "baz"}}, "required": ["baz"]}]},
     [{"foo": "f", "bar": "bar"}, {"baz": "baz"}], [{"bar": "bar", "baz": "x"}, {"bar": "bar", "baz": "baz"}, {"foo": "f"}]),
    ({"prefixItems": [STR], "unevaluatedItems": False, "oneOf": [{"prefixItems": [True, INT]}, {"prefixItems": [True, STR]}]},
     [["a", 1], ["a", "b"]], [["a", 1, 2], ["a", None]]),
    ({"type": "array", "prefixItems": [STR], "anyOf": [{"prefixItems": [True, INT]}], "unevaluatedItems": False},
     [["a", 1]], [["a", 1, 2], [1]]),
    # An `if` alone (or then/else in other allOf parts) constrains nothing (beside unevaluated*, what it
    # evaluates when it holds counts).
    ({"if": {"const": 0}}, ["hello", 0], []),
    ({"type": "object", "if": {"properties": {"a": INT}, "required": ["a"]}, "unevaluatedProperties": False},
     [{"a": 1}, {}], [{"a": "x"}, {"b": 1}]),
    ({"allOf": [{"if": {"exclusiveMaximum": 0}}, {"then": {"minimum": -10}}, {"else": {"multipleOf": 2}}]},
     [-100, 3], []),
    # uniqueItems: few constants in any order, more in their order, else one item of each JSON kind.
    ({"type": "array", "items": {"enum": ["a", "b", "c"]}, "uniqueItems": True}, [["a", "b"], ["c", "a", "b"], []],
     [["a", "a"], ["a", "b", "a"], ["d"]]),
    ({"type": "array", "prefixItems": [{"type": "boolean"}, {"type": "boolean"}], "uniqueItems": True},
     [[False, True], [True, False], [True], [True, False, 1]], [[True, True], [False, False, 1]]),
    ({"type": "array", "uniqueItems": True, "minItems": 2}, [[1, "a", True, None, {}, []], [0, False]],
     [[1, 1], [{}, {}], [1]]),
    ({"type": "array", "items": {"enum": [1, 2, 3, 4, 5, 6, 7, 8]}, "uniqueItems": True, "minItems": 2,
      "maxItems": 3}, [[1, 2], [3, 5, 8]], [[2, 2], [1], [1, 2, 3, 4]]),
    ({"$defs": {"t": {"type": "object", "properties": {"v": INT, "kids": {"type": "array", "items": {"$ref": "#/$defs/t"}}},
                      "required": ["v"]}}, "$ref": "#/$defs/t"},
     [{"v": 1, "kids": [{"v": 2, "kids": [{"v": 3, "kids": [{"v": 4, "kids": [{"v": 5}]}]}]}]}], [{"kids": []}]),
    ({"type": "integer", "multipleOf": 1, "minimum": 3}, [3, 40], [2]),
    ({"type": "array", "items": INT, "contains": {"minimum": 5}}, [[5], [1, 7, 2]], [[], [1, 2]]),
    ({"type": "object", "properties": {"a": INT}, "unevaluatedProperties": {"type": "boolean"}},
     [{"a": 1, "b": True}], [{"b": 1}]),
    ({"type": "object", "properties": {"ab": INT, "abc": INT}, "propertyNames": {"maxLength": 2},
      "additionalProperties": False}, [{"ab": 1}], [{"abc": 1}]),
    ({"if": {"properties": {"k": {"const": 1}}}, "then": {"required": ["v"]}, "type": "object",
      "properties": {"k": INT, "v": STR}}, [{"k": 1, "v": "x"}], [{"k": 1}]),
    ({"allOf": [{"prefixItems": [{}, {}]}], "items": {"type": "boolean"}, "type": "array"}, [[True, False]], [[1, True]]),
    ({"oneOf": [{"type": "object", "properties": {"k": {"const": "a"}, "x": INT}, "required": ["k", "x"]},
                {"type": "object", "properties": {"k": {"const": "b"}, "y": STR}, "required": ["k", "y"]}]},
     [{"k": "a", "x": 1}, {"k": "b", "y": "s"}], [{"k": "a", "y": "s"}]),
    # Keys listed only in required (values unconstrained); whole numbers with a zero fraction.
    ({"type": "object", "required": ["a"]}, [{"a": 1}, {"a": [2.0]}], [{}, {"b": 1}]),
    ({"type": "object", "properties": {"p": INT}, "required": ["a", "b"]},
     [{"a": 1, "b": 2}, {"b": 1, "a": 2}, {"p": 0, "b": 1, "a": 2}], [{"a": 1}, {"a": 1, "a2": 2}]),
    ({"type": "integer", "maximum": 3}, [3, -2], [3.5, 4.0]),
    ({"enum": [0, [1], {"k": -2}]}, [0, [1], {"k": -2}], [False, [True], 0.5]),
    ({"properties": {"a": INT, "b": INT}, "dependentRequired": {"a": ["b"]}},
     [{"a": 1, "b": 2}, {"b": 2}, {}, "s"], [{"a": 1}]),
    ({"dependentRequired": {"a": ["b"]}}, [{"a": 1, "b": 2}, {"b": 2, "c": 3}], [{"a": 1}, {"a": 1, "c": 2}]),
    # A dependent schema that closes the object forbids the key it depends on (nested allOfs merged flat).
    ({"properties": {"foo": {}, "bar": {}}, "dependentSchemas": {"foo": {"properties": {"bar": {}},
                                                                      "additionalProperties": False}}},
     [{"bar": 1}, {}], [{"foo": 1}, {"foo": 1, "bar": 2}]),
    ({"oneOf": [False, INT, False]}, [1], ["s", 1.5]),
    # propertyNames on open objects: the extra keys' terminal intersected with what it allows.
    ({"type": "object", "propertyNames": {"maxLength": 3}}, [{"abc": 1}, {}], [{"abcd": 1}]),
    ({"type": "object", "propertyNames": {"pattern": "^a"}, "properties": {"b": INT}, "additionalProperties": True},
     [{"ax": 1}, {}],
     [{"b": 1}, {"x": 1}]),
    ({"type": "object", "propertyNames": {"enum": ["x", "y"]}, "additionalProperties": INT}, [{"x": 1}],
     [{"z": 1}, {"x": "s"}]),
    ({"type": "object", "propertyNames": {"type": "string", "not": {"pattern": "^x"}}, "additionalProperties": INT},
     [{"a": 1}, {}], [{"xa": 1}]),
    ({"type": "object", "propertyNames": {"type": "integer"}}, [{}], [{"a": 1}]),
    # pattern and format with length bounds: the pattern's DFA intersected with the counted string's.
    ({"type": "string", "pattern": "^[a-z]+$", "minLength": 2, "maxLength": 4}, ["ab", "abcd"], ["a", "abcde", "AB"]),
    ({"type": "string", "format": "ipv4", "maxLength": 7}, ["1.2.3.4"], ["10.2.3.4"]),
    ({"type": "string", "format": "ipv4", "pattern": "^1"}, ["1.2.3.4"], ["2.2.3.4", "1x", "1.2.3"]),
    # multipleOf a whole number: a digit automaton over remainders (with the bounds intersected).
    ({"type": "integer", "multipleOf": 3, "minimum": -7, "maximum": 20}, [-6, 0, 3, 18], [-9, 4, 21, 1.5]),
    ({"multipleOf": 2}, [10, -4, "s"], [7, 7.5]),
    # allOf parts that disagree on a keyword: the tighter bound, an allOf of schema keywords, prefix
    # items position by position, multipleOf's least common multiple, if/then/else in a part.
    ({"allOf": [{"type": "integer", "minimum": 2, "multipleOf": 2}, {"minimum": 4, "maximum": 20, "multipleOf": 3}]},
     [6, 18], [2, 4, 9, 24]),
    ({"type": "array", "allOf": [{"prefixItems": [INT]}, {"prefixItems": [{"maximum": 5}, STR]}]},
     [[], [3], [5, "a"], [5, "a", None]], [[6], [1, 2], ["a"]]),
    ({"allOf": [{"if": {"type": "integer"}, "then": {"minimum": 0}}, {"if": {"type": "integer"}, "then": {"maximum": 9}}]},
     [0, 9], [-1, 10]),
    # Number bounds of any kind (fractional, exclusive, negative); numbers that are not integers.
    ({"type": "number", "exclusiveMinimum": 1.1, "maximum": 2.05}, [1.11, 1.2, 2, 2.05, 2.0499],
     [1.1, 1.1, 1.09, 2.051, 3, -1.5]),
    ({"type": "number", "minimum": -0.25, "exclusiveMaximum": 0}, [-0.25, -0.1, -0.0001], [0, -0.26, 0.5, -1]),
    ({"exclusiveMaximum": -7.5, "minimum": -7.5}, ["s", True], [-7.5, -8, -7]),
    ({"type": "number", "not": {"type": "integer"}, "maximum": 1}, [0.5, -3.25, 1 - 1e-3], [1, 0, 2.5, 1.5]),
    ({"anyOf": [{"allOf": [{"const": "a"}, {"const": "b"}]}, {"allOf": [{"const": 1}, {"const": 1.0}]}]}, [1], ["a", "b"]),
    # not of required keys, of string patterns and constants, and anyOf/allOf of those.
    ({"type": "object", "not": {"required": ["a"]}}, [{}, {"b": 1}], [{"a": 1}]),
    ({"type": "object", "properties": {"a": INT, "b": INT}, "not": {"required": ["a", "b"]}},
     [{"a": 1}, {"b": 2}, {}], [{"a": 1, "b": 2}]),
    ({"type": "object", "not": {"anyOf": [{"required": ["x"]}, {"required": ["y"]}]}}, [{"z": 1}], [{"x": 1}, {"y": 1}]),
    ({"type": "string", "not": {"pattern": "^a"}, "maxLength": 3}, ["ba", ""], ["a", "abc"]),
    ({"enum": ["a", "b", 1], "not": {"const": "a"}}, ["b", 1], ["a"]),
    # enum/const values their sibling keywords exclude are never generated.
    ({"enum": ["abc", "ab", "x"], "maxLength": 2, "pattern": "b"}, ["ab"], ["abc", "x"]),
    ({"enum": [1, 2.5, 6, 9, 12], "exclusiveMinimum": 2, "maximum": 9, "multipleOf": 3}, [6, 9], [1, 2.5, 12]),
    ({"enum": [0.5, 0.75, 2], "multipleOf": 0.5}, [0.5, 2], [0.75]),
    ({"type": "object", "properties": {"w": {}, "u": {}}, "not": {"allOf": [{"required": ["w"]}, {"required": ["u"]}]},
      "allOf": [{"not": {"required": ["x"]}}]}, [{"w": 1}, {"u": 1}], [{"w": 1, "u": 1}]),
    # Counts written as whole floats; contains with minContains / maxContains.
    ({"type": "array", "maxItems": 2.0, "items": INT}, [[1, 2]], [[1, 2, 3]]),
    ({"type": "array", "contains": {"const": 1}, "minContains": 2}, [[1, 1], [0, 1, 1, 2]], [[1], [1, 0, 2]]),
    ({"type": "array", "contains": {"const": 1}, "maxContains": 2}, [[1], [1, 1]], [[], [1, 1, 1], [2]]),
    ({"type": "array", "contains": {"type": "integer"}, "minContains": 0, "maxContains": 1}, [[], [5]], [[1, 2]]),
    # $ref against base URIs ($id), to embedded resources, anchors and URNs; `$ref` under properties'
    # names and inside enum values is data, not a reference.
    ({"$id": "http://example.com/root.json", "properties": {"a": {"$ref": "item.json"}, "b": {"$ref": "#k"}},
      "required": ["a", "b"],
      "$defs": {"i": {"$id": "item.json", "type": "array", "items": {"$ref": "#/$defs/n"},
                      "$defs": {"n": {"type": "integer", "maximum": 3}}},
                "k": {"$anchor": "k", "type": "string", "maxLength": 2}}},
     [{"a": [1, 3], "b": "xy"}], [{"a": [4], "b": "x"}, {"a": [], "b": "xyz"}]),
    # Draft 7's location-independent `$id: "#name"` (an anchor: SchemaRefs crawls the document for it), and a
    # root `$id` that names only the document (not crawled: pointers resolve in the root as it is).
    ({"$schema": "http://json-schema.org/draft-07/schema#", "$id": "http://example.com/d7.json",
      "properties": {"a": {"$ref": "#num"}, "b": {"$ref": "#/definitions/s"}}, "required": ["a"],
      "definitions": {"n": {"$id": "#num", "type": "integer"}, "s": {"type": "string", "maxLength": 1}}},
     [{"a": 1}, {"a": 2, "b": "x"}], [{"a": "x"}, {"a": 1, "b": "xy"}]),
    ({"$id": "http://example.com/p.json", "properties": {"b": {"$ref": "#/$defs/s"}}, "required": ["b"],
      "$defs": {"s": {"type": "string", "maxLength": 1}}}, [{"b": "x"}], [{"b": "xy"}, {"b": 1}]),
    ({"$id": "urn:uuid:deadbeef-1234-ffff-ffff-4321feebdaed", "properties": {"f": {"$ref": "#/$defs/b"}},
      "required": ["f"], "$defs": {"b": {"type": "boolean"}}}, [{"f": True}], [{"f": 1}]),
    ({"properties": {"$ref": {"enum": [{"$ref": "#/$defs/x"}]}}, "required": ["$ref"],
      "$defs": {"x": {"type": "integer"}}}, [{"$ref": {"$ref": "#/$defs/x"}}], [{"$ref": 1}]),
    ({"$ref": "http://example.com/tree.json", "$defs": {"tree": {
        "$id": "http://example.com/tree.json", "type": "object", "required": ["v"],
        "properties": {"v": INT, "kids": {"type": "array", "items": {"$ref": "tree.json"}, "maxItems": 2}}}}},
     [{"v": 1, "kids": [{"v": 2}]}], [{"v": 1, "kids": [{}]}]),
    # oneOf whose branches may overlap: each branch excludes the others with `not` where it can.
    ({"type": "object", "oneOf": [{"required": ["a", "b"]}, {"required": ["a", "c"]}], "additionalProperties": INT},
     [{"a": 1, "b": 2}, {"a": 1, "c": 2}], [{"a": 1, "b": 2, "c": 3}, {"a": 1}]),
    ({"oneOf": [{"type": "string", "maxLength": 3}, {"type": "string", "pattern": "^x"}]}, ["ab", "xyzw"],
     ["xy", "abcd"]),
    # `not` as an anyOf of the ways to fail each keyword: lengths, properties with required, items,
    # contains, a `not` (double negation).
    ({"type": "string", "oneOf": [{"minLength": 2}, {"maxLength": 4}]}, ["a", "abcde"], ["ab", "abcd", 1]),
    ({"oneOf": [{"properties": {"bar": INT}, "required": ["bar"]}, {"properties": {"foo": STR}, "required": ["foo"]}]},
     [{"bar": 2}, {"foo": "baz"}], [{"foo": "baz", "bar": 2}, {"foo": 2, "bar": "quux"}]),
    ({"not": {"not": INT}}, [1, -3], ["s", 1.5, None]),
    ({"type": "array", "not": {"items": INT}}, [["a"], [1, 1.5]], [[], [1, 2]]),
    ({"type": "array", "not": {"contains": INT}}, [[], ["a"]], [[1], ["a", 2]]),
    ({"type": "object", "not": {"minProperties": 1}}, [{}], [{"a": 1}]),
    # allOf parts with two patterns (their automata intersected) or two contains (items matching both:
    # a sound subset); multipleOf past MAX_MODULUS: 0 alone (a sound subset).
    ({"type": "string", "allOf": [{"pattern": "^a"}, {"pattern": "b$"}]}, ["ab", "axb"], ["a", "b", "ba"]),
    ({"type": "array", "allOf": [{"contains": INT}, {"contains": {"minimum": 3}}]}, [[3], [1, 5]], [[1], ["a"], []]),
    ({"type": "integer", "multipleOf": 0.123456789}, [0], [1, 0.5]),
    # oneOf branches told apart through a `not` of constants, or through the types of their own choices.
    ({"oneOf": [{"type": "object", "properties": {"p": {"const": "s"}, "q": STR}, "required": ["p"]},
                {"type": "object", "properties": {"p": {"type": "string", "not": {"enum": ["s"]}}}, "required": ["p"]}]},
     [{"p": "s", "q": "x"}, {"p": "t"}], [{"p": 1}]),
    ({"$defs": {"e": {"oneOf": [{"type": "object", "additionalProperties": True}, {"type": "null"}]}},
      "$ref": "#/$defs/e", "oneOf": [{"type": "null"}, {"type": "object", "properties": {"t": INT}}]},
     [None, {"t": 1}], [{"t": "x"}, 1]),
    # allOf of if/then parts keyed on one property's constants (a discriminator): one choice per constant.
    ({"type": "object", "properties": {"kind": {"enum": ["a", "b"]}, "x": INT, "y": STR}, "required": ["kind"],
      "allOf": [{"if": {"properties": {"kind": {"const": "a"}}}, "then": {"required": ["x"]},
                 "else": {"not": {"required": ["x"]}}},
                {"if": {"properties": {"kind": {"const": "b"}}}, "then": {"required": ["y"]}}]},
     [{"kind": "a", "x": 1}, {"kind": "b", "y": "s"}, {"kind": "a", "x": 1, "y": "s"}],
     [{"kind": "a"}, {"kind": "b", "x": 1, "y": "s"}, {"kind": "b"}]),
    # Constants JSON Schema calls equal (1 and 1.0) are not a discriminator: both parts apply to kind 1.
    ({"type": "object", "properties": {"kind": {"enum": [1, 2]}, "x": INT, "y": STR}, "required": ["kind"],
      "allOf": [{"if": {"properties": {"kind": {"const": 1}}}, "then": {"required": ["x"]}, "else": {"required": ["y"]}},
                {"if": {"properties": {"kind": {"const": 1.0}}}, "then": {"required": ["y"]},
                 "else": {"required": ["x"]}}]},
     [{"kind": 1, "x": 1, "y": "s"}], [{"kind": 1, "x": 1}, {"kind": 1, "y": "s"}]),
    ({"type": "object", "properties": {"x": INT, "y": STR}, "required": ["kind"],
      "allOf": [{"if": {"properties": {"kind": {"const": [1]}}}, "then": {"required": ["x"]}},
                {"if": {"properties": {"kind": {"const": [1.0]}}}, "then": {"required": ["y"]}}]},
     [{"x": 1, "y": "s", "kind": [1]}], [{"x": 1, "kind": [1]}, {"y": "s", "kind": [1]}]),
    # const and enum from two allOf parts: the constant only where the enum has it (github-actions'
    # top-level if on runs.using against its oneOf of runs kinds).
    ({"allOf": [{"enum": ["node", "docker"]}, {"anyOf": [{"const": "docker"}, {"const": "composite"}]}]},
     ["docker"], ["composite", "node"]),
    # uri: the authority's ':' starts a port of digits (a random walk wrote "https://'x:pointer(...").
    ({"type": "string", "format": "uri"}, ["https://example.com:8080/a?b#c", "http://u:p@h/x"],
     ["https://h:abc", "https://a:b:c/"]),
    # multipleOf p/q: integers that p divides; if: false takes else.
    ({"type": "number", "multipleOf": 1.5, "maximum": 20}, [0, 3, 18, -6], [1, 20.5]),
    ({"type": "integer", "multipleOf": 0.0001}, [7, -3], [0.5]),
    ({"if": False, "then": {"const": "t"}, "else": {"const": "e"}}, ["e"], ["t"]),
    # if/then/else: through `then`, and through `else` where `not: if` can be said (numeric bounds too).
    ({"if": {"exclusiveMaximum": 0}, "then": {"minimum": -10}, "else": {"multipleOf": 2}},
     [-1, -10, 0, 4, "s"], [-11, 3, 0.5]),
    ({"if": {"type": "string"}, "then": {"maxLength": 2}, "else": {"type": "integer", "minimum": 5}},
     ["ab", 7], ["abc", 3, None]),
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}, "else": {"required": ["c"]},
      "additionalProperties": INT}, [{"a": 1, "b": 2}, {"c": 1}], [{"a": 1}, {}, {"a": 1, "c": 2}]),
    # $dynamicRef: the root's $dynamicAnchor wins over the static target's (it starts every dynamic
    # scope); to a plain $anchor or a pointer it is a $ref.
    ({"$id": "http://example.com/root", "$ref": "list", "$dynamicAnchor": "items", "$defs": {
        "items": {"$dynamicAnchor": "items", "type": "string", "maxLength": 2},
        "list": {"$id": "list", "type": "array", "items": {"$dynamicRef": "#items"},
                 "$defs": {"any": {"$dynamicAnchor": "items"}}}}},
     [["ab"], []], [[1], ["abc"]]),
    ({"$id": "http://example.com/d", "type": "array", "items": {"$dynamicRef": "#k"},
      "$defs": {"k": {"$anchor": "k", "type": "integer"}}}, [[1, 2]], [["a"]]),
    # Valid instances the grammar used to reject (issue 17, round 7). contains with counts: matches
    # anywhere among other items; with maxContains, maxItems or prefixItems, items counted as matching
    # or failing `contains` (its `not`: numbers, booleans and strings other than the constants).
    ({"type": "array", "contains": {"const": 1}, "minContains": 2}, [[1, 2, 1], [2, 1, 3, 1, 4]], [[1, 2], [2]]),
    ({"type": "array", "contains": {"const": 1}, "maxContains": 1}, [[1], [1, 2], [2, 3, 1], [0.5, 1, True]],
     [[], [1, 1], [1, 2, 1]]),
    ({"type": "array", "prefixItems": [STR], "contains": INT, "maxItems": 3}, [["a", 1], ["a", "b", 2], ["a", 1, 2]],
     [["a"], ["a", "b"], ["a", 1, 2, 3], [1]]),
    ({"type": "array", "contains": {"enum": ["x", True]}, "minContains": 1, "maxContains": 2, "minItems": 3},
     [["x", 1, 2], [None, True, "x"]], [["x", "x", True], ["x", 1], [1, 2, 3]]),
    # unevaluatedItems beside contains: an item that matches `contains` is evaluated.
    ({"type": "array", "prefixItems": [True], "contains": STR, "unevaluatedItems": False},
     [[1, "foo"], ["a"], [1, "a", "b"]], [[1, 2], [1, 2, "foo"], [1]]),
    # A few optional keys in any order (required ones stay in schema order: forced text).
    ({"type": "object", "properties": {"a": INT, "b": STR, "c": INT}, "maxProperties": 2},
     [{"c": 1, "a": 2}, {"b": "x", "c": 1}, {"c": 3}, {}], [{"a": 1, "b": "x", "c": 2}, {"c": 1, "a": "2"}]),
    ({"type": "object", "properties": {"a": INT, "b": INT}, "additionalProperties": STR, "minProperties": 2},
     [{"b": 1, "a": 2}, {"b": 1, "x": "y"}, {"x": "y", "z": "w"}], [{"b": 1}, {"b": 1, "x": 2}]),
    # oneOf whose type split would lose values: small branches exclude each other with `not`.
    ({"oneOf": [INT, {"minimum": 2}]}, [1, 2.5, "s", -4], [3, 1.5]),
    ({"not": {"enum": [1, "a", True, None]}}, [2, 0.5, "b", False, [], {}], [1, "a", True, None, 1.0]),
    # patternProperties' key terminal excludes only the listed names its pattern matches ("x-a", not "b").
    ({"type": "object", "properties": {"x-a": {"type": ["integer", "string"]}, "b": INT},
      "patternProperties": {"^x-": STR}, "additionalProperties": False},
     [{"x-a": "s", "b": 1}, {"x-b": "t"}, {"b": 2, "x-": ""}], [{"x-a": 1}, {"x-c": 1}, {"c": "s"}, {"b": "s"}]),
    # oneOf told apart by a required key's constant, the parent's enum for the key merged beside it.
    (DISCRIMINATED, [{"kind": "s", "value": "x"}, {"kind": "b", "value": True}, {"kind": "b"}],
     [{"kind": "s", "value": True}, {"value": "x"}, {"kind": "n"}, {"kind": "s", "other": 1}]),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_accepts_valid_rejects_invalid_and_samples_validate(case, tiny_tokenizer):
    schema, good, bad = CASES[case]
    validator = _validator(schema)
    c = build_constraint("json_schema", schema, tiny_tokenizer)
    for doc in good:
        assert validator.is_valid(doc), doc  # the oracle agrees with the case table
        assert accepts_text(c, json.dumps(doc, separators=(",", ":"), ensure_ascii=False)), doc
    for doc in bad:
        text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False)
        assert not validator.is_valid(doc), doc
        assert not accepts_text(c, text), doc
    rng = np.random.default_rng(case)
    for _ in range(60):  # a uniform random policy: the harshest sampler
        c = build_constraint("json_schema", schema, tiny_tokenizer)
        text = tiny_tokenizer.decode(random_walk(c, rng, max_tokens=30), clean_up_tokenization_spaces=False)
        validator.validate(json.loads(text))


def test_oneof_told_apart_by_constants_through_allof_needs_no_not():
    """The branches' signatures see the key's constant inside the merge's allOf (the parent's enum beside
    the branch's const): they exclude each other as they are, so no `not` of one branch is built into
    another (that grew this grammar ~5x; its language is checked in the CASES table)."""
    assert len(json_schema_to_grammar(DISCRIMINATED).rules) <= 12


def test_objects_listing_other_names_share_a_pattern_key_terminal():
    """Names a patternProperties pattern cannot match are not excluded from its key terminal, so objects
    with the same pattern and other listed names share one terminal (and its automaton product)."""
    x_keys = {"type": "object", "patternProperties": {"^x-": STR}, "additionalProperties": False}
    schema = {"type": "object", "properties": {"p": {**x_keys, "properties": {"a": INT}},
                                               "q": {**x_keys, "properties": {"b": INT, "c": INT}}}}
    names = compile_grammar(json_schema_to_grammar(schema)).terminal_names
    assert len([n for n in names if n.startswith("key:")]) == 1


def test_exclusive_oneof_drops_a_branch_it_cannot_convert(tiny_tokenizer):
    """A branch refused (here a $ref that does not resolve) is dropped from a oneOf whose branches exclude
    each other, as from one whose branches exclude each other by `not`; all refused: the refusal."""
    broken = {"properties": {"kind": {"const": "r"}, "value": {"$ref": "https://example.com/missing.json"}},
              "required": ["kind", "value"]}
    schema = {**DISCRIMINATED, "oneOf": [*DISCRIMINATED["oneOf"], broken]}
    c = build_constraint("json_schema", schema, tiny_tokenizer)
    assert accepts_text(c, '{"kind":"s","value":"x"}') and not accepts_text(c, '{"kind":"r","value":1}')
    with pytest.raises(ValueError, match=re.escape("#/oneOf/0/properties/value/$ref")):
        other = {**broken, "properties": {**broken["properties"], "kind": {"const": "q"}}}
        build_constraint("json_schema", {"type": "object", "oneOf": [broken, other]}, tiny_tokenizer)


def test_format_is_an_annotation_where_the_schema_declares_draft_2020_12(tiny_tokenizer):
    declared = {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "string", "format": "date"}
    validator = jsonschema.Draft202012Validator(declared)  # the draft's default: no format assertion
    c = build_constraint("json_schema", declared, tiny_tokenizer)
    for doc in ["2024-02-29", "06/19/1963", 1]:
        assert accepts_text(c, json.dumps(doc)) == validator.is_valid(doc), doc
    strict = build_constraint("json_schema", {k: v for k, v in declared.items() if k != "$schema"}, tiny_tokenizer)
    assert accepts_text(strict, '"2024-02-29"') and not accepts_text(strict, '"06/19/1963"')


def test_pattern_classes_are_ecma_262_ascii(tiny_tokenizer):
    """JSON schema's `pattern` is ECMA-262: \\d and \\w are ASCII (Python's `re`, and so `jsonschema`,
    would take Unicode digits); the oracle here is `re` with re.ASCII, searching."""
    schema = {"type": "string", "pattern": r"^\d+-\w+$"}
    c = build_constraint("json_schema", schema, tiny_tokenizer)
    assert accepts_text(c, '"12-ab_"') and not accepts_text(c, '"١٢-ab"') and not accepts_text(c, '"12-é"')
    rng = np.random.default_rng(0)
    for _ in range(40):
        c = build_constraint("json_schema", schema, tiny_tokenizer)
        text = json.loads(tiny_tokenizer.decode(random_walk(c, rng, max_tokens=20), clean_up_tokenization_spaces=False))
        assert re.search(r"^\d+-\w+$", text, re.ASCII), text


def test_oneof_that_may_overlap_is_refused_with_its_pointer(tiny_tokenizer):
    # `not` of a format has no positive form here: neither branch can exclude the other
    schema = {"properties": {"p": {"oneOf": [{"type": "string"}, {"type": "string", "format": "email"}]}}}
    with pytest.raises(ValueError, match=re.escape("#/properties/p/oneOf: ") + ".*its branches may overlap"):
        build_constraint("json_schema", schema, tiny_tokenizer)


@pytest.mark.parametrize("schema, where", [
    ({"items": {"not": {"format": "email"}}}, "#/items/not: 'not' of format is not supported"),
    ({"$defs": {"a": {"$dynamicRef": "#x"}}, "$ref": "#/$defs/a"}, "#/$defs/a/$dynamicRef"),
    ({"$id": "http://e.com/r", "$defs": {  # two resources with the anchor, neither the root: path-dependent
        "a": {"$id": "a", "$dynamicAnchor": "t", "type": "integer"},
        "b": {"$id": "b", "$dynamicAnchor": "t", "items": {"$dynamicRef": "a#t"}}}, "$ref": "b"},
     "http://e.com/b/items/$dynamicRef"),
    ({"properties": {"a/b": {"type": "string", "pattern": "x", "minLength": 100}}}, "#/properties/a~1b/pattern"),
])
def test_refusals_name_keyword_and_json_pointer(schema, where, tiny_tokenizer):
    with pytest.raises(ValueError, match=re.escape(where)):
        build_constraint("json_schema", schema, tiny_tokenizer)


def test_refs_to_registered_documents_resolve(tmp_path, tiny_tokenizer):
    from radixlm.core.runtime.constrained.schema.schema_refs import register_documents

    (tmp_path / "sub").mkdir()
    (tmp_path / "int.json").write_text(json.dumps({"$id": "http://example.com/int.json", "type": "integer"}))
    # no $id: known by its path under the base URI; its relative ref resolves against that location
    (tmp_path / "sub" / "pair.json").write_text(json.dumps({"type": "array", "prefixItems": [{"$ref": "str.json"}],
                                                            "items": False}))
    (tmp_path / "sub" / "str.json").write_text(json.dumps({"type": "string", "maxLength": 2}))
    schema = {"properties": {"a": {"$ref": "http://example.com/int.json"},
                             "b": {"$ref": "http://remote.test/sub/pair.json"}}, "required": ["a", "b"]}
    with pytest.raises(ValueError, match=re.escape("#/properties/a/$ref") + ".*does not resolve"):
        build_constraint("json_schema", schema, tiny_tokenizer)
    assert register_documents(tmp_path, "http://remote.test/") == 4  # int.json under its $id and its path
    c = build_constraint("json_schema", schema, tiny_tokenizer)
    assert accepts_text(c, '{"a":1,"b":["xy"]}')
    assert not accepts_text(c, '{"a":1,"b":["xyz"]}') and not accepts_text(c, '{"a":"1","b":["x"]}')
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="bad.json"):
        register_documents(tmp_path)


@pytest.mark.parametrize("dialect", ["http://json-schema.org/draft-04/schema#", "http://json-schema.org/draft-07/schema#",
                                     "https://json-schema.org/draft/2020-12/schema"])
def test_ref_siblings_are_ignored_before_2019_09_and_apply_after(dialect, tiny_tokenizer):
    schema = {"$schema": dialect, "definitions": {"d": {"properties": {"basic": STR}}}, "type": "object",
              "properties": {"x": {"$ref": "#/definitions/d", "type": "object", "required": ["basic"]}}}
    validator = jsonschema.validators.validator_for(schema)(schema)
    c = build_constraint("json_schema", schema, tiny_tokenizer)
    docs = [{"x": "s"}, {"x": 1}, {"x": {}}, {"x": {"basic": "a"}}, {"x": {"basic": 1}}]
    assert sum(map(validator.is_valid, docs)) == (1 if "2020" in dialect else 4)
    for doc in docs:
        assert accepts_text(c, json.dumps(doc, separators=(",", ":"))) == validator.is_valid(doc), doc


def test_allof_of_three_different_constants_admits_no_value(tiny_tokenizer):
    with pytest.raises(ValueError, match="admits no value"):
        build_constraint("json_schema", {"allOf": [{"const": 1}, {"const": 2}, {"const": 3}]}, tiny_tokenizer)


def test_optional_properties_grow_the_grammar_linearly():
    """60 optional properties: the regex converter wrote ~n² copies; the grammar holds O(n) rules and
    compiles in well under a second."""
    def grammar_size(n):
        g = json_schema_to_grammar({"type": "object", "properties": {f"p{i}": INT for i in range(n)}})
        return sum(len(r.edges) for r in compile_grammar(g).rules)
    assert grammar_size(60) < 2.5 * grammar_size(30)
    start = time.perf_counter()
    compile_grammar(json_schema_to_grammar({"type": "object", "properties": {f"p{i}": STR for i in range(200)}}))
    assert time.perf_counter() - start < 1.0


def test_long_max_length_and_many_refs_compile_without_building_a_whole_dfa(tiny_tokenizer):
    """A `maxLength: 255` string was a 3,573-state DFA (1.5 s); here it is a rule of 257 symbol states."""
    c = build_constraint("json_schema", {"type": "string", "maxLength": 255}, tiny_tokenizer)
    assert accepts_text(c, json.dumps("x" * 255)) and not accepts_text(c, json.dumps("x" * 256))
    defs = {f"d{i}": {"type": "object", "properties": {"n": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(300)}
    defs["d300"] = INT
    c = build_constraint("json_schema", {"$defs": defs, "$ref": "#/$defs/d0"}, tiny_tokenizer)
    assert accepts_text(c, '{"n":{"n":{}}}')


def test_budgets_raise_grammar_budget_error(tiny_tokenizer):
    with pytest.raises(GrammarBudgetError, match="max_terminal_states"):
        build_constraint("regex", r"[a-z]{1,300}[0-9]{1,300}", tiny_tokenizer,
                         budget=GrammarBudget(max_terminal_states=500))
    big = {"type": "object", "properties": {f"p{i}": {"type": "array", "items": STR} for i in range(300)}}
    with pytest.raises(GrammarBudgetError, match="max_compile_seconds"):
        build_constraint("json_schema", big, tiny_tokenizer, budget=GrammarBudget(max_compile_seconds=0.001))
    # Past half of max_configs a shared index is not handed to new requests (running ones keep theirs).
    budget, schema = GrammarBudget(max_configs=400), {"type": "string", "maxLength": 300}
    c = build_constraint("json_schema", schema, tiny_tokenizer, budget=budget)
    assert build_constraint("json_schema", schema, tiny_tokenizer, budget=budget).index is c.index
    for t in tiny_tokenizer.encode('"' + "x" * 250):  # a new configuration per character
        c.advance(t)
    assert c.index.num_states >= 200
    assert build_constraint("json_schema", schema, tiny_tokenizer, budget=budget).index is not c.index


def test_automaton_products_check_the_compile_deadline():
    """Intersecting and subtracting automata (length bounds with a pattern, propertyNames) can take long:
    the compile deadline is checked inside them, not only between them."""
    from radixlm.core.runtime.constrained.tokens.counted_string import counted_string_dfa
    from radixlm.core.runtime.constrained.automata.dfa_product import dfa_intersection
    from radixlm.core.runtime.constrained.automata.regex_dfa import regex_to_dfa

    calls = []

    def deadline() -> None:
        calls.append(1)
        if len(calls) > 3:
            raise GrammarBudgetError("compiling the constraint took over the budget")

    with pytest.raises(GrammarBudgetError):
        dfa_intersection(counted_string_dfa(0, 64), regex_to_dfa(r'"[a-z0-9_]+"'), check=deadline)


def test_automaton_products_match_python_re():
    """Intersection and difference (one product each) against re.fullmatch of both patterns, on every
    string of up to 5 characters over the alphabet the patterns use."""
    import itertools

    from radixlm.core.runtime.constrained.automata.dfa_product import dfa_difference, dfa_disjoint, dfa_intersection
    from radixlm.core.runtime.constrained.automata.regex_dfa import regex_to_dfa

    pairs = [("a[ab]*", "[ab]*b"), ("(ab|ba)+", "a.*"), ("a{2,4}", "a{3}"), ("[abc]{1,3}", "c?"), ("ab", "ba"),
             ("ab[abc]{1,3}", "ba[abc]{1,3}"), ("a*b", "a*c")]
    for p, q in pairs:
        a, b = regex_to_dfa(p), regex_to_dfa(q)
        both, only = dfa_intersection(a, b), dfa_difference(a, b)
        assert dfa_disjoint(a, b) == (both is None), (p, q)
        for n in range(6):
            for chars in itertools.product("abc", repeat=n):
                text = "".join(chars)
                in_p, in_q = re.fullmatch(p, text) is not None, re.fullmatch(q, text) is not None
                assert (both is not None and both.fullmatch(text)) == (in_p and in_q), (p, q, text)
                assert (only is not None and only.fullmatch(text)) == (in_p and not in_q), (p, q, text)


def test_left_recursion_is_refused():
    g = Grammar({"e": alt(seq(Ref("e"), lit("+"), lit("1")), lit("1"))}, "e")
    with pytest.raises(ValueError, match="left recursion"):
        compile_grammar(g)


@pytest.mark.parametrize("rules, refused", [
    # e calls itself after a part that may read nothing: a terminal, a rule, a rule through another
    ({"e": alt(seq(opt(lit("x")), Ref("e"), lit("y")), lit("z"))}, True),
    ({"b": opt(lit("b")), "e": alt(seq(Ref("b"), Ref("e"), lit("a")), lit("a"))}, True),
    ({"b": opt(lit("b")), "c": seq(opt(lit("c")), Ref("b")), "e": alt(seq(Ref("c"), Ref("e"), lit("a")), lit("a"))},
     True),
    # not left recursion: "+" or a rule that reads a byte comes first
    ({"b": opt(lit("b")), "e": alt(seq(Ref("b"), lit("+"), Ref("e")), lit("a"))}, False),
    ({"d": lit("d"), "e": alt(seq(Ref("d"), Ref("e"), lit("a")), lit("a"))}, False),
])
def test_left_recursion_through_rules_that_read_nothing(rules, refused):
    g = Grammar({"start": Ref("e"), **rules}, "start")
    if refused:
        with pytest.raises(ValueError, match="left recursion"):
            compile_grammar(g)
    else:
        compile_grammar(g)


def test_a_recursive_grammar_counts_brackets(tiny_tokenizer):
    """Balanced brackets: not regular, so no DFA path could do this."""
    from radixlm.core.runtime.constrained.grammar_index_cache import GrammarIndex
    from radixlm.core.runtime.constrained.tokens.vocab import vocab_of

    g = Grammar({"s": Repeat(seq(lit("("), Ref("s"), lit(")")))}, "s")
    index = GrammarIndex(compile_grammar(g), vocab_of(tiny_tokenizer))
    from radixlm.core.runtime.constrained.grammar_constraint import GrammarConstraint
    c = GrammarConstraint(index)
    for text, ok in [("(()())", True), ("((())", False), ("())", False), ("", True)]:
        assert accepts_text(c, text) == ok, text


@pytest.mark.parametrize("schema", [{"type": "integer"}, {"type": "integer", "maximum": 3},
                                    {"type": "integer", "multipleOf": 3}, {"const": 2.0}, {"enum": [0]}])
def test_integers_are_canonical(schema, tiny_tokenizer):
    """JSON Schema counts 1.0 as an integer, but json.loads reads it as a float: never generated."""
    c = build_constraint("json_schema", schema, tiny_tokenizer)
    whole = {"const": 2, "enum": 0}.get(next(iter(schema)), 0)
    assert accepts_text(c, str(whole))
    assert not accepts_text(build_constraint("json_schema", schema, tiny_tokenizer), f"{whole}.0")


def _whole(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


@pytest.mark.parametrize("kind, spec", [
    ("regex", r"(ab|cd)*[0-9]{2,4}"),
    ("regex", r"(Paris|Par|Parma)!?|é{1,2}[^a-z]"),
    ("choices", ["yes", "no", "maybe", "yes!"]),
])
def test_masks_equal_python_regex_partial_matches(kind, spec, tiny_tokenizer):
    """At every step of random walks, a token is allowed exactly when the text with it is still a prefix of
    a match (the `regex` package's partial fullmatch: an oracle independent of our automata), EOS exactly
    when the text matches."""
    regex = pytest.importorskip("regex")
    pattern = spec if kind == "regex" else "|".join(re.escape(c) for c in spec)
    token_bytes = build_constraint(kind, spec, tiny_tokenizer).index.token_bytes
    eos = tiny_tokenizer.eos_token_id
    rng = np.random.default_rng(0)
    for _ in range(8):
        c = build_constraint(kind, spec, tiny_tokenizer)
        ids = random_walk(build_constraint(kind, spec, tiny_tokenizer), rng, max_tokens=12)
        text = b""
        for t in [*ids, None]:
            mask = c.allowed_token_mask(len(tiny_tokenizer)).numpy()
            if not _whole(text):  # inside a character: the oracle reads text, so only EOS is checked
                assert not mask[eos]
                if t is not None:
                    c.advance(t)
                    text += token_bytes[t]
                continue
            for u, data in enumerate(token_bytes):
                try:
                    candidate = (text + data).decode()
                except UnicodeDecodeError:
                    continue  # a piece of a character: no text to ask the oracle about
                if data:
                    expected = regex.fullmatch(pattern, candidate, partial=True) is not None
                    assert mask[u] == expected, (spec, candidate)
            assert mask[eos] == (re.fullmatch(pattern, text.decode()) is not None)
            if t is not None:
                c.advance(t)
                text += token_bytes[t]


def test_llguidance_backend_behind_the_same_interface(tiny_tokenizer):
    pytest.importorskip("llguidance")
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "b": {"enum": ["x", "y"]}}, "required": ["a", "b"],
              "additionalProperties": False}
    rng = np.random.default_rng(0)
    vocab = len(tiny_tokenizer)
    for _ in range(10):
        c = build_constraint("json_schema", schema, tiny_tokenizer, backend="llguidance")
        ids = []
        while not c.is_finished() and len(ids) < 60:
            allowed = np.flatnonzero(c.allowed_token_mask(vocab).numpy())
            if tiny_tokenizer.eos_token_id in allowed:
                break
            t = int(rng.choice(allowed))
            c.advance(t)
            ids.append(t)
        _validator(schema).validate(json.loads(tiny_tokenizer.decode(ids)))


def test_token_classes_assembled_per_first_byte_equal_a_whole_walk(tiny_tokenizer):
    """A state's token classes reuse earlier states' subtrees or are walked node by node
    (terminal_tokens._classify): they must equal one walk of the whole vocabulary from that state, for key
    terminals that exclude listed names too."""
    from radixlm.core.runtime.constrained.tokens import terminal_tokens, trie_walk
    from radixlm.core.runtime.constrained.tokens.vocab import vocab_of

    vocab = vocab_of(tiny_tokenizer)
    first = vocab.trie.byte[1].astype(np.int64)
    for schema in [{"type": "object", "additionalProperties": INT},  # a plain string's body first
                   {"type": "object", "properties": {"foo": {}, "fob": {}, "bar": {}}, "additionalProperties": INT},
                   {"type": "number", "exclusiveMinimum": 1.5}]:
        grammar = compile_grammar(json_schema_to_grammar(schema))
        for name, dfa in zip(grammar.terminal_names, grammar.terminals):
            for q in range(dfa.num_states):
                classes = terminal_tokens._classify(name, dfa, q, vocab)
                inside = np.flatnonzero(np.unpackbits(classes[INSIDE], count=vocab.size, bitorder="little"))
                tokens, starts = [], []
                if classes[EXITS] is not None:
                    tokens = classes[EXITS].pair_token.tolist()
                    suffixes = [classes[EXITS].tree.suffixes[k] for k in classes[EXITS].pair_suffix.tolist()]
                    starts = [len(vocab.token_bytes[i]) - len(x) for i, x in zip(tokens, suffixes)]
                uncertain = np.unique(np.asarray(tokens, dtype=np.int64))
                for i, j in zip(tokens, starts):  # where they leave: an accepting state
                    assert 0 < j < len(vocab.token_bytes[i]), (name, q, i, j)
                    at = _run(dfa, q, vocab.token_bytes[i][:j])
                    assert at >= 0 and dfa.accepting[at], (name, q, i, j)
                nxt = dfa.transitions[q, first]
                live = np.flatnonzero(nxt >= 0)
                whole, exits = trie_walk.walk_trie(name, dfa, live, nxt[live], vocab)
                assert sorted(inside.tolist()) == np.flatnonzero(whole).tolist(), (name, q)
                assert sorted(uncertain.tolist()) == sorted(exits.tolist()), (name, q)


def _run(dfa, q, data: bytes) -> int:
    for b in data:
        q = int(dfa.transitions[q, b])
        if q < 0:
            break
    return q


def test_depth_first_completion_finds_the_way_breadth_first_drowns_in(tiny_tokenizer):
    """Inside a value of any shape, with a long required key still ahead, a breadth-first search runs
    out of states (the random walks' helper gave up so on two Kubernetes schemas); the depth-first
    search, closing bytes first, reaches an end, and the text it completes is valid."""
    from radixlm.core.runtime.constrained.accept_paths import bytes_to_accept, shortest_bytes_to_accept

    schema = {"type": "object", "properties": {"a": {}, "a_rather_long_required_key_name": STR},
              "required": ["a", "a_rather_long_required_key_name"]}
    c = build_constraint("json_schema", schema, tiny_tokenizer)
    index, state = c.index, c.index.start
    prefix = '{"a":[{"x":[[1,{"y":"'
    for b in prefix.encode():
        state = index.byte_successors(state)[b]
    assert shortest_bytes_to_accept(index, state, 2_000) is None
    rest = bytes_to_accept(index, state)
    assert rest is not None and accepts_text(c, prefix + rest.decode())
    _validator(schema).validate(json.loads(prefix + rest.decode()))


def test_move_tables_shared_by_schemas_give_the_masks_of_an_index_alone(tiny_tokenizer):
    """Item move tables are kept process-wide by terminal name (pda.py): a schema whose strings and
    numbers an earlier schema's index already moved through gets, configuration by configuration, the
    masks of an index built with nothing shared. (No warm-up: it interns configurations for a wall-clock
    budget, so their numbering would depend on the machine's load.)"""
    budget = GrammarBudget(warm_seconds=0)
    from radixlm.core.runtime.constrained import grammar_index_cache, pda

    def reached(index, limit=60):
        seen, queue, masks = [0], [0], []
        while queue and len(seen) < limit:
            state = queue.pop(0)
            allowed = index.allowed_tokens(state)
            masks.append(allowed)
            for t in allowed[:: max(1, len(allowed) // 25)].tolist():
                nxt = index.next_state(state, t)
                if nxt not in seen:
                    seen.append(nxt)
                    queue.append(nxt)
        return seen, masks

    first = {"type": "object", "properties": {"a": STR, "n": {"type": "number"}}, "required": ["a", "n"]}
    second = {"type": "array", "items": {"anyOf": [STR, {"type": "number"}]}, "maxItems": 3}
    reached(build_constraint("json_schema", first, tiny_tokenizer, budget=budget).index)
    before = set(pda._shared_moves)
    shared = build_constraint("json_schema", second, tiny_tokenizer, budget=budget).index
    seen, masks = reached(shared)
    names, fingerprint = shared.grammar.terminal_names, shared.vocab.fingerprint
    used = {(tuple((names[t], q) for t, q in key), fingerprint) for key in shared._moves}
    assert used & before  # some tables came from the first schema's index
    pda._shared_moves.clear()
    grammar_index_cache._cache.clear()
    alone = build_constraint("json_schema", second, tiny_tokenizer, budget=budget).index
    alone_seen, alone_masks = reached(alone)
    assert seen == alone_seen and len(seen) > 10
    for a, b in zip(masks, alone_masks):
        np.testing.assert_array_equal(a, b)


def test_valid_misses_name_the_documented_cause(tiny_tokenizer):
    """bench_grammar's causes of valid instances the grammar rejects (benchmarks/valid_misses.py), each
    found by walking the real grammar of a changed schema or instance."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "valid_misses.py"
    spec = importlib.util.spec_from_file_location("valid_misses", path)
    valid_misses = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(valid_misses)

    def accepts(schema, instance):
        try:
            c = build_constraint("json_schema", schema, tiny_tokenizer)
        except ValueError:
            return False
        return accepts_text(c, json.dumps(instance, separators=(",", ":")))

    cases = [({"type": "integer"}, 1.0, "integer written 1.0"),
             ({"properties": {"a": INT}}, {"a": 1, "b": 2}, "additionalProperties"),
             ({"type": "array", "uniqueItems": True}, [1, 2], "uniqueItems"),
             ({"type": "number", "multipleOf": 1.5}, 4.5, "multipleOf a fraction"),
             ({"$schema": "http://example.com/meta", "minimum": 5}, 1, "custom metaschema"),
             ({"properties": {"a": INT, "b": INT}, "required": ["a", "b"]}, {"b": 1, "a": 2}, "key order"),
             ({"type": "array", "items": INT, "maxItems": 1}, [1, 2], "maxItems")]  # (an invalid one)
    for schema, instance, why in cases:
        assert not accepts(schema, instance)
        assert valid_misses.cause(accepts, schema, instance) == why, (schema, instance)
        assert (why in valid_misses.DOCUMENTED) == (why != "maxItems")


@pytest.mark.parametrize("schema, doc", [
    ({"type": "object", "properties": {"foo": {"type": "number"}, "fob": {"enum": ["x", 2]}},
      "additionalProperties": {"type": "array", "items": {"type": "integer"}}},
     {"foo": -1.25, "fob": 2, "bar": [10, 0, 7], "fo": []}),
    ({"type": "array", "items": {"anyOf": [{"type": "number"}, {"type": "boolean"}, STR]}},
     [1, 20.5, True, "a,b", -3, False]),
])
def test_masks_equal_the_byte_automaton(schema, doc, tiny_tokenizer):
    """Masks assembled from token classes and exits walked per continuation (terminal_tokens.py, pda.py)
    equal the oracle at every step of a document: token t is allowed iff its bytes lead somewhere from
    the configuration, byte by byte."""
    vocab = len(tiny_tokenizer)
    c = build_constraint("json_schema", schema, tiny_tokenizer)
    text = json.dumps(doc, separators=(",", ":"))
    for t in tiny_tokenizer.encode(text, add_special_tokens=False):
        index, state = c.index, c.state
        oracle = np.array([index.next_state(state, i) >= 0 for i in range(vocab)])
        oracle[index.eos_ids] = index.is_accepting(state)
        assert (c.allowed_token_mask(vocab).numpy() == oracle).all(), tiny_tokenizer.decode([t])
        c.advance(t)
    assert c.index.is_accepting(c.state)
