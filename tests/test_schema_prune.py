"""schema_prune: definitions the root cannot reach are dropped, and only where no ref can reach further."""

from __future__ import annotations

import jsonschema
import pytest

from radixlm.core.runtime.constrained.schema.schema_prune import MIN_PRUNE_KEYS, prune_definitions


def _big(root: dict, extra: dict | None = None) -> dict:
    defs = {f"d{i}": {"type": "integer", "minimum": i} for i in range(MIN_PRUNE_KEYS)}
    defs["a/b"] = {"type": "object", "properties": {"n": {"$ref": "#/$defs/d7"}}}
    defs["loop"] = {"type": "array", "items": {"$ref": "#/$defs/loop"}}
    return dict(root, **{"$defs": dict(defs, **(extra or {}))})


def test_keeps_what_pointer_refs_reach_transitively():
    schema = _big({"type": "object", "properties": {"x": {"$ref": "#/$defs/a~1b"}, "y": {"$ref": "#/$defs/loop"},
                                                    "z": {"$ref": "#/$defs/wrap/items"}}},
                  {"wrap": {"type": "array", "items": {"type": "string"}}})
    pruned = prune_definitions(schema)
    assert set(pruned["$defs"]) == {"a/b", "d7", "loop", "wrap"}
    assert pruned["properties"] is schema["properties"]  # shallow: nothing copied
    # jsonschema (the oracle) judges instances the same under both documents.
    for instance in ({"x": {"n": 7}}, {"x": {"n": 6}}, {"y": [[], [[]]]}, {"y": [1]}, {"z": "s"}, {"z": 1}):
        assert (jsonschema.Draft202012Validator(schema).is_valid(instance)
                == jsonschema.Draft202012Validator(pruned).is_valid(instance))


@pytest.mark.parametrize("root, extra", [
    ({"$ref": "#/$defs/x"}, {"x": {"$id": "http://example.com/x", "$ref": "#/$defs/d1"}}),  # a base URI below
    ({"$ref": "#/$defs/x"}, {"x": {"$anchor": "here"}}),
    ({"$ref": "#here"}, None),  # an anchor ref may reach any definition
    ({"$ref": "http://example.com/other.json"}, None),
    ({"$ref": "#/$defs"}, None),  # the whole table
    ({"$dynamicRef": "#meta"}, None),
])
def test_unchanged_where_a_ref_may_reach_further(root, extra):
    schema = _big(root, extra)
    assert prune_definitions(schema) is schema


def test_small_documents_and_non_objects_unchanged():
    small = {"$defs": {"a": {"type": "string"}, "b": {"type": "integer"}}, "$ref": "#/$defs/a"}
    assert prune_definitions(small) is small
    assert prune_definitions(True) is True


def test_root_id_is_the_base_of_every_pointer():
    schema = _big({"$id": "http://example.com/root.json", "$ref": "#/$defs/d2"})
    assert set(prune_definitions(schema)["$defs"]) == {"d2"}
