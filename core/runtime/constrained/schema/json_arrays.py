"""Arrays: items, prefixItems, min/maxItems, contains, uniqueItems (a mixin of json_grammar._Converter)."""

from __future__ import annotations

from typing import Any

from radixlm.core.runtime.constrained.automata.grammar import EMPTY, Expr, Ref, Repeat, alt, opt, seq
from radixlm.core.runtime.constrained.schema.json_common import NOTHING, SchemaError, count_bounds


MAX_COUNTED_RULES = 1024  # contains with counts: a rule per (items so far, matches so far)


class ArrayRules:
    """The `array` type's rules."""

    def _array(self, schema: dict, ptr: str) -> Expr:
        lo, hi = count_bounds(schema, "minItems", "maxItems", ptr)
        # Items past the prefix that `items` does not cover are the unevaluated ones.
        items, prefix = schema.get("items", schema.get("unevaluatedItems", True)), schema.get("prefixItems")
        if "contains" in schema and "items" not in schema and schema.get("unevaluatedItems", True) is not True:
            items = {"anyOf": [schema["contains"], items]}  # an item `contains` matches is evaluated
        if isinstance(items, list):  # draft 4-2019 tuple form
            prefix, items = items, schema.get("additionalItems", True)
        if schema.get("uniqueItems") is True:
            unique = self._unique(prefix or [], items, lo, hi, ptr) if "contains" not in schema else None
            if unique is not None:
                return unique
            if lo > 1:  # else arrays of at most one item (sound)
                raise SchemaError(f"{ptr}/uniqueItems: uniqueItems with minItems > 1 is not supported here "
                                  "(items that refer to other schemas, or contains)")
            hi = 1 if hi is None else min(hi, 1)
        if "contains" in schema:
            contains_lo, contains_hi = count_bounds(schema, "minContains", "maxContains", ptr)
            if "minContains" not in schema:
                contains_lo = 1
            if contains_lo or contains_hi is not None:
                return self._contains(schema, items, prefix, lo, hi, contains_lo, contains_hi, ptr)
        parts = [self._shared(self.value(p, f"{ptr}/prefixItems/{i}"), f"{ptr}/prefixItems/{i}")
                 for i, p in enumerate(prefix or [])]
        rest = self._shared(self.value(items, f"{ptr}/items"), f"{ptr}/items") if items is not False else NOTHING
        return self._items(parts, rest, lo, hi)

    def _items(self, parts: list[Expr], rest: Expr, lo: int, hi: int | None) -> Expr:
        """`[`, the prefix items `parts`, then `rest` items, lo..hi in all, `]`."""
        if parts:
            body = self._prefix_body(parts, rest, lo, hi)
        elif hi is not None and hi < max(lo, 1):
            body = EMPTY if lo == 0 else NOTHING
        else:
            more = Repeat(seq(self._punct(","), rest), max(lo - 1, 0), None if hi is None else hi - 1)
            body = seq(rest, more) if lo else opt(seq(rest, more))
        return seq(self._punct("["), body, self._punct("]"))

    def _contains(self, schema: dict, items: Any, prefix: Any, lo: int, hi: int | None, contains_lo: int,
                  contains_hi: int | None, ptr: str) -> Expr:
        """Arrays with contains_lo..contains_hi items valid under `contains`. Unbounded: [item, ...,
        match, item, ..., match, item, ...] (contains_lo matches, any items around them); otherwise
        (maxContains, maxItems, minItems > 1, prefixItems) counted (_counted); where that is too large or
        `not` cannot express the items failing `contains`, every item matches and the length stays
        within both ranges (a sound subset)."""
        match_ptr = f"{ptr}/contains"
        if not prefix and hi is None and lo <= contains_lo and contains_hi is None:
            item = self._shared(self.value(items, f"{ptr}/items"), f"{ptr}/items")
            match = self._shared(self.value({"allOf": [items, schema["contains"]]}, match_ptr), match_ptr)
            comma = self._punct(",")
            others = Repeat(seq(comma, item))  # any items between and after the matches
            matches = seq(match, others, Repeat(seq(comma, match, others), contains_lo - 1, contains_lo - 1))
            return seq(self._punct("["), Repeat(seq(item, comma)), matches, self._punct("]"))
        counted = self._counted(schema["contains"], items, prefix or [], lo, hi, contains_lo, contains_hi, ptr)
        if counted is not None:
            return counted
        lo = max(lo, contains_lo)
        hi = contains_hi if hi is None else hi if contains_hi is None else min(hi, contains_hi)
        if hi is not None and hi < lo:
            return NOTHING
        parts = [self._shared(self.value({"allOf": [p, schema["contains"]]}, f"{ptr}/prefixItems/{i}"),
                              f"{ptr}/prefixItems/{i}") for i, p in enumerate(prefix or [])]
        rest = self._shared(self.value({"allOf": [items, schema["contains"]]}, match_ptr), match_ptr) \
            if items is not False else NOTHING
        return self._items(parts, rest, lo, hi)

    def _counted(self, contains: Any, items: Any, prefix: list, lo: int, hi: int | None, contains_lo: int,
                 contains_hi: int | None, ptr: str) -> Expr | None:
        """Arrays of lo..hi items, contains_lo..contains_hi of them matching `contains`: each item either
        matches or (with maxContains) fails it, counted by rules (items so far, matches so far). None
        where that takes more than MAX_COUNTED_RULES rules or `not` cannot express the failing items."""
        top = max(len(prefix), lo, hi or 0, 1)  # items counted up to here (past it: more of the same)
        cap = contains_lo if contains_hi is None else contains_hi
        if (top + 1) * (cap + 1) > MAX_COUNTED_RULES:
            return None
        kinds = []  # per position (the prefix's, then `items`'s): (matching, the others)
        for i, sub in enumerate([*prefix, items]):
            where = f"{ptr}/prefixItems/{i}" if i < len(prefix) else f"{ptr}/items"
            match = self._attempt({"allOf": [sub, contains]}, f"{ptr}/contains")
            other = self._attempt({"allOf": [sub, {"not": contains}]}, where) if contains_hi is not None \
                else self.value(sub, where)
            if isinstance(match, SchemaError) or isinstance(other, SchemaError):
                return None  # (a sound subset remains: every item matching)
            kinds.append((self._shared(match, f"{ptr}/contains"), self._shared(other, where)))
        base = f"{ptr}@contains{len(self.rules)}"

        def rest(n: int, m: int) -> Expr:
            name = f"{base}/{n}/{m}"
            if name not in self.rules:
                self.rules[name] = NOTHING
                match, other = kinds[min(n, len(prefix))]
                comma = self._punct(",") if n else EMPTY
                nxt = min(n + 1, top)
                more = NOTHING
                if hi is None or n < hi:
                    counted = min(m + 1, cap) if contains_hi is None else m + 1
                    more = alt(seq(comma, match, rest(nxt, counted)) if counted <= cap else NOTHING,
                               seq(comma, other, rest(nxt, m)))
                self.rules[name] = alt(EMPTY, more) if n >= lo and m >= contains_lo else more
            return Ref(name)

        try:
            return seq(self._punct("["), rest(0, 0), self._punct("]"))
        finally:
            del rest  # as in json_objects._any_order: no cycle left through the closure

    def _prefix_body(self, parts: list[Expr], rest: Expr, lo: int, hi: int | None) -> Expr:
        comma = self._punct(",")
        n = len(parts)
        if hi is not None and hi < n:
            parts = parts[:hi]
            n = hi
        more_lo = max(lo - n, 0)
        more_hi = None if hi is None else hi - n
        more = EMPTY if rest is NOTHING or more_hi == 0 else Repeat(seq(comma, rest), more_lo, more_hi)
        if more is EMPTY and more_lo > 0:
            return NOTHING
        body = more
        for j in range(n - 1, -1, -1):
            item = seq(comma, parts[j]) if j else parts[j]
            body = seq(item, body)
            if j >= lo:  # j items are enough: the rest may be left out
                body = opt(body)
        return body
