"""A wide terminal state's tokens read one token at a time rather than down the trie: most are decided by
one vectorized test on the set of bytes each token holds, and only the rest are read byte by byte.

From a state whose loops cover most bytes (a string body, a pattern key before its match), a token whose
bytes all loop on the state (its non-ASCII bytes too, or, where every whole UTF-8 character returns to the
state, utf8.py, whole characters) is alive through its last byte, whatever its order: a subset test of
the token's 256-bit byte set against the state's loops, over the whole vocabulary at once (~1 ms for
Qwen2). The others (holding `"`, `\\`, a pattern's letters: a few thousand) are stepped through the DFA
one byte position at a time. The trie walk (trie_walk.py) must step every level above the subtrees it
can take whole, and UTF-8 and `"` below most nodes keep it from taking them early.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from radixlm.core.runtime.constrained.automata.regex_dfa import ByteDFA
from radixlm.core.runtime.constrained.tokens.utf8 import INVALID, VALIDATOR
from radixlm.core.runtime.constrained.tokens.vocab import TokenVocab, byte_matrix, expand_ranges


@dataclass(frozen=True)
class TokenBytes:
    """The vocabulary's tokens in the trie's sorted order (TokenTrie.subtrees' `order`): each one's set of
    bytes (4 uint64 words), whether it is a valid UTF-8 prefix (whole characters, the last possibly cut),
    its bytes (zero-padded, column-major: position j of every token is one contiguous row) and length."""

    words: tuple[np.ndarray, ...]
    utf8: np.ndarray
    columns: np.ndarray
    lens: np.ndarray


_prepared: dict[str, TokenBytes | None] = {}
_lock = threading.Lock()
MATRIX_BYTES = 1 << 26  # the tokens' padded bytes at most (Qwen2: 151k tokens of up to 128 bytes, 19 MB)


def token_bytes(vocab: TokenVocab) -> TokenBytes | None:
    """The vocabulary's TokenBytes (~0.2 s for Qwen2; prepare_vocab builds them), cached; None where the
    padded bytes would pass MATRIX_BYTES (a vocabulary with very long tokens: its walks go down the trie)."""
    with _lock:
        if vocab.fingerprint in _prepared:
            return _prepared[vocab.fingerprint]
        order = vocab.trie.subtrees[3]
        found = None
        if len(order) * max(map(len, vocab.token_bytes), default=1) <= MATRIX_BYTES:
            matrix, lens = byte_matrix([vocab.token_bytes[i] for i in order.tolist()])
            flat = matrix[np.arange(matrix.shape[1]) < lens[:, None]].astype(np.int64)
            rows = np.repeat(np.arange(len(lens)), lens)
            bits = np.zeros((len(lens), 4), dtype=np.uint64)
            np.bitwise_or.at(bits, (rows, flat >> 6), np.left_shift(np.uint64(1), (flat & 63).astype(np.uint64)))
            state, reading = np.zeros(len(lens), dtype=np.int64), np.arange(len(lens))
            for j in range(matrix.shape[1]):
                reading = reading[lens[reading] > j]
                state[reading] = VALIDATOR[state[reading], matrix[reading, j]]
            found = TokenBytes(tuple(np.ascontiguousarray(bits[:, w]) for w in range(4)), state != INVALID,
                               np.ascontiguousarray(matrix.T), lens)
        _prepared[vocab.fingerprint] = found
        return found


REST_MOST = 65536  # tokens left to read byte by byte past which the trie walk is the cheaper one


def walk_tokens(dfa: ByteDFA, state: int, nodes: np.ndarray, other: list[np.ndarray], transparent: np.ndarray,
                vocab: TokenVocab) -> tuple[np.ndarray, np.ndarray] | None:
    """trie_walk.walk_trie's result for the tokens starting at level-1 trie `nodes` read from `state` (the
    state before their first byte; other, transparent: trie_walk.other_bytes of the DFA): (bool [vocab]:
    alive through their last byte, ids of the others that pass an accepting state after their first byte
    and before their last); None if over REST_MOST tokens do not loop on the state (a state that reads
    few bytes, `[a-z ]+`) or the vocabulary has no TokenBytes."""
    tb = token_bytes(vocab)
    if tb is None:
        return None
    _, first, count, order = vocab.trie.subtrees
    _, at = expand_ranges(first[1][nodes], count[1][nodes])  # the tokens below `nodes`: sorted positions
    whole = len(at) > len(order) // 2  # most of the vocabulary: tested whole, then selected (no gathers)
    words, utf8 = (tb.words, tb.utf8) if whole else ([w[at] for w in tb.words], tb.utf8[at])
    o = [np.uint64(x[state]) for x in other]
    looping = ((words[0] & o[0]) | (words[1] & o[1])) == 0
    if o[2] or o[3]:
        high = ((words[2] & o[2]) | (words[3] & o[3])) == 0
        looping &= (high | utf8) if transparent[state] else high
    if whole:
        below = np.zeros(len(order), dtype=bool)
        below[at] = True
        fast, rest = np.flatnonzero(below & looping), np.flatnonzero(below & ~looping)
    else:
        fast, rest = at[looping], at[~looping]
    if len(rest) > REST_MOST:
        return None
    inside = np.zeros(vocab.size, dtype=bool)
    inside[order[fast]] = True
    alive, exits = _read(dfa, state, tb.columns, tb.lens, rest)
    inside[order[rest[alive]]] = True
    return inside, np.sort(order[rest[exits & ~alive]])  # by id, as the trie walk gives them


def _read(dfa: ByteDFA, state: int, columns: np.ndarray, lens: np.ndarray,
          rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Tokens `rows` (positions into `columns`, the bytes column-major) read from `state`, one numpy step per
    byte position: (bool per row: alive through its last byte, bool per row: passed an accepting state
    after its first byte, before its last). Rows are ordered longest first, so the rows still reading at
    position j are a prefix; a dead row moves to an extra state every byte leads back to, and dead rows
    are dropped once they are most of the prefix (a narrow state's tokens mostly die on their first byte)."""
    trans, accepting = dfa.transitions, dfa.accepting
    dead = len(trans)
    table = np.concatenate([np.where(trans < 0, dead, trans).ravel(), np.full(256, dead)]).astype(np.int32)
    ends = np.append(accepting, False)
    by_length = np.argsort(-lens[rows].astype(np.int16), kind="stable")  # a radix sort on int16
    at, pos = by_length, rows[by_length]
    neg = -lens[pos]  # ascending: the rows past byte j are those with neg < -j, a prefix
    cur = np.full(len(rows), state, dtype=np.int32)
    passed = np.zeros(len(rows), dtype=bool)
    exits = np.zeros(len(rows), dtype=bool)
    for j in range(int(-neg[0]) if len(neg) else 0):
        n = int(np.searchsorted(neg, -j))
        if not n:  # the rows left are read (or dead and dropped)
            break
        if j:
            passed[:n] |= ends[cur[:n]]
        cur[:n] = table.take((cur[:n] << 8) + columns[j].take(pos[:n]))
        if j & 3 == 3:  # every 4 bytes: drop the dead rows if they are half the prefix
            live = cur != dead
            if np.count_nonzero(live[:n]) * 2 < n:
                exits[at[passed & ~live]] = True
                at, pos, neg, cur, passed = at[live], pos[live], neg[live], cur[live], passed[live]
    alive = np.zeros(len(rows), dtype=bool)
    alive[at] = cur != dead
    exits[at[passed]] = True
    return alive, exits
