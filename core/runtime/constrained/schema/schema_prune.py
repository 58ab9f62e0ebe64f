"""A large schema document cut down to what its root can reach, before `$ref` resolution copies and crawls it.

Real-world documents bundle far more definitions than one schema uses (a Kubernetes schema with the
1.5 MB `_definitions.json` of every API object embedded, say): resolving refs (schema_refs.py) copies
and crawls the whole document, ~0.3 s, where the root reaches a few dozen definitions. Here the root's
`$defs`/`definitions` keep only the entries that local pointer refs (`#/$defs/name/...`), followed from
the root, reach.

Only when that cannot change what any ref means: every ref met is `#` or a JSON pointer, and no schema
met below the root names a base URI or anchor (`$id`, draft 4's `id`, `$anchor`, `$dynamicAnchor`) or
uses a dynamic ref. Otherwise the document is returned unchanged (refs by URI or anchor may reach
anything). Small documents are returned unchanged too: walking them costs more than it saves.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

MIN_PRUNE_KEYS = 256  # definitions below this count are kept as they are
DEFINITIONS = ("$defs", "definitions")
_SCOPE_KEYS = ("$anchor", "$dynamicAnchor", "$dynamicRef", "$recursiveRef", "$recursiveAnchor")


class _Unprunable(Exception):
    """A ref or keyword whose target a pointer walk cannot know: the document stays whole."""


def prune_definitions(schema: Any) -> Any:
    """`schema` with its root definitions limited to those reachable through pointer refs (a shallow copy of
    the root; the definitions themselves are shared, not copied), or `schema` itself (see module doc)."""
    if not isinstance(schema, dict):
        return schema
    tables = {k: schema[k] for k in DEFINITIONS if isinstance(schema.get(k), dict)}
    if sum(map(len, tables.values())) < MIN_PRUNE_KEYS:
        return schema
    kept: dict[str, set[str]] = {k: set() for k in tables}
    pending = [{k: v for k, v in schema.items() if k not in tables and k not in ("$id", "id")}]  # the root's base
    seen: set[str] = set()
    try:
        while pending:
            for ref in _refs(pending.pop()):
                if ref in seen:  # (a large document names each definition many times)
                    continue
                seen.add(ref)
                table, name = _definition_of(ref)
                if table in tables and name not in kept[table] and name in tables[table]:
                    kept[table].add(name)
                    pending.append(tables[table][name])
    except _Unprunable:
        return schema
    if all(len(kept[k]) == len(tables[k]) for k in tables):
        return schema  # every definition is reached
    return dict(schema, **{k: {n: v for n, v in tables[k].items() if n in kept[k]} for k in tables})


def _refs(node: Any) -> list[str]:
    """Every `$ref` string under `node` (data under `const`/`enum` included: a superset is safe); raises
    _Unprunable on a base URI, anchor or dynamic ref."""
    out, stack = [], [node]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if any(k in node for k in _SCOPE_KEYS) or isinstance(node.get("$id"), str) or isinstance(node.get("id"), str):
                raise _Unprunable
            ref = node.get("$ref")
            if isinstance(ref, str):
                out.append(ref)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return out


def _definition_of(ref: str) -> tuple[str | None, str | None]:
    """(`$defs` or `definitions`, entry name) a pointer ref goes through; (None, None) for other pointers
    (the root's own keywords, walked already); _Unprunable for refs that are not pointers."""
    if ref == "#":
        return None, None
    if not ref.startswith("#/"):
        raise _Unprunable
    parts = ref[2:].split("/")
    if parts[0] not in DEFINITIONS:
        return None, None
    if len(parts) < 2:
        raise _Unprunable  # the whole table
    return parts[0], unquote(parts[1]).replace("~1", "/").replace("~0", "~")
