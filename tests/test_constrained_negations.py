"""Schemas the converter used to refuse (issue 38): `not` of enum (arrays and objects among the values),
of multipleOf, of patternProperties; allOf parts with different enums; oneOf whose branches overlap, or
whose items/contains only look contradictory. Checked against `jsonschema`: the given valid instances
accepted where the documented reading keeps them, every given invalid one rejected, and random walks
(generated instances) valid."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from radixlm.core.runtime.constrained import build_constraint
from radixlm.testing.constrained import random_walk
from radixlm.testing.constrained import accepts_text

INT = {"type": "integer"}

OPEN_VERSIONED = {"type": "object", "required": ["version"], "additionalProperties": {}}
CLOSED_KIND = {"type": "object", "properties": {"kind": {"const": "x"}, "at": {"type": "string", "format": "email"}},
               "required": ["kind"], "additionalProperties": False}

# (schema, valid instances the grammar accepts, invalid instances)
CASES = [
    ({"not": {"enum": [1, "x", None, [1], {"b": 2}]}},
     [2, "y", True, [], [2], [1, 1], {}, {"b": 3}], [1, "x", None, [1], {"b": 2}]),
    ({"type": "array", "not": {"enum": [[1, 2], ["a"]]}, "items": {"type": ["integer", "string"]}},
     [[], [1], [2, 1], [1, 3], ["b"], [1, 2, 3]], [[1, 2], ["a"], [1.5]]),
    ({"type": "integer", "not": {"multipleOf": 3}}, [1, 2, -4, 100], [0, 3, -9, 300, 1.5]),
    ({"not": {"multipleOf": 2}}, [1, -3, 2.5], [0, 2, -4, 10, "a", None]),
    ({"type": "integer", "minimum": 0, "maximum": 20, "multipleOf": 2, "not": {"multipleOf": 3}},
     [2, 4, 8, 10, 14, 16, 20], [0, 6, 12, 18, 3, 22]),
    ({"enum": [3, 4, 6, 7], "not": {"multipleOf": 3}}, [4, 7], [3, 6, 5]),
    ({"type": "integer", "not": {"multipleOf": 1.5}}, [1, 2, 4], [0, 3, 6]),
    ({"type": "object", "not": {"patternProperties": {"^x-": {"type": "string"}}}},
     [{"x-a": 1}, {"x-a": 1, "x-b": None}], [{}, {"x-a": "s"}, {"y": 1}, {"x-a": "s", "y": 2}]),
    ({"allOf": [{"enum": [1, 2, 3, "a"]}, {"enum": [2, 3, "a", "b"]}]}, [2, 3, "a"], [1, "b", 4]),
    ({"oneOf": [{"type": "string", "maxLength": 3}, {"type": "string", "pattern": "^a"}]},
     ["b", "xyz", "abcd"], ["ab", "a", 1]),
    ({"oneOf": [{"type": "array", "items": {"type": "integer"}}, {"type": "array", "contains": {"type": "string"}}]},
     [[], [1, 2], ["a"], [1, "a"]], [[1.5], [None]]),
    ({"type": "array", "oneOf": [{"items": {"type": "integer"}}, {"items": {"type": "string"}}]},
     [[1], ["a"]], [[], [1, "a"], [None]]),
    # additionalProperties beside an allOf covers the keys the allOf's parts list (MaskBench Synthesized
    # additionalProperties_id15, once refused as admitting no value)
    ({"type": "object", "not": {"additionalProperties": {"type": "boolean"}, "allOf": [{"properties": {"foo": {}}}]}},
     [{"foo": 1}, {"foo": 1, "bar": True}, {"foo": None, "b": 2}], [{}, {"foo": True}, {"bar": False}]),
    ({"allOf": [{"enum": [{"bar": True, "foo": 1}]},
                {"not": {"additionalProperties": {"type": "boolean"}, "allOf": [{"properties": {"foo": {}}}]}}]},
     [{"bar": True, "foo": 1}], [{"bar": True, "foo": 1, "x": True}, {"bar": True}]),
    # `not` of propertyNames: some key fails it; one of the listed names (exact, MaskBench pnmp10's shape) ...
    ({"type": "object", "minProperties": 2, "not": {"anyOf": [{"propertyNames": {"not": {"enum": ["1", "3"]}}},
                                                              {"propertyNames": {"not": {"enum": ["2", "3"]}}}]}},
     [{"1": 0, "2": 0}, {"3": 0, "x": 1}, {"2": 1, "1": 2, "z": None}], [{"1": 0, "x": 0}, {"2": 0}, {}, [1], "a"]),
    # ... or, for a pattern, objects all of whose keys fail it (a sound subset: {"a": 1, "b": 2} is left out)
    ({"not": {"propertyNames": {"pattern": "^a"}}},
     [{"b": 1}, {"xy": None, "z": 2}], [{}, {"a": 1}, {"ab": 1, "ac": 2}, 1, "s"]),
    # a pattern's leading negative lookahead: the strings its group matches at the start excluded
    # (MaskBench JsonSchemaStore mongodb-atlas-search-index-definition's analyzer names)
    ({"type": "string", "pattern": "^(?!^lucene\\.|builtin\\.|mongodb\\.).*"},
     ["", "x", "lucene", "lucenex.", "a.lucene.", "mongodb"], ["lucene.", "builtin.x", "mongodb.a", 1]),
    ({"type": "string", "pattern": "^(?!a)(?!b)[a-d]+$"}, ["c", "cd", "da"], ["a", "b", "ab", "", "ce", "cx"]),
    # oneOf branches told apart by a key one requires and the other's additionalProperties false forbids
    # (MaskBench Handwritten testwp9 and WashingtonPost wp_105's promo items): no `not` needed, where the
    # `not` of the closed branch (its format) cannot be said
    ({"oneOf": [OPEN_VERSIONED, CLOSED_KIND]},
     [{"version": 1}, {"version": 2, "kind": "x"}, {"kind": "x"}, {"kind": "x", "at": "a@example.com"}],
     [{}, {"at": "a@example.com"}, {"kind": "y"}, {"kind": "x", "b": 1}, 1]),
    # the same oneOf met twice (a key both listed and matched by a pattern): allOf of the two, each branch
    # merged with the other oneOf's (its combinations with another branch admit no value)
    ({"type": "object", "properties": {"b": {"oneOf": [OPEN_VERSIONED, CLOSED_KIND]}},
      "patternProperties": {"^b": {"oneOf": [OPEN_VERSIONED, CLOSED_KIND]}}},
     [{"b": {"version": 1}}, {"b": {"kind": "x"}}, {"b": {"version": 1}, "bb": {"kind": "x"}}],
     [{"b": {}}, {"b": {"kind": "x", "c": 1}}, {"bb": {"kind": "y"}}]),
    # constants none of which matches the other branch's pattern (renovate's versioning): exclusive as written
    ({"oneOf": [{"enum": ["npm", "regex", "x-regex:"]}, {"type": "string", "pattern": "^regex:"}]},
     ["npm", "regex", "x-regex:", "regex:abc", "regex:"], ["xregex:", "pip", 1]),
    ({"oneOf": [{"enum": ["npm", "regex:x"]}, {"type": "string", "pattern": "^regex:"}]},  # "regex:x" in both
     ["npm", "regex:abc"], ["regex:x", "pip"]),
    # a key one branch requires, with constants the other's optional key never takes (MaskBench o84330's meters:
    # `protocol`), tells them apart; where neither requires it, the objects without it match both
    ({"oneOf": [{"type": "object", "properties": {"p": {"enum": ["a"]}, "x": INT}},
                {"type": "object", "properties": {"p": {"enum": ["b"]}, "y": INT}, "required": ["p"]}]},
     [{}, {"x": 1}, {"p": "a"}, {"p": "b"}, {"p": "b", "y": 1}], [{"p": "c"}, {"p": "b", "y": "s"}, 1]),
    ({"type": "object", "oneOf": [{"properties": {"p": {"enum": ["a"]}}}, {"properties": {"p": {"enum": ["b"]}}}]},
     [{"p": "a"}, {"p": "b"}], [{}, 1, {"p": "c"}]),
    # overlapping oneOf branches excluding each other by `not` under `type: object` (GitHub workflows' steps):
    # each `not`'s "another type" branch dropped before the combinations are made
    ({"type": "object", "properties": {"uses": {}, "run": {}, "wait": {}, "name": {}}, "additionalProperties": False,
      "oneOf": [{"properties": {"uses": True}, "required": ["uses"]}, {"properties": {"run": True}, "required": ["run"]},
                {"properties": {"wait": True}, "required": ["wait"]}]},
     [{"uses": 1}, {"run": 1, "name": 2}, {"wait": [], "name": None}],
     [{}, {"name": 1}, {"uses": 1, "run": 2}, {"run": 1, "wait": 2}, {"uses": 1, "x": 2}, 1]),
    ({"type": "object", "properties": {"b": {"allOf": [{"oneOf": [OPEN_VERSIONED, CLOSED_KIND]},
                                                       {"oneOf": [OPEN_VERSIONED, CLOSED_KIND, {"const": 1}]}]}}},
     [{"b": {"version": 1}}, {"b": {"kind": "x"}}], [{"b": {}}, {"b": 1}, {"b": {"kind": "y"}}]),
]


@pytest.fixture(scope="module")
def tiny_tokenizer(tokenizer_path):
    """The test checkpoints' byte-level BPE tokenizer (1000 tokens)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(tokenizer_path)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_given_instances(case, tiny_tokenizer):
    schema, valid, invalid = CASES[case]
    validator = jsonschema.Draft202012Validator(schema)
    constraint = build_constraint("json_schema", schema, tiny_tokenizer)
    for instance in valid:
        assert validator.is_valid(instance), instance  # the oracle agrees that it is valid
        assert accepts_text(constraint, json.dumps(instance, separators=(",", ":"))), instance
    for instance in invalid:
        assert not validator.is_valid(instance), instance
        assert not accepts_text(constraint, json.dumps(instance, separators=(",", ":"))), instance


@pytest.mark.parametrize("case", [c for c in range(len(CASES)) if CASES[c][1]])
def test_generated_instances_are_valid(case, tiny_tokenizer):
    schema = CASES[case][0]
    validator = jsonschema.Draft202012Validator(schema)
    rng = np.random.default_rng(case)
    for _ in range(40):
        constraint = build_constraint("json_schema", schema, tiny_tokenizer)
        text = tiny_tokenizer.decode(random_walk(constraint, rng, max_tokens=24), clean_up_tokenization_spaces=False)
        assert validator.is_valid(json.loads(text)), text


def test_enums_without_a_common_value_admit_nothing(tiny_tokenizer):
    with pytest.raises(ValueError, match="admits no value"):
        build_constraint("json_schema", {"allOf": [{"enum": [1, 2]}, {"enum": [3]}]}, tiny_tokenizer)


def _objects(keys: list[str], kinds: list) -> list[dict]:
    """Every object over `keys` (in that order) whose "kind", when present, is one of `kinds`; others 1."""
    out = []
    for mask in range(1 << len(keys)):
        present = [k for i, k in enumerate(keys) if mask >> i & 1]
        for kind in kinds if "kind" in present else [None]:
            out.append({k: kind if k == "kind" else 1 for k in present})
    return out


@pytest.mark.parametrize("draft, keyword", [("7", "dependencies"), ("2020-12", "dependentSchemas")])
def test_dependencies_on_one_propertys_value_equal_jsonschema_on_every_object(draft, keyword, tiny_tokenizer):
    """Keys each allowed for some values of one property (MaskBench's mongodb-atlas-search-index-definition
    has 17: 2^17 combinations, once refused) beside a key list and a key whose own value is restricted:
    every object over the keys, in schema order, accepted exactly when jsonschema accepts it."""
    schema = {"type": "object", "additionalProperties": False,
              "properties": {"kind": {"type": "string"}, "x": INT, "y": INT, "z": INT, "w": INT},
              keyword: {"x": {"properties": {"kind": {"enum": ["a", "b"]}}},
                        "y": {"properties": {"kind": {"enum": ["b", "c"], "type": "string"}}},
                        "z": {"properties": {"kind": {"const": "a"}}},
                        "kind": {"properties": {"kind": {"enum": ["a", "b", "c", "e"]}}}}}
    if keyword == "dependencies":
        schema[keyword]["w"] = ["x"]
    else:
        schema["dependentRequired"] = {"w": ["x"]}
    validator = (jsonschema.Draft7Validator if draft == "7" else jsonschema.Draft202012Validator)(schema)
    constraint = build_constraint("json_schema", schema, tiny_tokenizer)
    instances = _objects(["kind", "x", "y", "z", "w"], ["a", "b", "c", "d", "e"])
    assert sum(validator.is_valid(i) for i in instances) > 10
    for instance in instances:
        text = json.dumps(instance, separators=(",", ":"))
        assert accepts_text(constraint, text) == validator.is_valid(instance), text
    rng = np.random.default_rng(0)
    for _ in range(30):
        constraint = build_constraint("json_schema", schema, tiny_tokenizer)
        text = tiny_tokenizer.decode(random_walk(constraint, rng, max_tokens=40), clean_up_tokenization_spaces=False)
        assert validator.is_valid(json.loads(text)), text


def test_many_keys_depending_on_one_propertys_value_compile(tiny_tokenizer):
    keys = [f"k{i}" for i in range(20)]
    schema = {"type": "object", "properties": {"kind": {"enum": ["a", "b", "c"]}, **{k: INT for k in keys}},
              "dependencies": {k: {"properties": {"kind": {"enum": ["abc"[i % 3]]}}} for i, k in enumerate(keys)}}
    constraint = build_constraint("json_schema", schema, tiny_tokenizer)
    assert accepts_text(constraint, '{"kind":"b","k1":1,"k4":2}')
    assert not accepts_text(constraint, '{"kind":"b","k1":1,"k2":2}')
    assert accepts_text(constraint, '{"k1":1,"k2":2}')
