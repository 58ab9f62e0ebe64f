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


def literal_classes(rest: bytes, vocab: TokenVocab) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids of the tokens inside a literal with `rest` left to read; ids of the tokens that start with
    `rest` and go on, and where their suffix starts), as terminal_tokens' walk and exit pairs give."""
    data, ids, first = vocab.sorted_tokens
    inside: list[int] = []
    for n in range(1, len(rest) + 1):
        i = first.get(rest[:n])  # tokens with equal bytes (byte-fallback spellings) sit next to each other
        while i is not None and i < len(data) and data[i] == rest[:n]:
            inside.append(int(ids[i]))
            i += 1
    lo, hi = starting_with(data, rest)
    while lo < hi and data[lo] == rest:  # rest itself is inside (counted above), not an exit
        lo += 1
    exits = ids[lo:hi]
    return np.asarray(inside, dtype=np.int32), exits, np.full(len(exits), len(rest), dtype=np.int32)


def starting_with(data: list[bytes], prefix: bytes) -> tuple[int, int]:
    """The range [lo, hi) of the sorted byte strings `data` that start with `prefix`."""
    lo = bisect.bisect_left(data, prefix)
    return lo, bisect.bisect_left(data, _after_prefix(prefix), lo) if prefix.rstrip(b"\xff") else len(data)


def _after_prefix(prefix: bytes) -> bytes:
    """The least byte string greater than every string that starts with `prefix` (not all 0xff bytes)."""
    head = prefix.rstrip(b"\xff")
    return head[:-1] + bytes((head[-1] + 1,))
