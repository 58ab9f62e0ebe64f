"""Numbers and integers: bounds (number_ranges.py) and multipleOf (a mixin of json_grammar._Converter)."""

from __future__ import annotations

import fractions
import functools
from typing import Any

import numpy as np

from radixlm.core.runtime.constrained.schema import number_ranges
from radixlm.core.runtime.constrained.automata.grammar import Expr, Terminal, lit
from radixlm.core.runtime.constrained.automata.grammar_compiler import terminal_dfa
from radixlm.core.runtime.constrained.schema.json_common import INTEGER, NOT_MULTIPLE_OF, NOTHING, NUMBER, SchemaError
from radixlm.core.runtime.constrained.automata.dfa_product import dfa_intersection
from radixlm.core.runtime.constrained.automata.regex_dfa import ByteDFA


MAX_MODULUS = 10_000  # multipleOf's DFA has a state per remainder
EXACT_INTEGER = 10**15 - 1  # a `not` of a fractional multipleOf: integers of at most 15 digits (see _integer)


class NumberRules:
    """The `integer` and `number` types' rules."""

    def _integer(self, schema: dict, ptr: str) -> Expr:
        step = schema.get("multipleOf", 1)
        if isinstance(step, bool) or not isinstance(step, (int, float)) or step <= 0:
            raise SchemaError(f"{ptr}/multipleOf: must be a positive number")
        # An integer is a multiple of p/q (in lowest terms, from the decimal as written: 1.5 is 3/2)
        # exactly when p divides it.
        step = fractions.Fraction(repr(step)).numerator
        avoid = schema.get(NOT_MULTIPLE_OF)  # a `not` of multipleOf: integers that p does not divide
        try:
            lo, hi = number_ranges.int_bounds(schema)
        except ValueError as e:
            raise SchemaError(f"{ptr}: {e}") from None
        if lo is not None and hi is not None and lo > hi:
            return NOTHING
        if step > MAX_MODULUS:  # past the DFA's budget: 0 alone, a multiple of everything (a sound subset)
            zero = (lo is None or lo <= 0) and (hi is None or hi >= 0) and avoid is None
            return lit("0") if zero else NOTHING
        if int(step) == 1 and avoid is None:
            whole = number_ranges.int_range_regex(lo, hi) if lo is not None or hi is not None else None
            return INTEGER if whole is None else Terminal(regex=f"(?:{whole})")
        budget = self.budget.max_terminal_states
        dfas = [multiples_dfa(int(step))] if int(step) > 1 else []
        if avoid is not None:
            dfas.append(non_multiples_dfa(int(avoid[0])))
            if avoid[1] > 1:  # validators divide doubles: n / 1.5 is exact only for fewer digits than a double has
                dfas.append(terminal_dfa(f"(?:{number_ranges.int_range_regex(-EXACT_INTEGER, EXACT_INTEGER)})", budget))
        if lo is not None or hi is not None:
            dfas.append(terminal_dfa(f"(?:{number_ranges.int_range_regex(lo, hi)})", budget))
        dfa = dfas[0]
        for other in dfas[1:]:
            dfa = dfa_intersection(dfa, other, budget, self.deadline.check) if dfa is not None else None
        key = f"multiples:{int(step)}:{lo}:{hi}" + ("" if avoid is None else f":not:{avoid[0]}/{avoid[1]}")
        return NOTHING if dfa is None else Terminal(key=key, dfa=dfa)

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


@functools.lru_cache(maxsize=64)
def non_multiples_dfa(m: int) -> ByteDFA:
    """JSON integers that m (>= 2) does not divide: multiples_dfa's states, accepting where the remainder
    is not 0 (0 and -0 lead nowhere)."""
    multiples = multiples_dfa(m)
    trans = multiples.transitions.copy()
    trans[trans == 2] = -1  # the state after a leading 0: a multiple of everything
    accepting = np.zeros(len(trans), dtype=bool)
    accepting[4:] = True  # remainders 1 .. m-1 (state 3 + r)
    return ByteDFA(transitions=trans, accepting=accepting)
