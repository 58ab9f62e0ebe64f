"""UTF-8 seen by a byte trie walk: which trie nodes have only valid UTF-8 below them, and which DFA states
every whole character leads back to (a string body's, most pattern keys').

A trie walk takes a subtree whole when its DFA state loops on every byte read below it (trie_walk.py). A
multi-byte character leaves a string body's state and comes back only at its last byte, so any subtree
holding one was walked node by node: over a third of Qwen2's vocabulary. A state to which every valid
character returns (transparent), at a node where a character ends and below which every token goes on as
valid UTF-8, keeps every token below alive through its last byte whatever its non-ASCII bytes: only its
ASCII bytes need to loop.
"""

from __future__ import annotations

import numpy as np

# UTF-8's validator (RFC 3629, no overlongs or surrogates): 0 at a character boundary, 1-7 inside a
# character (how many bytes are left and which ranges the next may take), 8 invalid.
BOUNDARY, INVALID = 0, 8
VALIDATOR = np.full((9, 256), INVALID, dtype=np.int8)
VALIDATOR[0, :0x80] = 0
VALIDATOR[0, 0xC2:0xE0] = 1
VALIDATOR[0, 0xE0] = 3
VALIDATOR[0, 0xE1:0xED] = 2
VALIDATOR[0, 0xED] = 4
VALIDATOR[0, 0xEE:0xF0] = 2
VALIDATOR[0, 0xF0] = 6
VALIDATOR[0, 0xF1:0xF4] = 5
VALIDATOR[0, 0xF4] = 7
for _state, (_lo, _hi), _to in ((1, (0x80, 0xC0), 0), (2, (0x80, 0xC0), 1), (3, (0xA0, 0xC0), 1), (4, (0x80, 0xA0), 1),
                                (5, (0x80, 0xC0), 2), (6, (0x90, 0xC0), 2), (7, (0x80, 0x90), 2)):
    VALIDATOR[_state, _lo:_hi] = _to


def whole_below(byte: list[np.ndarray], parents: list[np.ndarray]) -> list[np.ndarray]:
    """Per trie level d (byte[d]: each node's byte, parents[d]: its level d-1 parent): bool [nodes], the
    node's bytes from the root are whole characters and every path below it is valid UTF-8 (a valid
    character sequence, the last one possibly cut short)."""
    depth = len(byte) - 1
    state = [np.zeros(0, np.int8), VALIDATOR[BOUNDARY, byte[1]]] if depth else [np.zeros(0, np.int8)]
    for d in range(2, depth + 1):
        state.append(VALIDATOR[state[d - 1][parents[d]], byte[d]])
    bad = [s == INVALID for s in state]  # becomes: invalid at or below the node
    for d in range(depth, 1, -1):  # children before parents
        bad[d - 1] = bad[d - 1] | (np.bincount(parents[d], weights=bad[d], minlength=len(bad[d - 1])) > 0)
    return [(s == BOUNDARY) & ~b for s, b in zip(state, bad)]


# Lead bytes by the ranges their continuation bytes take.
_CHARACTERS = ((range(0xC2, 0xE0), ((0x80, 0xC0),)), ((0xE0,), ((0xA0, 0xC0), (0x80, 0xC0))),
               ((*range(0xE1, 0xED), 0xEE, 0xEF), ((0x80, 0xC0),) * 2), ((0xED,), ((0x80, 0xA0), (0x80, 0xC0))),
               ((0xF0,), ((0x90, 0xC0), (0x80, 0xC0), (0x80, 0xC0))), (range(0xF1, 0xF4), ((0x80, 0xC0),) * 3),
               ((0xF4,), ((0x80, 0x90), (0x80, 0xC0), (0x80, 0xC0))))


def transparent_states(trans: np.ndarray) -> np.ndarray:
    """bool [states] of DFA table `trans` (-1: dead): every valid multi-byte character read from the state
    leads back to it, through states that keep each of its bytes alive. Where one continuation byte's
    range does not lead to one state the answer is False (sound: the walk then reads those bytes)."""
    n = len(trans)
    table = np.vstack([trans, np.full((1, trans.shape[1]), -1, dtype=trans.dtype)]).astype(np.int64)
    table[table < 0] = n  # dead: the extra row n, which stays dead
    one = {}  # per continuation range: the state every byte of it leads to from each state, else n
    for lo, hi in {r for _, ranges in _CHARACTERS for r in ranges}:
        block = table[:, lo:hi]
        one[lo, hi] = np.where((block == block[:, :1]).all(axis=1), block[:, 0], n)
    ok = np.ones(n, dtype=bool)
    for leads, ranges in _CHARACTERS:
        at = table[:n][:, list(leads)]
        for r in ranges:
            at = one[r][at]
        ok &= (at == np.arange(n)[:, None]).all(axis=1)
    return ok
