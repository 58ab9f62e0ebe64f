"""allOf merged into one schema, and `$ref`s expanded for a merge: the base of the JSON Schema -> grammar
converter (json_grammar._Converter; json_allof.AllOfRules extends the merge to every keyword it combines)."""

from __future__ import annotations

from typing import Any

from radixlm.core.runtime.constrained.schema.json_common import IGNORED_BESIDE_REF

# Keywords that only annotate, or hold definitions: left out of a merge.
_ANNOTATIONS = {
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "$defs", "definitions",
    "readOnly", "writeOnly", "deprecated", "contentMediaType", "contentEncoding", "discriminator", "format",
    IGNORED_BESIDE_REF,
}
# A $ref expanded inside a merge: at most this many times along one chain of refs (then: no value).
MAX_REF_EXPANSIONS = 3


class SchemaMerge:
    """allOf's merge over schemas whose `$ref`s the subclass resolves (`_resolve`)."""

    max_recursion = MAX_REF_EXPANSIONS

    def _resolve(self, ref: str) -> Any:
        """The schema `ref` points to; ValueError if nothing does."""
        raise NotImplementedError

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
