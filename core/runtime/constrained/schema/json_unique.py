"""uniqueItems: arrays whose items are pairwise distinct, as far as a grammar can say it (a mixin of
json_grammar._Converter).

A grammar cannot compare two items of any shape, so the items are split into classes no two of whose
members are equal, and each class is used at most once:
- items drawn from a few constants (enum, const, boolean, null; MAX_UNIQUE_ANY_ORDER at most): each
  constant is a class, in any order (a rule per set of constants used);
- more constants than that (MAX_UNIQUE_ASCENDING at most), with no prefixItems: the constants in the
  order the schema lists them (distinct, though other orders are not generated);
- otherwise the JSON kinds: null, true, false, a number, a string, an object, an array (at most one of
  each: [1, "a", true] is generated, [1, 2] is not), where the item schemas hold no `$ref`; with refs,
  at most one item.
Every output is valid (sound); valid arrays outside these shapes are not generated (docs/constrained.md).
"""

from __future__ import annotations

import json
from typing import Any, Callable

from radixlm.core.runtime.constrained.automata.grammar import EMPTY, Expr, Ref, alt, seq
from radixlm.core.runtime.constrained.schema.json_common import NOTHING, SchemaError, json_type

MAX_UNIQUE_ANY_ORDER = 6  # constants taken in any order: a rule per subset (2**n per position)
MAX_UNIQUE_ASCENDING = 64  # constants taken in their order: n**2 alternatives in all
_KINDS = (("null", {"type": "null"}), ("true", {"const": True}), ("false", {"const": False}),
          ("number", {"type": "number"}), ("string", {"type": "string"}), ("object", {"type": "object"}),
          ("array", {"type": "array"}))


class UniqueRules:
    """uniqueItems (_unique)."""

    def _unique(self, prefix: list, items: Any, lo: int, hi: int | None, ptr: str) -> Expr | None:
        """`[` lo..hi pairwise distinct items `]`: prefix items first, then `items`; None where the items
        refer to other schemas and are not constants (split by kind, a recursive schema would be
        inlined without end)."""
        schemas = [*prefix, items]
        finite = [self._constants(s) for s in schemas]
        if all(f is not None for f in finite):
            keys = list(dict.fromkeys(k for f in finite for k, _ in f))
            if not prefix and MAX_UNIQUE_ANY_ORDER < len(keys) <= MAX_UNIQUE_ASCENDING:
                return self._ascending([e for _, e in finite[0]], lo, hi, ptr)
            if len(keys) <= MAX_UNIQUE_ANY_ORDER:
                classes = [{keys.index(k): e for k, e in f} for f in finite]
                return self._distinct(classes, len(prefix), lo, hi, ptr)
        if any(word in json.dumps(schemas, default=str) for word in ('"$ref"', '"$dynamicRef"')):
            return None
        classes, refused = [], False
        for i, s in enumerate(schemas):
            where = f"{ptr}/prefixItems/{i}" if i < len(prefix) else f"{ptr}/items"
            kinds = {}
            for k, (_, kind) in enumerate(_KINDS):
                # (a kind may leave a oneOf no branch, which is refused: that kind has no items then)
                expr = self._attempt({"allOf": [s, kind]}, where) if s is not False else NOTHING
                refused |= isinstance(expr, SchemaError)
                if not isinstance(expr, SchemaError) and expr != NOTHING:
                    kinds[k] = self._shared(expr, where)
            classes.append(kinds)
        if refused and not any(classes):
            return None  # the caller converts the items as they are and reports what it refuses
        return self._distinct(classes, len(prefix), lo, hi, ptr)

    def _constants(self, schema: Any) -> list[tuple[str, Expr]] | None:
        """(a key equal constants share, its expression) for each value of a schema of finitely many
        constants (enum, const, boolean, null), or None."""
        schema, _ = self._deref(schema, ())
        if schema is False:
            return []
        if not isinstance(schema, dict):
            return None
        values = [schema["const"]] if "const" in schema else schema.get("enum")
        if values is None and schema.get("type") in ("boolean", "null") and set(schema) <= {"type"}:
            values = [True, False] if schema["type"] == "boolean" else [None]
        if not isinstance(values, list) or any(isinstance(v, (dict, list)) for v in values):
            return None  # (objects and arrays: equal ones may be written in other key orders)
        out = []
        for v in values:
            expr = self._literal(v, schema, "#")
            if expr != NOTHING:  # 1 and 1.0 are one constant to JSON Schema
                key = json.dumps(int(v) if json_type(v) == "integer" and not isinstance(v, bool) else v)
                out.append((key, expr))
        return out

    def _distinct(self, classes: list[dict[int, Expr]], n_prefix: int, lo: int, hi: int | None, ptr: str) -> Expr:
        """Items from classes[min(position, n_prefix)], each class (an int) used at most once. Rule
        (position, used) is the rest of the array after `position` items from the classes in `used`."""
        most = len(set().union(*classes))  # never more items than classes
        if lo > most:
            raise SchemaError(f"{ptr}/uniqueItems: minItems {lo} with uniqueItems is past the {most} distinct items "
                              "generated (docs/constrained.md, uniqueItems)")
        return self._array_rules("unique", ptr, lo, hi, lambda pos, used: f"{pos}/{used}", lambda pos, used: [
            (expr, used | 1 << c) for c, expr in classes[min(pos, n_prefix)].items() if not used >> c & 1])

    def _ascending(self, constants: list[Expr], lo: int, hi: int | None, ptr: str) -> Expr:
        """Items from `constants` in their order, each after the previous one (so all distinct)."""
        if lo > len(constants):
            raise SchemaError(f"{ptr}/uniqueItems: minItems {lo} is more than the {len(constants)} distinct values")
        # (without maxItems only whether the comma and the end are allowed tells positions apart)
        if hi is None:
            key = lambda pos, after: f"{min(pos, max(lo, 1))}/{after}"  # noqa: E731
        else:
            key = lambda pos, after: f"{pos}/{after}"  # noqa: E731
        return self._array_rules("ascending", ptr, lo, hi, key, lambda pos, after: [
            (constants[j], j + 1) for j in range(after, len(constants))])

    def _array_rules(self, kind: str, ptr: str, lo: int, hi: int | None, key: Callable[[int, int], str],
                     steps: Callable[[int, int], list[tuple[Expr, int]]]) -> Expr:
        """`[` lo..hi items `]` where, after `pos` items in state `state`, steps(pos, state) gives each
        allowed next item with the state after it; one rule per key(pos, state), made on first use."""
        base = f"{ptr}@{kind}{len(self.rules)}"

        def rest(pos: int, state: int) -> Expr:
            name = f"{base}/{key(pos, state)}"
            if name in self.rules:
                return Ref(name)
            self.rules[name] = NOTHING
            comma = self._punct(",") if pos else EMPTY
            options = [EMPTY] if pos >= lo else []
            if hi is None or pos < hi:
                options += [seq(comma, expr, rest(pos + 1, after)) for expr, after in steps(pos, state)]
            self.rules[name] = alt(*options)
            return Ref(name)

        try:
            return seq(self._punct("["), rest(0, 0), self._punct("]"))
        finally:
            del rest  # as in json_objects._any_order: no cycle left through the closure
