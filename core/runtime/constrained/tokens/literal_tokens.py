"""Token classes of a literal's states, read off the sorted vocabulary instead of walking the trie.

A literal terminal (a key `"data":`, `null`, `,`) is a chain: from each of its states one byte goes on,
and only the chain's end accepts. What the DFA can still read from such a state is its remaining bytes R,
so R names the state's classes (equal R, equal classes, whatever the terminal), and they are: inside, the
tokens that are prefixes of R (R itself included: it ends the terminal at its last byte); exits, the
tokens that start with R and go on, each leaving with its bytes past R. In the vocabulary sorted by
bytes those are a few exact lookups and one contiguous range (terminal_tokens.py's general walk, a
breadth-first hash of the state's future and a trie walk, cost ~30-50 µs per fresh key state, in the
first masks of most schemas).
"""

from __future__ import annotations

import bisect

import numpy as np

from radixlm.core.runtime.constrained.tokens.narrow_walk import dfa_rows
from radixlm.core.runtime.constrained.automata.regex_dfa import ByteDFA, LiteralDFA
from radixlm.core.runtime.constrained.tokens.vocab import TokenVocab

MAX_REST = 256  # chain states followed at most; a longer literal takes the general walk
# Per terminal, per state (nested, not keyed by (terminal, state): a dict keyed by fresh tuples stays tracked,
# and every full collection walked its ~26k entries in a corpus run; an inner dict of ints and bytes is not).
_rests: dict[str, dict[int, bytes | None]] = {}
RESTS = 1 << 12  # terminals


def literal_rest(key: str, dfa: ByteDFA, state: int) -> bytes | None:
    """The bytes left to read from `state` if the DFA (named `key`) is a chain from there (one live byte
    per state, no accepting state before an end that reads nothing), else None. Cached per (terminal,
    state), with the rests of the chain's later states (met next: a key's classes byte by byte)."""
    if isinstance(dfa, LiteralDFA):
        return dfa.data[state:] or None  # (the end state reads nothing: no chain left)
    rests = _rests.get(key)
    found = rests.get(state, False) if rests is not None else False
    if found is not False:
        return found
    rows = dfa_rows(key, dfa)
    if rows is None:  # a DFA of over ROWS_AT_ONCE states is no short chain
        return None
    cut, live_bytes, targets, accepting = rows
    start, chain = state, []
    while not accepting[state] and cut[state + 1] - cut[state] == 1 and len(chain) < MAX_REST:
        chain.append(state)
        state = targets[cut[state]]
    ends = bool(chain) and accepting[state] and cut[state + 1] == cut[state]
    rest = bytes(live_bytes[cut[q]] for q in chain)
    if rests is None:
        if len(_rests) >= RESTS:
            _rests.clear()
        rests = _rests[key] = {}
    for n, q in enumerate(chain):
        rests[q] = rest[n:] if ends else None
    return rests.setdefault(start, None)


def literal_classes(rests: list[bytes], vocab: TokenVocab) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per literal with rest R left to read: (ids of the tokens inside it, the prefixes of R; ids of the
    tokens that start with R and go on, and where their suffix starts), as terminal_tokens' walk and exit
    pairs give. One call for a configuration's literals (an enum's hundreds of strings): each narrows the
    sorted vocabulary's range of tokens starting with its first n bytes, n = 1, 2, ..., the levels its
    prefix shares with other rests done once, and reads the tokens of a range left small one by one."""
    data, ids, _ = vocab.sorted_tokens
    levels: dict[bytes, tuple[int, int, list[int]]] = {b"": (0, len(data), [])}  # prefix: range past it, inside
    positions: list[int] = []  # every rest's inside then exit tokens, read off `ids` at once
    cuts: list[tuple[int, int, int]] = []  # per rest: where its inside, exits and the next rest start
    for rest in rests:
        lo, hi, inside = levels[b""]
        n = 0
        while n < len(rest) and hi - lo > SCAN:
            n += 1
            found = levels.get(rest[:n])
            if found is None:
                found = levels[rest[:n]] = _narrowed(data, rest[:n], lo, hi, inside)
            lo, hi, inside = found
        start = len(positions)
        positions += inside
        exits = []  # the range's tokens start with rest[:n] and are longer
        for i in range(lo, hi):
            if rest.startswith(data[i]):
                positions.append(i)
            elif data[i].startswith(rest):
                exits.append(i)
        cuts.append((start, len(positions), len(positions) + len(exits)))
        positions += exits
    tokens = ids[positions]
    return [(tokens[a:b], tokens[b:c], np.full(c - b, len(rest), dtype=np.int32) if c > b else _NONE)
            for rest, (a, b, c) in zip(rests, cuts)]


SCAN = 16  # tokens read one by one rather than narrowed further


def _narrowed(data: list[bytes], prefix: bytes, lo: int, hi: int, inside: list[int],
              ) -> tuple[int, int, list[int]]:
    """Within [lo, hi) (the tokens longer than prefix[:-1] that start with it), the range of those longer than
    `prefix` that start with it, and the positions inside so far with the tokens equal to `prefix` added
    (byte-fallback spellings make equal tokens: they sit first in the range)."""
    lo, hi = starting_with(data, prefix, lo, hi)
    equal = lo
    while equal < hi and data[equal] == prefix:
        equal += 1
    return equal, hi, inside + list(range(lo, equal)) if equal > lo else inside


_NONE = np.zeros(0, dtype=np.int32)
_NONE.flags.writeable = False


def starting_with(data: list[bytes], prefix: bytes, lo: int = 0, hi: int | None = None) -> tuple[int, int]:
    """The range [lo, hi) of the sorted byte strings `data` (within [lo, hi) if given) that start with `prefix`."""
    hi = len(data) if hi is None else hi
    lo = bisect.bisect_left(data, prefix, lo, hi)
    return lo, bisect.bisect_left(data, _after_prefix(prefix), lo, hi) if prefix.rstrip(b"\xff") else hi


def _after_prefix(prefix: bytes) -> bytes:
    """The least byte string greater than every string that starts with `prefix` (not all 0xff bytes)."""
    head = prefix.rstrip(b"\xff")
    return head[:-1] + bytes((head[-1] + 1,))
