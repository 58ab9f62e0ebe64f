"""Numbers and integers: bounds (number_ranges.py) and multipleOf (a mixin of json_grammar._Converter)."""

from __future__ import annotations

import fractions
import functools
from typing import Any

import numpy as np

from radixlm.core.runtime.constrained.schema import number_ranges
from radixlm.core.runtime.constrained.automata.grammar import Expr, Terminal, lit
from radixlm.core.runtime.constrained.automata.grammar_compiler import terminal_dfa
from radixlm.core.runtime.constrained.schema.json_common import INTEGER, NOTHING, NUMBER, SchemaError
from radixlm.core.runtime.constrained.automata.regex_dfa import ByteDFA, dfa_intersection


MAX_MODULUS = 10_000  # multipleOf's DFA has a state per remainder


class NumberRules:
    """The `integer` and `number` types' rules."""

    def _integer(self, schema: dict, ptr: str) -> Expr:
        step = schema.get("multipleOf", 1)
        if isinstance(step, bool) or not isinstance(step, (int, float)) or step <= 0:
            raise SchemaError(f"{ptr}/multipleOf: must be a positive number")
        # An integer is a multiple of p/q (in lowest terms, from the decimal as written: 1.5 is 3/2)
        # exactly when p divides it.
        step = fractions.Fraction(repr(step)).numerator
        try:
            lo, hi = number_ranges.int_bounds(schema)
        except ValueError as e:
            raise SchemaError(f"{ptr}: {e}") from None
        if lo is not None and hi is not None and lo > hi:
            return NOTHING
        if step > MAX_MODULUS:  # past the DFA's budget: 0 alone, a multiple of everything (a sound subset)
            return lit("0") if (lo is None or lo <= 0) and (hi is None or hi >= 0) else NOTHING
        if int(step) == 1:
            return INTEGER if lo is None and hi is None else Terminal(regex=f"(?:{number_ranges.int_range_regex(lo, hi)})")
        dfa = multiples_dfa(int(step))
        if lo is not None or hi is not None:
            budget = self.budget.max_terminal_states
            bounds = terminal_dfa(f"(?:{number_ranges.int_range_regex(lo, hi)})", budget)
            dfa = dfa_intersection(dfa, bounds, budget, self.deadline.check)
        return NOTHING if dfa is None else Terminal(key=f"multiples:{int(step)}:{lo}:{hi}", dfa=dfa)

    def _number(self, schema: dict, ptr: str, fraction: bool = False) -> Expr:
        """Numbers within the bounds (any decimal bound, exclusive or not); with `fraction`, only those
        that are not integers."""
        # Multiples of a whole number are integers; of p/q, the integer ones are generated (a sound subset).
        if "multipleOf" in schema:
            return NOTHING if fraction else self._integer(schema, ptr)
        lower = self._bound(schema, "minimum", "exclusiveMinimum", max, ptr)
        upper = self._bound(schema, "maximum", "exclusiveMaximum", min, ptr)
        try:
            sides = [number_ranges.above(*lower)] if lower else []
            sides += [number_ranges.below(*upper)] if upper else []
        except ValueError as e:
            raise SchemaError(f"{ptr}: {e}") from None
        sides += [number_ranges.FRACTIONAL] if fraction else []
        if fraction or any(b and (not b[1] or b[0] != int(b[0])) for b in (lower, upper)):
            sides.append(number_ranges.ROUND_TRIP)
        if not sides:
            return NUMBER
        if len(sides) == 1:
            return Terminal(regex=sides[0])
        budget = self.budget.max_terminal_states
        dfa = terminal_dfa(sides[0], budget)
        for side in sides[1:]:
            if dfa is not None:
                dfa = dfa_intersection(dfa, terminal_dfa(side, budget), budget, self.deadline.check)
        return NOTHING if dfa is None else Terminal(key=f"number:{lower}:{upper}:{fraction}", dfa=dfa)

    @staticmethod
    def _bound(schema: dict, inclusive: str, exclusive: str, tighter, ptr: str) -> tuple[Any, bool] | None:
        """(the tighter of the two bounds, whether it is inclusive), or None if neither is given."""
        found = []
        for key, closed in ((inclusive, True), (exclusive, False)):
            if key in schema:
                value = schema[key]
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise SchemaError(f"{ptr}/{key}: must be a number (draft 4's boolean form is not supported)")
                found.append((value, closed))
        if not found:
            return None
        best = tighter(v for v, _ in found)
        return best, all(closed for v, closed in found if v == best)  # an equal exclusive bound wins


@functools.lru_cache(maxsize=64)
def multiples_dfa(m: int) -> ByteDFA:
    """JSON integers that are multiples of m: a state per remainder of the digits read so far."""
    start, minus, zero, rem = 0, 1, 2, 3  # rem + r: a nonzero start, remainder r
    trans = np.full((rem + m, 256), -1, dtype=np.int32)
    digits = np.arange(ord("0"), ord("9") + 1)
    trans[start, ord("-")] = minus
    for s in (start, minus):
        trans[s, ord("0")] = zero
        trans[s, digits[1:]] = rem + np.arange(1, 10) % m
    trans[rem:, digits] = rem + (10 * np.arange(m)[:, None] + np.arange(10)[None, :]) % m
    accepting = np.zeros(rem + m, dtype=bool)
    accepting[[zero, rem]] = True
    return ByteDFA(transitions=trans, accepting=accepting)
