"""Why the grammar rejected a valid instance: bench_grammar.py's valid misses, each with its cause.

A miss is explained by the smallest change that makes the grammar accept the instance, tried in order:
1. the instance with its whole floats written as integers (`1.0` -> `1`): the canonical integers; the
   instance with every object's keys reversed, or sorted: the key order;
2. the schema with one keyword removed everywhere (its `$defs` included): that keyword is the cause;
   opening the objects (`additionalProperties: true` where an object lists keys and says nothing of
   others) counts as the keyword `additionalProperties`;
3. otherwise "unexplained".
A schema whose `$schema` is a custom metaschema counts as such (its vocabularies are not read); a
`multipleOf` cause where a multipleOf is not a whole number, as "multipleOf a fraction".
The documented classes (docs/constrained.md, "Strictness and approximations") are the causes the
acceptance rate may leave out; every other cause is a miss to fix.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from radixlm.core.runtime.constrained.schema.json_common import whole_numbers

# cause -> why it is documented (docs/constrained.md, "Strictness and approximations")
DOCUMENTED = {
    "integer written 1.0": "integers are generated canonically (json.loads reads 1.0 as a float)",
    "additionalProperties": "objects that list their keys get exactly those (models should not invent keys)",
    "uniqueItems": "uniqueItems is an approximation: no grammar compares two items of any shape",
    "multipleOf a fraction": "numbers: only the integer multiples of p/q (validators disagree on the others)",
    "custom metaschema": "a metaschema's $vocabulary is not read: the validation keywords always apply",
    "key order": "required keys and constant objects in schema order: forced text, which jump-forward writes",
}
_DRAFTS = ("json-schema.org/draft-0", "json-schema.org/draft/20")  # the standard metaschemas' URIs
# Keywords tried first (the documented ones), then every other keyword the schema holds.
_FIRST = ("uniqueItems",)
_OBJECT_KEYS = ("properties", "required", "patternProperties")
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema maps


def cause(accepts: Callable[[Any, Any], bool], schema: Any, instance: Any) -> str:
    """The cause of the miss (a key of DOCUMENTED, another keyword, or "unexplained"); `accepts(schema,
    instance)` walks an instance through the grammar of a schema (False when it does not compile)."""
    canonical = whole_numbers(instance)
    if canonical != instance or json.dumps(canonical) != json.dumps(instance):
        if accepts(schema, canonical):
            return "integer written 1.0"
    if isinstance(instance, (dict, list)) and any(accepts(schema, _reordered(instance, order))
                                                  for order in (reversed, sorted)):
        return "key order"
    if accepts(_opened(schema), instance):
        return "additionalProperties"
    if isinstance(schema, dict) and isinstance(schema.get("$schema"), str) and not any(
            d in schema["$schema"] for d in _DRAFTS):
        return "custom metaschema"
    rest = sorted(_keywords(schema) - set(_FIRST) - {"$ref", "$defs", "definitions", "$id", "$schema"})
    for keyword in [k for k in _FIRST if k in _keywords(schema)] + rest:
        if accepts(_without(schema, keyword), instance):
            if keyword == "multipleOf" and any(isinstance(m, float) and not m.is_integer()
                                               for m in _values(schema, "multipleOf")):
                return "multipleOf a fraction"
            return keyword
    return "unexplained"


def _reordered(value: Any, order) -> Any:
    """`value` with every object's keys in `order` (reversed, sorted): the same JSON value."""
    if isinstance(value, list):
        return [_reordered(v, order) for v in value]
    if isinstance(value, dict):
        return {k: _reordered(value[k], order) for k in order(list(value))}
    return value


def _values(node: Any, keyword: str) -> list:
    """The values `keyword` takes anywhere in `node`."""
    if isinstance(node, list):
        return [v for n in node for v in _values(n, keyword)]
    if not isinstance(node, dict):
        return []
    return ([node[keyword]] if keyword in node else []) + [v for n in node.values() for v in _values(n, keyword)]


def _keywords(node: Any) -> set[str]:
    """Every keyword a subschema of `node` holds (the names under `properties` are not keywords)."""
    if isinstance(node, list):
        return set().union(*(_keywords(v) for v in node))
    if not isinstance(node, dict):
        return set()
    found = set(node)
    for key, value in node.items():
        if key in _NAMED:
            if isinstance(value, dict):
                found |= set().union(*(_keywords(v) for v in value.values()))
        elif key not in ("const", "enum", "required", "examples", "default"):
            found |= _keywords(value)
    return found


def _without(node: Any, keyword: str) -> Any:
    if isinstance(node, list):
        return [_without(v, keyword) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if k in _NAMED and isinstance(v, dict):
            out[k] = {name: _without(s, keyword) for name, s in v.items()}
        elif k != keyword:
            out[k] = v if k in ("const", "enum") else _without(v, keyword)
    return out


def _opened(node: Any) -> Any:
    """Objects that list keys and say nothing of others opened to any other key."""
    if isinstance(node, list):
        return [_opened(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: (v if k in ("const", "enum") else {n: _opened(s) for n, s in v.items()}
               if k in _NAMED and isinstance(v, dict) else _opened(v)) for k, v in node.items()}
    if any(k in node for k in _OBJECT_KEYS) and "additionalProperties" not in node \
            and "unevaluatedProperties" not in node:
        out["additionalProperties"] = True
    return out
