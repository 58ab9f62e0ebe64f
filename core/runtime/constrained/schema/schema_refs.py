"""`$ref` resolution as JSON Schema defines it, through the `referencing` library (jsonschema's own).

A `$ref` is a URI reference resolved against the base URI of the schema it sits in: the nearest `$id`
above it (draft 4's `id`), else the document's. Targets are JSON pointers (`#/$defs/a`), anchors
(`#name`: `$anchor`, or draft 6/7's `$id: "#name"`), or whole resources named by their `$id` anywhere in
the document (an embedded or bundled schema: `"$defs": {"b": {"$id": "http://example.com/b.json", ...}}`),
including URNs. Nothing is fetched: a URI that no `$id` of the document names does not resolve, unless
it names a document registered beforehand (register_documents: a directory of schemas, each under its
`$id`, and optionally under a base URI + its path; the engine option json_schema_documents).

The converter resolves refs in many places (rules, allOf merges, oneOf checks) where the base URI of
the schema at hand is no longer known, so the document is copied once with every `$ref` made absolute;
after that a ref resolves the same wherever it is looked up.

`$dynamicRef` (draft 2020-12) resolves through the dynamic scope: when its static target carries a
`$dynamicAnchor` of the fragment's name, the outermost resource of the scope with that dynamic anchor
wins. The scope always starts at the root, so the answer does not depend on the path when the root
defines that dynamic anchor (the root's wins) or when one resource alone does (the static target's):
such refs are rewritten as plain `$ref`s here. Others depend on the path the evaluation took and are
left for the converter to refuse with their pointer.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any
from urllib.parse import urldefrag, urljoin, urlsplit

import referencing.jsonschema as rj
from referencing import Registry
from referencing.exceptions import Unresolvable

from radixlm.core.runtime.constrained.schema.json_common import IGNORED_BESIDE_REF


@functools.lru_cache(maxsize=4096)  # (a large document repeats the same refs thousands of times)
def _join(base: str, ref: str) -> str:
    # urljoin drops the base of non-hierarchical URIs (urn:...) for a fragment-only reference.
    return urldefrag(base)[0] + ref if ref.startswith("#") else urljoin(base, ref)


def _copy(node: Any) -> Any:
    """A copy of a JSON document's objects and arrays (what _absolutize rewrites); several times faster
    than copy.deepcopy, which a large schema's compile felt."""
    if isinstance(node, dict):
        return {k: _copy(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_copy(v) for v in node]
    return node


def _specification(schema: Any, default: rj.Specification) -> rj.Specification:
    dialect = schema.get("$schema") if isinstance(schema, dict) else None
    if not isinstance(dialect, str):
        return default
    try:
        return rj.specification_with(dialect, default=default)
    except rj.UnknownDialect:
        return default


def _absolutize(node: Any, spec: rj.Specification, base: str, dynamic: list, anchors: set, scopes: list) -> None:
    """Rewrites, in place, every `$ref` and `$dynamicRef` under `node` (a schema) as an absolute URI
    reference; collects the nodes with a `$dynamicRef`, the (resource, name) of `$dynamicAnchor`s and the
    nodes that name a base URI or an anchor (`scopes`)."""
    if not isinstance(node, dict):
        return
    if _names_anchor(node) or isinstance(node.get("$id", node.get("id")), str):
        scopes.append(node)
    spec = _specification(node, spec)
    found = spec.id_of(node)
    if isinstance(found, str):
        base = _join(base, found)
    for key in ("$ref", "$dynamicRef"):
        if isinstance(node.get(key), str):
            node[key] = _join(base, node[key])
    if isinstance(node.get("$dynamicRef"), str):
        dynamic.append(node)
    if isinstance(node.get("$dynamicAnchor"), str):
        anchors.add((urldefrag(base)[0], node["$dynamicAnchor"]))
    for sub in spec.subresources_of(node):
        _absolutize(sub, spec, base, dynamic, anchors, scopes)
    if "$ref" in node and spec in _REF_ALONE:  # its siblings moved where no keyword reads them
        ignored = {k: node.pop(k) for k in list(node) if k not in _KEPT_BESIDE_REF}
        if ignored:
            node[IGNORED_BESIDE_REF] = ignored


def _names_anchor(node: dict) -> bool:
    """Whether a schema names an anchor (`$anchor`, `$dynamicAnchor`, `$recursiveAnchor`, or drafts 6-7's
    `$id: "#name"`, draft 4's `id: "#name"`)."""
    ident = node.get("$id", node.get("id"))
    return any(k in node for k in _ANCHOR_KEYS) or isinstance(ident, str) and ident.startswith("#")


_ANCHOR_KEYS = ("$anchor", "$dynamicAnchor", "$recursiveAnchor")
# Drafts 3-7: "All other properties in a "$ref" object MUST be ignored" (as jsonschema's validators for
# them do); from 2019-09 on, a $ref's siblings apply beside it.
_REF_ALONE = (rj.DRAFT3, rj.DRAFT4, rj.DRAFT6, rj.DRAFT7)
_KEPT_BESIDE_REF = {"$ref", "definitions", "$defs", "$schema", "$comment", "$id", "id"}


# Documents any schema's refs may name (register_documents), with their refs made absolute, crawled once.
_registered = Registry()


def register_documents(directory: str | Path, base_uri: str | None = None) -> int:
    """Makes the JSON schemas under `directory` (*.json, recursively) resolvable by `$ref` from every
    schema converted after this in the process: each under its `$id` where it has an absolute one, and,
    with `base_uri`, under base_uri + its path relative to the directory (the layout a schema server
    gives them). Returns how many documents were registered; ValueError for a file that is not JSON."""
    global _registered
    root = Path(directory)
    if not root.is_dir():
        raise ValueError(f"schema documents: {str(root)!r} is not a directory")
    found = {}
    for path in sorted(root.rglob("*.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"schema documents: {path}: {e}") from None
        spec = _specification(doc, rj.DRAFT202012)
        own = spec.id_of(doc) if isinstance(doc, dict) else None
        uris = [u for u in (own if isinstance(own, str) and urlsplit(own).scheme else None,
                            base_uri and urljoin(base_uri, path.relative_to(root).as_posix())) if u]
        for uri in uris:
            doc_copy = _copy(doc)
            _absolutize(doc_copy, spec, uri, [], set(), [])
            found[urldefrag(uri)[0]] = spec.create_resource(doc_copy)
    _registered = _registered.with_resources(found.items()).crawl()
    return len(found)


class SchemaRefs:
    """A schema document with its refs made absolute, and the registry of its resources (and of the
    registered documents)."""

    def __init__(self, schema: Any) -> None:
        self.root = _copy(schema)
        spec = _specification(self.root, rj.DRAFT202012)
        dynamic: list[dict] = []
        anchors: set[tuple[str, str]] = set()
        scopes: list[dict] = []
        _absolutize(self.root, spec, "", dynamic, anchors, scopes)
        resource = spec.create_resource(self.root)
        registry = _registered.with_resource(resource.id() or "", resource)
        # A crawl registers the document's embedded resources and anchors. With none (the root's own base
        # URI aside) lookups find the root as it is (a lookup of anything else crawls then): a large
        # document's crawl walked it all again, 2-5 ms.
        if any(node is not self.root or _names_anchor(node) for node in scopes):
            registry = registry.crawl()
        self._resolver = registry.resolver()
        root = self._root = urldefrag(resource.id() or "")[0]
        self._resolved: dict[str, Any] = {}  # (a large schema's merges and rules look each ref up many times)
        for node in dynamic:
            self._static_dynamic_ref(node, root, anchors)

    def _static_dynamic_ref(self, node: dict, root: str, anchors: set[tuple[str, str]]) -> None:
        """Rewrites the node's `$dynamicRef` as a `$ref` where the dynamic scope cannot change its target."""
        if "$ref" in node:
            return
        ref = node["$dynamicRef"]
        base, name = urldefrag(ref)
        try:
            self._resolver.lookup(ref)
        except Unresolvable:
            return  # the converter reports the ref
        holders = {b for b, n in anchors if n == name}
        if (base, name) not in anchors or holders == {base}:
            node["$ref"] = ref  # the static target: a plain anchor or pointer, or the only such anchor
        elif root in holders:
            node["$ref"] = f"{root}#{name}"  # the root starts every dynamic scope
        else:
            return
        del node["$dynamicRef"]

    def resolve(self, ref: str) -> Any:
        """The schema an absolute `$ref` (as in self.root) points to; ValueError if nothing does."""
        found = self._resolved.get(ref, self._resolved)
        if found is not self._resolved:
            return found
        # A ref under a key no keyword names (so not made absolute) starts with "#": the root's base.
        uri = self._root + ref if ref.startswith("#") else ref
        try:
            found = self._resolved[ref] = self._resolver.lookup(uri).contents
            return found
        except Unresolvable:
            raise ValueError(f"$ref {ref!r} does not resolve (refs are resolved within the document and the "
                             f"registered documents: bundle other schemas into it under an $id, or register "
                             f"them: the engine option json_schema_documents)") from None
