"""The vocabulary trie walked node by node through a terminal DFA, for futures few tokens follow.

trie_walk.walk_trie steps whole trie levels with numpy: ~25 numpy calls per level, whatever the number of
live nodes, so a literal key (`"data":`, after its `"`) costs ~40 µs a level and ~300 µs in all, though
one node per level is alive. Here each live node's children are found by the bytes its DFA state reads
(a binary search among the node's children) or, when the node has fewer children than the state has
moves, by reading its children through the moves; subtrees under an exit (every token there may leave
the terminal) are kept as node ranges, one per level. The walk gives up (None) as soon as a level has
more than NARROW_NODES live nodes: then the level-wise walk is the cheaper one. The level-wise walk hands
its deep levels, once few nodes are left, to this one's loop (walk_on).
"""

from __future__ import annotations

import bisect

import numpy as np

from radixlm.core.runtime.constrained.automata.regex_dfa import ByteDFA
from radixlm.core.runtime.constrained.tokens.vocab import TokenVocab

NARROW_NODES = 32  # live nodes per level at most

# Per (terminal, state): (accepting, number of live bytes, the live bytes) as bytes and the live bytes'
# targets, read once from the DFA: terminal_tokens' future hashes (breadth-first searches that revisit the
# same states) and the moves here. Numbers are held in tuples, not lists: a tuple of numbers (and one of
# such tuples) leaves the cyclic collector's tracking at its first collection, and these caches hold tens
# of thousands of rows, each an object every full collection walks otherwise (~0.7 µs each, cold).
_state_rows: dict[tuple[str, int], tuple[bytes, tuple[int, ...]]] = {}
STATE_ROWS = 1 << 14
# Per terminal of at most ROWS_AT_ONCE states, its rows read in one numpy pass at its first miss: (where
# each state's live bytes start, the live bytes, their targets, accepting flags). A search meets most of a
# small DFA's states (each first byte's future); a narrow walk only a few of a bounded number's 50, so a
# state's row is cut from these when asked, not for every state at once.
_dfa_rows: dict[str, tuple[tuple[int, ...], bytes, tuple[int, ...], bytes]] = {}
ROWS_AT_ONCE = 1024
DFA_ROWS_MOVES = 1 << 21  # moves held in _dfa_rows at most (a string body's state has ~200), cleared past it
_dfa_rows_moves = 0
_moves: dict[tuple[str, int], dict[int, int]] = {}  # per (terminal, state): its moves as {byte: target}
MOVES = 1 << 14


def moves_of(key: str, dfa: ByteDFA, state: int) -> dict[int, int]:
    """The state's moves as {byte: target}, cached per (terminal, state)."""
    found = _moves.get((key, state))
    if found is None:
        head, targets = state_row(key, dfa, state)
        found = dict(zip(head[2:], targets))
        if len(_moves) >= MOVES:
            _moves.clear()
        _moves[key, state] = found
    return found


def dfa_rows(key: str, dfa: ByteDFA) -> tuple[tuple[int, ...], bytes, tuple[int, ...], bytes] | None:
    """The rows of a DFA of at most ROWS_AT_ONCE states, read at once and cached per terminal: (where each
    state's live bytes start, the live bytes, their targets, accepting flags); None for larger DFAs."""
    global _dfa_rows_moves
    if len(dfa.transitions) > ROWS_AT_ONCE:
        return None
    rows = _dfa_rows.get(key)
    if rows is None:
        rows = _read_rows(dfa, np.arange(len(dfa.transitions)))
        if _dfa_rows_moves + len(rows[2]) > DFA_ROWS_MOVES:
            _dfa_rows.clear()
            _dfa_rows_moves = 0
        _dfa_rows[key] = rows
        _dfa_rows_moves += len(rows[2])
    return rows


def state_row(key: str, dfa: ByteDFA, state: int) -> tuple[bytes, tuple[int, ...]]:
    found = _state_rows.get((key, state))
    if found is None:
        rows = dfa_rows(key, dfa)
        whole = rows is not None
        if not whole:
            rows = _read_rows(dfa, np.array([state]))
        cut, live_bytes, targets, accepting = rows
        n = state if whole else 0
        a, b = cut[n], cut[n + 1]
        found = (bytes((accepting[n], (b - a) & 255)) + live_bytes[a:b], targets[a:b])
        if len(_state_rows) >= STATE_ROWS:
            _state_rows.clear()
        _state_rows[key, state] = found
    return found


def _read_rows(dfa: ByteDFA, states: np.ndarray) -> tuple[tuple[int, ...], bytes, tuple[int, ...], bytes]:
    rows = dfa.transitions[states].ravel()
    flat = np.flatnonzero(rows >= 0)  # a 2-D np.nonzero is ~4x slower (~19 µs for a number's 35 states)
    cut = tuple(np.searchsorted(flat >> 8, np.arange(len(states) + 1)).tolist())
    accepting = dfa.accepting[states].astype(np.uint8).tobytes()
    return cut, (flat & 255).astype(np.uint8).tobytes(), tuple(rows[flat].tolist()), accepting


def narrow_walk(key: str, dfa: ByteDFA, nodes: np.ndarray, states: np.ndarray,
                vocab: TokenVocab) -> tuple[np.ndarray, np.ndarray] | None:
    """trie_walk.walk_trie's result as ids (sorted: the tokens below level-1 `nodes`, in DFA `states`
    after their first byte, alive through their last byte; the other tokens strictly below a node where
    the DFA accepts), or None when a level has more than NARROW_NODES live nodes."""
    if len(nodes) > NARROW_NODES:
        return None
    walked = walk_on(key, dfa, 1, list(zip(nodes.tolist(), states.tolist())), [], vocab, NARROW_NODES)
    if walked is None:
        return None
    ends, exits = walked
    # Tokens end at one node each, so `ends` are disjoint; exit ranges may nest (several exits on a path).
    inside = np.sort(np.concatenate(ends)) if ends else np.zeros(0, dtype=np.int32)
    if not exits:
        return inside, np.zeros(0, dtype=np.int32)
    uncertain = np.unique(np.concatenate(exits))
    at = np.minimum(np.searchsorted(inside, uncertain), max(len(inside) - 1, 0))
    return inside, uncertain[inside[at] != uncertain] if len(inside) else uncertain


def walk_on(key: str, dfa: ByteDFA, d: int, live: list[tuple[int, int]], under: list[tuple[int, int]],
            vocab: TokenVocab, most: int | None) -> tuple[list, list] | None:
    """The walk from level d's `live` (node, DFA state) pairs and the node ranges [lo, hi) of level d
    `under` an exit: (arrays of the ids of the tokens ending at a live node, arrays of the ids of the
    tokens strictly under an exit node), or None once a level has more than `most` live nodes."""
    trie = vocab.trie
    level_bytes, child_ptr, end_ptr = trie.views
    accepting = dfa.accepting
    ends, exits = [], []
    for d in range(d, trie.depth + 1):
        eptr, tokens = end_ptr[d], trie.end_tokens[d]
        for n, _ in live:
            a, b = eptr[n], eptr[n + 1]
            if b > a:
                ends.append(tokens[a:b])
        exits += [tokens[eptr[lo]:eptr[hi]] for lo, hi in under]
        if d == trie.depth:
            break
        ptr, level = child_ptr[d + 1], level_bytes[d + 1]
        under = [(ptr[lo], ptr[hi]) for lo, hi in under]
        nxt = []
        for n, s in live:
            lo, hi = ptr[n], ptr[n + 1]
            if hi == lo:
                continue
            if accepting[s]:
                under.append((lo, hi))
            moves = moves_of(key, dfa, s)
            if hi - lo <= len(moves):
                nxt += [(c, moves[b]) for c, b in enumerate(level[lo:hi], lo) if b in moves]
            else:  # children are sorted by byte: each move's child found by a binary search
                for b, t in moves.items():
                    c = bisect.bisect_left(level, b, lo, hi)
                    if c < hi and level[c] == b:
                        nxt.append((c, t))
        if most is not None and len(nxt) > most:
            return None
        live = nxt
        under = [(lo, hi) for lo, hi in under if hi > lo]
        if not live and not under:
            break
    return ends, exits
