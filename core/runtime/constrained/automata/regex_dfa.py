"""Python regex -> minimal byte-level DFA.

Python's own parser (`re._parser`) reads the pattern, so the syntax and the meaning of every class are
exactly Python's. From the parse tree on everything is ours: a Thompson NFA over UTF-8 bytes, subset
construction over byte equivalence classes, dead-state removal, and Moore partition refinement.

The DFA accepts the UTF-8 encodings of exactly the strings `re.fullmatch(pattern, s)` accepts. Non-greedy
quantifiers accept the same strings as greedy ones. Constructs that are not regular (backreferences,
lookaround, conditionals) or that change the language in ways an automaton cannot follow (possessive
quantifiers, atomic groups, word boundaries, anchors away from the ends) raise ValueError naming them.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from radixlm.core.runtime.constrained.automata import charsets
from radixlm.core.runtime.constrained.automata.dfa_minimize import column_classes, live_states, minimize
from radixlm.core.errors import GrammarBudgetError

try:  # Python >= 3.11
    from re import _constants as sre_c, _parser as sre_p
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as sre_c
    import sre_parse as sre_p

MAX_NFA_STATES = 400_000
MAX_DFA_STATES = 200_000

_POSSESSIVE = getattr(sre_c, "POSSESSIVE_REPEAT", None)
_ATOMIC = getattr(sre_c, "ATOMIC_GROUP", None)
_CATEGORY_SOURCE = {
    sre_c.CATEGORY_DIGIT: r"\d", sre_c.CATEGORY_NOT_DIGIT: r"\D",
    sre_c.CATEGORY_SPACE: r"\s", sre_c.CATEGORY_NOT_SPACE: r"\S",
    sre_c.CATEGORY_WORD: r"\w", sre_c.CATEGORY_NOT_WORD: r"\W",
}
# Flags that change which characters a class matches; passed to `re` when Python computes a class.
_CLASS_FLAGS = re.IGNORECASE | re.ASCII | re.DOTALL


@dataclass(frozen=True)
class ByteDFA:
    """A minimal DFA over bytes. State 0 is the start; every state can still reach an accepting one."""

    transitions: np.ndarray  # int32 [num_states, 256]; -1 where the byte leads nowhere
    accepting: np.ndarray  # bool [num_states]

    @property
    def num_states(self) -> int:
        return int(self.accepting.shape[0])

    @functools.cached_property
    def byte_classes(self) -> np.ndarray:
        """int [256]: the class of each byte, bytes no state tells apart sharing one (numbered in byte order)."""
        return column_classes(self.transitions)

    def walk(self, data: bytes, state: int = 0) -> int:
        """The state after `data` from `state`, or -1 if `data` leaves the language."""
        trans = self.transitions
        for b in data:
            state = int(trans[state, b])
            if state < 0:
                return -1
        return state

    def fullmatch(self, text: str) -> bool:
        end = self.walk(text.encode())
        return end >= 0 and bool(self.accepting[end])


@dataclass(frozen=True)
class LiteralDFA(ByteDFA):
    """The chain of exactly `data`: state i has data[i:] left to read (what literal_tokens asks of a literal
    state, here without reading the table: an enum's hundreds of literals are met in one configuration)."""

    data: bytes


def literal_dfa(data: bytes) -> LiteralDFA:
    """The minimal DFA of exactly `data` (a chain), without going through a regex (grammar.lit caches it)."""
    n = len(data)
    trans = np.full((n + 1, 256), -1, dtype=np.int32)
    trans[np.arange(n), np.frombuffer(data, dtype=np.uint8)] = np.arange(1, n + 1, dtype=np.int32)
    accepting = np.zeros(n + 1, dtype=bool)
    accepting[n] = True
    return LiteralDFA(transitions=trans, accepting=accepting, data=data)


def byte_trie(words: list[bytes]) -> tuple[list[dict[int, int]], list[int]]:
    """The trie of `words` as numbered nodes (0: the root): per node its children {byte: node}, and per word
    the node it ends at. Dicts of numbers, which Python's collector does not track."""
    children: list[dict[int, int]] = [{}]
    word_ends = []
    for word in words:
        node = 0
        for b in word:
            nxt = children[node].get(b)
            if nxt is None:
                nxt = children[node][b] = len(children)
                children.append({})
            node = nxt
        word_ends.append(node)
    return children, word_ends


def literals_dfa(words: list[bytes]) -> ByteDFA:
    """A DFA (the trie; not minimal) of exactly the strings `words`, without going through a regex."""
    children, word_ends = byte_trie(words)
    ends = [False] * len(children)
    for node in word_ends:
        ends[node] = True
    trans = np.full((len(children), 256), -1, dtype=np.int32)
    for node, row in enumerate(children):
        if row:
            trans[node, list(row)] = list(row.values())
    return ByteDFA(transitions=trans, accepting=np.array(ends, dtype=bool))


def epsilon_reachable(states, eps: list[list[int]]) -> set[int]:
    """The states reachable from `states` through epsilon edges (`eps[s]`: s's epsilon targets), them included."""
    seen, stack = set(states), list(states)
    while stack:
        for t in eps[stack.pop()]:
            if t not in seen:
                seen.add(t)
                stack.append(t)
    return seen


def regex_to_dfa(pattern: str, max_states: int = MAX_DFA_STATES) -> ByteDFA:
    """Compiles a Python regex (fullmatch semantics) to a minimal byte-level DFA; ValueError if unsupported,
    GrammarBudgetError (a ValueError) if its automaton would exceed `max_states` states."""
    if not isinstance(pattern, str):
        raise ValueError(f"regex must be a string, got {type(pattern).__name__}")
    try:
        tree = sre_p.parse(pattern)
    except re.error as e:
        raise ValueError(f"invalid regex {pattern!r}: {e}") from None
    nfa = _NFA(2 * max_states)
    start, accept = nfa.compile(tree, tree.state.flags, at_start=True, at_end=True)
    trans, accepting = _determinize(nfa, start, accept, max_states)
    return ByteDFA(*minimize(trans, accepting, nfa.byte_classes(), pattern))


def char_set_ranges(op, av, flags: int) -> charsets.Ranges:
    """The code points a one-character parse node (LITERAL, NOT_LITERAL, ANY, IN) matches under `flags`."""
    if op is sre_c.ANY:
        return charsets.ALL if flags & re.DOTALL else charsets.complement(((10, 10),))
    if op is sre_c.LITERAL or op is sre_c.NOT_LITERAL:
        items = [(sre_c.LITERAL, av)] if op is sre_c.LITERAL else [(sre_c.NEGATE, None), (sre_c.LITERAL, av)]
    else:
        items = av
    ascii_only = flags & re.ASCII and not flags & re.IGNORECASE  # categories are known ASCII sets
    simple = not flags & re.IGNORECASE and (ascii_only or all(o is not sre_c.CATEGORY for o, _ in items))
    if not simple:
        return charsets.ranges_matching(_class_source(items), flags & _CLASS_FLAGS)
    negate, ranges = False, []
    for o, a in items:
        if o is sre_c.NEGATE:
            negate = True
        elif o is sre_c.LITERAL:
            ranges.append((a, a))
        elif o is sre_c.RANGE:
            ranges.append(a)
        elif o is sre_c.CATEGORY and a in _ASCII_CATEGORIES:
            positive, inverted = _ASCII_CATEGORIES[a]
            ranges.extend(charsets.complement(positive) if inverted else positive)
        else:
            raise ValueError(f"unsupported item {o} in a character class")
    return charsets.complement(ranges) if negate else charsets.normalize(ranges)


_ASCII_DIGIT = ((48, 57),)
_ASCII_WORD = ((48, 57), (65, 90), (95, 95), (97, 122))
_ASCII_SPACE = ((9, 13), (32, 32))
# Category -> (its ASCII ranges, whether the category is their complement), under re.ASCII.
_ASCII_CATEGORIES = {
    sre_c.CATEGORY_DIGIT: (_ASCII_DIGIT, False), sre_c.CATEGORY_NOT_DIGIT: (_ASCII_DIGIT, True),
    sre_c.CATEGORY_WORD: (_ASCII_WORD, False), sre_c.CATEGORY_NOT_WORD: (_ASCII_WORD, True),
    sre_c.CATEGORY_SPACE: (_ASCII_SPACE, False), sre_c.CATEGORY_NOT_SPACE: (_ASCII_SPACE, True),
}


def _class_source(items) -> str:
    """Rebuilds a bracket expression from parsed class items, so Python can evaluate it under flags."""
    parts = []
    for o, a in items:
        if o is sre_c.NEGATE:
            parts.insert(0, "^")
        elif o is sre_c.LITERAL:
            parts.append(f"\\U{a:08x}")
        elif o is sre_c.RANGE:
            parts.append(f"\\U{a[0]:08x}-\\U{a[1]:08x}")
        elif o is sre_c.CATEGORY:
            parts.append(_CATEGORY_SOURCE[a])
        else:
            raise ValueError(f"unsupported item {o} in a character class")
    return "[" + "".join(parts) + "]"


def unsupported_construct(op, av) -> str | None:
    """The name of a construct a finite automaton cannot express, or None."""
    if op is sre_c.GROUPREF:
        return "backreference"
    if op is sre_c.GROUPREF_EXISTS:
        return "conditional group (?(id)yes|no)"
    if op is sre_c.ASSERT:
        return "lookahead (?=...)" if av[0] == 1 else "lookbehind (?<=...)"
    if op is sre_c.ASSERT_NOT:
        return "negative lookahead (?!...)" if av[0] == 1 else "negative lookbehind (?<!...)"
    if _POSSESSIVE is not None and op is _POSSESSIVE:
        return "possessive quantifier (*+, ++, ?+, {m,n}+)"
    if _ATOMIC is not None and op is _ATOMIC:
        return "atomic group (?>...)"
    return None


class _NFA:
    """Thompson NFA over bytes: per state, epsilon targets and (lo, hi, target) byte-range edges."""

    def __init__(self, max_states: int = MAX_NFA_STATES) -> None:
        self.max_states = max_states
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple[int, int, int]]] = []

    def new(self) -> int:
        if len(self.eps) >= self.max_states:
            raise GrammarBudgetError(f"regex too large: its automaton exceeds {self.max_states} states "
                             "(large counted repetitions of wide character classes are the usual cause)")
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def compile(self, seq, flags: int, at_start: bool, at_end: bool) -> tuple[int, int]:
        """Fragment (start, end) for a sequence of parse nodes. at_start / at_end: whether the sequence
        necessarily begins at the start / ends at the end of the whole match (where ^ and $ are no-ops)."""
        items = list(seq)
        start = cur = self.new()
        for i, (op, av) in enumerate(items):
            first = at_start and all(o is sre_c.AT for o, _ in items[:i])
            last = at_end and all(o is sre_c.AT for o, _ in items[i + 1:])
            s, e = self._node(op, av, flags, first, last)
            self.eps[cur].append(s)
            cur = e
        return start, cur

    def _node(self, op, av, flags: int, at_start: bool, at_end: bool) -> tuple[int, int]:
        if op in (sre_c.LITERAL, sre_c.NOT_LITERAL, sre_c.ANY, sre_c.IN):
            return self._chars(char_set_ranges(op, av, flags))
        if op is sre_c.SUBPATTERN:
            _group, add_flags, del_flags, sub = av
            return self.compile(sub, (flags | add_flags) & ~del_flags, at_start, at_end)
        if op is sre_c.BRANCH:
            start, end = self.new(), self.new()
            for alt in av[1]:
                s, e = self.compile(alt, flags, at_start, at_end)
                self.eps[start].append(s)
                self.eps[e].append(end)
            return start, end
        if op in (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT):
            return self._repeat(av[0], av[1], av[2], flags)
        if op is sre_c.AT:
            return self._anchor(av, at_start, at_end)
        name = unsupported_construct(op, av)
        raise ValueError(f"unsupported regex construct: {name or op}")

    def _anchor(self, av, at_start: bool, at_end: bool) -> tuple[int, int]:
        if av in (sre_c.AT_BEGINNING, sre_c.AT_BEGINNING_STRING) and at_start:
            s = self.new()
            return s, s
        if av in (sre_c.AT_END, sre_c.AT_END_STRING) and at_end:
            s = self.new()
            return s, s
        names = {sre_c.AT_BOUNDARY: r"word boundary \b", sre_c.AT_NON_BOUNDARY: r"non-boundary \B"}
        raise ValueError(f"unsupported regex construct: {names.get(av, f'anchor {av} away from the pattern ends')}")

    def _repeat(self, lo: int, hi: int, sub, flags: int) -> tuple[int, int]:
        start = cur = self.new()
        for _ in range(lo):
            s, e = self.compile(sub, flags, False, False)
            self.eps[cur].append(s)
            cur = e
        if hi == sre_c.MAXREPEAT:
            loop = self.new()
            self.eps[cur].append(loop)
            s, e = self.compile(sub, flags, False, False)
            self.eps[loop].append(s)
            self.eps[e].append(loop)
            return start, loop
        end = self.new()
        for _ in range(hi - lo):
            self.eps[cur].append(end)
            s, e = self.compile(sub, flags, False, False)
            self.eps[cur].append(s)
            cur = e
        self.eps[cur].append(end)
        return start, end

    def _chars(self, ranges: charsets.Ranges) -> tuple[int, int]:
        """A fragment for one character of `ranges`: a trie over its UTF-8 byte-range sequences."""
        start, end = self.new(), self.new()
        inner: dict[tuple, int] = {}
        for seq in charsets.utf8_sequences(ranges):
            cur = start
            for k, (lo, hi) in enumerate(seq):
                if k == len(seq) - 1:
                    self.edges[cur].append((lo, hi, end))
                    break
                nxt = inner.get(seq[: k + 1])
                if nxt is None:
                    nxt = inner[seq[: k + 1]] = self.new()
                    self.edges[cur].append((lo, hi, nxt))
                cur = nxt
        return start, end

    def byte_classes(self) -> np.ndarray:
        """uint8/int [256]: bytes no edge tells apart share a class (class ids in byte order)."""
        cuts = np.zeros(257, dtype=bool)
        cuts[0] = True
        for edges in self.edges:
            for lo, hi, _ in edges:
                cuts[lo] = cuts[hi + 1] = True
        return (np.cumsum(cuts[:256]) - 1).astype(np.int64)


def _determinize(nfa: _NFA, start: int, accept: int, max_states: int) -> tuple[np.ndarray, np.ndarray]:
    """Subset construction over byte classes. Returns transitions [n, K] (-1 = none) and accepting [n]."""
    classes = nfa.byte_classes().tolist()  # (Python ints: read once per NFA edge)
    num_classes = classes[-1] + 1
    cedges = [[(classes[lo], classes[hi], t) for lo, hi, t in edges] for edges in nfa.edges]
    eps, closures, own = nfa.eps, {}, {}

    def closure(targets: frozenset[int]) -> frozenset[int]:
        found = closures.get(targets)
        if found is None:
            # Only states with byte edges (and the accept state) tell subsets apart. Each state's own
            # closure is walked once; a subset's is the union of its states' (set operations in C).
            parts = []
            for t in targets:
                part = own.get(t)
                if part is None:
                    part = own[t] = frozenset(s for s in epsilon_reachable((t,), eps) if cedges[s] or s == accept)
                parts.append(part)
            found = closures[targets] = frozenset().union(*parts)
        return found

    first = closure(frozenset([start]))
    ids, sets, rows = {first: 0}, [first], []
    while len(rows) < len(sets):
        row = [-1] * num_classes
        # A sweep over the class boundaries of the subset's edges: `active` counts the edges covering
        # the current interval, per target.
        opening: dict[int, list[int]] = {}
        closing: dict[int, list[int]] = {}
        for s in sets[len(rows)]:
            for lo, hi, t in cedges[s]:
                opening.setdefault(lo, []).append(t)
                closing.setdefault(hi + 1, []).append(t)
        points = sorted(opening.keys() | closing.keys())
        active: dict[int, int] = {}
        for a, b in zip(points, points[1:]):
            for t in closing.get(a, ()):
                active[t] -= 1
                if not active[t]:
                    del active[t]
            for t in opening.get(a, ()):
                active[t] = active.get(t, 0) + 1
            if not active:
                continue
            targets = frozenset(active)
            subset = closure(targets)
            j = ids.get(subset)
            if j is None:
                if len(sets) >= max_states:
                    raise GrammarBudgetError(f"regex too large: its DFA exceeds {max_states} states")
                j = ids[subset] = len(sets)
                sets.append(subset)
            row[a:b] = [j] * (b - a)
        rows.append(row)
    trans = np.array(rows, dtype=np.int32).reshape(len(rows), num_classes)
    accepting = np.array([accept in s for s in sets], dtype=bool)
    return trans, accepting
