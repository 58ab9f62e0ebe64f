"""A Grammar written out as one Python regex, for callers whose transport carries only a regex (the DSPy
adapter's chat format, which embeds JSON values in a larger pattern, sent to a server).

Rules are inlined where they are referred to; a rule may appear at most `max_depth` times on the way
down, and a reference past that admits nothing (recursive rules are cut at a depth, as a regex must).
A terminal is written as its regex (`Terminal.regex`); one given only as a ready DFA is written by state
elimination when it reads ASCII bytes alone and is small (numbers within bounds), else has no regex form.
The regex grows with every inlining (a rule referred to twice is written twice): meant for the small
grammars of field values, not for whole documents, which the grammar engine runs as grammars.
"""

from __future__ import annotations

import re

from radixlm.core.runtime.constrained.automata.grammar import Alt, Expr, Grammar, Ref, Repeat, Seq, Terminal
from radixlm.core.runtime.constrained.automata.regex_dfa import ByteDFA

DEFAULT_MAX_DEPTH = 3
DEFAULT_MAX_LENGTH = 1 << 17  # characters: past this the regex is refused (recursion that branches)
MAX_DFA_STATES = 64  # a DFA-only terminal written by state elimination: at most this many states


def grammar_to_regex(grammar: Grammar, max_depth: int = DEFAULT_MAX_DEPTH,
                     max_length: int = DEFAULT_MAX_LENGTH) -> str:
    """One regex whose full matches are the grammar's outputs (rules past `max_depth` on a path cut).
    ValueError when a terminal has no regex form, when the regex would pass `max_length` characters, or
    when nothing is left to match."""
    if max_depth < 1:
        raise ValueError("max_depth must be at least 1")
    out = _Writer(grammar, max_depth, max_length).write(Ref(grammar.start))
    if out is None:
        raise ValueError("the grammar admits no output within the recursion depth")
    try:
        re.compile(out)
    except re.error as e:  # a terminal's regex that does not nest (global flags, say)
        raise ValueError(f"the grammar's regex does not compile: {e}") from None
    return out


class _Writer:
    """Writes expressions of one grammar; `on_path` counts the rules being inlined."""

    def __init__(self, grammar: Grammar, max_depth: int, max_length: int) -> None:
        self.grammar = grammar
        self.max_depth = max_depth
        self.max_length = max_length
        self.on_path: dict[str, int] = {}

    def write(self, expr: Expr) -> str | None:
        """The regex of `expr`, or None where it admits nothing."""
        out = self._expr(expr)
        if out is not None and len(out) > self.max_length:
            raise ValueError(f"the grammar's regex passes {self.max_length} characters "
                             f"(rules inlined up to {self.max_depth} times on a path)")
        return out

    def _expr(self, expr: Expr) -> str | None:
        if isinstance(expr, Terminal):
            if expr.regex is not None:
                return f"(?:{expr.regex})"
            dfa = expr.dfa
            if dfa is None or dfa.num_states > MAX_DFA_STATES or (dfa.transitions[:, 0x80:] >= 0).any():
                raise ValueError(f"terminal {expr.ident!r} has no regex form")
            return _dfa_regex(dfa)
        if isinstance(expr, Ref):
            depth = self.on_path.get(expr.rule, 0)
            if depth >= self.max_depth:
                return None
            self.on_path[expr.rule] = depth + 1
            try:
                return self.write(self.grammar.rules[expr.rule])
            finally:
                self.on_path[expr.rule] = depth
        if isinstance(expr, Seq):
            parts = [self.write(item) for item in expr.items]
            return None if any(p is None for p in parts) else "".join(parts)
        if isinstance(expr, Alt):
            parts = list(dict.fromkeys(p for p in map(self.write, expr.items) if p is not None))
            return None if not parts else parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"
        if isinstance(expr, Repeat):
            item = self.write(expr.item)
            if item is None or expr.hi == 0:
                return "" if expr.lo == 0 else None
            return f"(?:{item}){{{expr.lo},{'' if expr.hi is None else expr.hi}}}"
        raise TypeError(f"not a grammar expression: {expr!r}")


def _dfa_regex(dfa: ByteDFA) -> str | None:
    """The language of an ASCII-only DFA as a regex, by state elimination (the state with the fewest
    paths through it first); None when it is empty."""
    n = dfa.num_states
    start, end = n, n + 1  # a new start state, and one accepting state reached by the empty string
    edges: dict[tuple[int, int], str] = {(start, 0): ""}
    for p in range(n):
        targets: dict[int, list[int]] = {}
        for b in range(0x80):
            q = int(dfa.transitions[p, b])
            if q >= 0:
                targets.setdefault(q, []).append(b)
        for q, data in targets.items():
            edges[p, q] = _char_class(data)
        if dfa.accepting[p]:
            edges[p, end] = ""
    left = set(range(n))
    while left:
        k = min(left, key=lambda s: sum(1 for (a, b) in edges if a == s) * sum(1 for (a, b) in edges if b == s))
        left.discard(k)
        loop = edges.pop((k, k), None)
        ins = [(a, r) for (a, b), r in edges.items() if b == k]
        outs = [(b, r) for (a, b), r in edges.items() if a == k]
        for a, _ in ins:
            del edges[a, k]
        for b, _ in outs:
            del edges[k, b]
        middle = f"(?:{loop})*" if loop else ""
        for a, r_in in ins:
            for b, r_out in outs:
                path = f"{r_in}{middle}{r_out}"
                old = edges.get((a, b))
                edges[a, b] = path if old is None or old == path else f"(?:{old}|{path})"
    found = edges.get((start, end))
    return None if found is None else f"(?:{found})"


def _char_class(data: list[int]) -> str:
    """One regex item for the sorted ASCII bytes `data`."""
    if len(data) == 1:
        return re.escape(chr(data[0]))
    runs: list[list[int]] = []
    for b in data:
        if runs and b == runs[-1][1] + 1:
            runs[-1][1] = b
        else:
            runs.append([b, b])
    return "[" + "".join(f"\\x{lo:02x}" if lo == hi else f"\\x{lo:02x}-\\x{hi:02x}" for lo, hi in runs) + "]"
