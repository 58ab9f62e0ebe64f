"""Arrays: items, prefixItems, min/maxItems, contains, uniqueItems (a mixin of json_grammar._Converter)."""

from __future__ import annotations

from typing import Any

from radixlm.core.constrained.grammar import EMPTY, Expr, Repeat, opt, seq
from radixlm.core.constrained.json_common import NOTHING, SchemaError, _counts


class ArrayRules:
    """The `array` type's rules."""

    def _array(self, schema: dict, ptr: str) -> Expr:
        lo, hi = _counts(schema, "minItems", "maxItems", ptr)
        # Items past the prefix that `items` does not cover are the unevaluated ones.
        items, prefix = schema.get("items", schema.get("unevaluatedItems", True)), schema.get("prefixItems")
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
            contains_lo, contains_hi = _counts(schema, "minContains", "maxContains", ptr)
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
        match, ..., match, item, ...] (contains_lo matches in a row); otherwise (maxContains, maxItems,
        minItems > 1, prefixItems) every item matches and the length stays within both ranges: a
        sound subset, since telling a non-matching item apart would need the complement of `contains`."""
        match_ptr = f"{ptr}/contains"
        if not prefix and hi is None and lo <= contains_lo and contains_hi is None:
            item = self._shared(self.value(items, f"{ptr}/items"), f"{ptr}/items")
            match = self._shared(self.value({"allOf": [items, schema["contains"]]}, match_ptr), match_ptr)
            comma = self._punct(",")
            matches = seq(match, Repeat(seq(comma, match), contains_lo - 1, contains_lo - 1))
            return seq(self._punct("["), Repeat(seq(item, comma)), matches, Repeat(seq(comma, item)),
                       self._punct("]"))
        lo = max(lo, contains_lo)
        hi = contains_hi if hi is None else hi if contains_hi is None else min(hi, contains_hi)
        if hi is not None and hi < lo:
            return NOTHING
        parts = [self._shared(self.value({"allOf": [p, schema["contains"]]}, f"{ptr}/prefixItems/{i}"),
                              f"{ptr}/prefixItems/{i}") for i, p in enumerate(prefix or [])]
        rest = self._shared(self.value({"allOf": [items, schema["contains"]]}, match_ptr), match_ptr) \
            if items is not False else NOTHING
        return self._items(parts, rest, lo, hi)

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
