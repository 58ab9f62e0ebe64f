"""The vocabulary trie walked level by level through a terminal DFA with numpy (a wide state's classes).

A level where many nodes are alive (a string body walks most of the trie) is stepped densely, every node
through its parent's state; a sparse one through the live nodes' children. Subtrees that cannot change
the state are not walked: a node whose DFA state loops on every byte read below it (a string body's
letters, a pattern's `[A-Za-z0-9]*`) has every token below it alive through its last byte, so they are
taken as one range of the sorted vocabulary (TokenTrie.subtrees) at once. That cut most of a wide
state's walk: the trie's 333k nodes (Qwen2) are mostly under such nodes a few levels down. Multi-byte
characters leave a string body's state and come back: from a state every whole character returns to, a
node that ends a character and has only valid UTF-8 below it is taken whole when its ASCII bytes loop
(utf8.py), which halves a string body's or a pattern key's first walk (Qwen2: ~18 -> ~7 ms).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from radixlm.core.runtime.constrained.automata.regex_dfa import ByteDFA
from radixlm.core.runtime.constrained.tokens.narrow_walk import NARROW_NODES, walk_on
from radixlm.core.runtime.constrained.tokens.utf8 import transparent_states
from radixlm.core.runtime.constrained.tokens.vocab import TokenTrie, TokenVocab, expand_ranges

NARROW_FROM = 4  # the first level walked node by node when few nodes are left (the wide ones come before)
DENSE_RATIO = 8  # a trie level is walked densely when over 1/8 of the previous level's nodes are alive
_loop_bits: OrderedDict[int, tuple[np.ndarray, list[np.ndarray]]] = OrderedDict()  # id(transitions): (it, bits)
LOOP_BITS = 256  # DFAs whose loop bits are kept (32 bytes a state)
LOOP_STATES = 4096  # larger DFAs are walked without taking subtrees whole


def other_bytes(dfa: ByteDFA) -> tuple[list[np.ndarray], np.ndarray] | None:
    """Per state, the 256-bit set of bytes that do not lead back to it, as 4 uint64 [states] words, and
    whether every whole UTF-8 character leads back to it (utf8.transparent_states), cached; None for a DFA
    of over LOOP_STATES states or whose table is built as it is read (a counted string's)."""
    if not isinstance(dfa.transitions, np.ndarray) or len(dfa.transitions) > LOOP_STATES:
        return None
    key = id(dfa.transitions)
    found = _loop_bits.get(key)
    if found is None or found[0] is not dfa.transitions:
        trans = dfa.transitions
        loops = trans == np.arange(len(trans))[:, None]
        bits = np.packbits(~loops, axis=1, bitorder="little").view(np.uint64)
        found = (trans, [np.ascontiguousarray(bits[:, w]) for w in range(4)], transparent_states(trans))
        _loop_bits[key] = found
        if len(_loop_bits) > LOOP_BITS:
            _loop_bits.popitem(last=False)
    return found[1], found[2]


def walk_trie(key: str, dfa: ByteDFA, nodes: np.ndarray, states: np.ndarray,
              vocab: TokenVocab) -> tuple[np.ndarray, np.ndarray]:
    """From level-1 trie nodes `nodes` in DFA `states` of terminal `key`: (bool [vocab]: tokens below
    them alive through their last byte, ids of the other tokens strictly below a node where the DFA
    accepts). Level by level, following live nodes and the nodes under an exit; past the wide levels,
    once few nodes are left, node by node (narrow_walk.walk_on: numpy's calls per level cost more there,
    and runs of a looping byte, `-----`, reach level ~100)."""
    trie = vocab.trie
    _, first, count, sorted_ids = trie.subtrees
    trans, accepting, leaving = dfa.transitions, dfa.accepting, other_bytes(dfa)
    # Per state, whether a byte leads back to it: below nodes in states that have none, no subtree is
    # taken whole, and a level with no such node is not tested (a counted string's states never loop).
    other = None if leaving is None else leaving[0]
    loops = None if other is None else (other[0] & other[1] & other[2] & other[3]) != ~np.uint64(0)
    inside = np.zeros(vocab.size, dtype=bool)
    uncertain: list[np.ndarray] = []
    looped: list[tuple[np.ndarray, np.ndarray]] = []  # sorted-vocabulary ranges (start, length) alive throughout
    cur = states.astype(np.int64)
    below = np.zeros(0, dtype=np.int64)  # nodes of this level strictly under an exit node
    for d in range(1, trie.depth + 1):
        eptr, level = trie.end_ptr[d], len(trie.byte[d])
        if d >= NARROW_FROM and len(nodes) + len(below) <= NARROW_NODES:
            ends, exits = walk_on(key, dfa, d, list(zip(nodes.tolist(), cur.tolist())),
                                  [(n, n + 1) for n in below.tolist()], vocab, None)
            for x in ends:
                inside[x] = True
            uncertain += exits
            break
        dense = len(nodes) * DENSE_RATIO > level
        trie.mark_ends(d, nodes, inside, dense)
        if len(below):
            _, idx = expand_ranges(eptr[below], eptr[below + 1] - eptr[below])
            uncertain.append(trie.end_tokens[d][idx])
        # Every token below a node whose state loops on all the bytes under it is alive through its end:
        # inside, so none of them is an exit either (uncertain tokens inside are dropped below).
        loop = None if loops is None or not loops[cur].any() else _looping(d, trie, leaving, nodes, cur)
        if loop is not None and loop.any():
            done = nodes[loop]
            looped.append((first[d][done], count[d][done]))
            nodes, cur = nodes[~loop], cur[~loop]
            if len(below):
                below = below[~np.isin(below, done, kind="table")]
        exiting = nodes[accepting[cur]]
        under = np.union1d(below, exiting) if len(below) and len(exiting) else (below if len(below) else exiting)
        if d == trie.depth or not len(nodes) and not len(under):
            break
        ptr = trie.child_ptr[d + 1]
        _, below = expand_ranges(ptr[under], ptr[under + 1] - ptr[under])
        nodes, cur = trie.step(d + 1, nodes, cur, trans, dense)
    if looped:
        _, at = expand_ranges(*(np.concatenate(x) for x in zip(*looped)))
        inside[sorted_ids[at]] = True
    ids = np.unique(np.concatenate(uncertain)) if uncertain else np.zeros(0, dtype=np.int64)
    return inside, ids[~inside[ids]]


def _looping(d: int, trie: TokenTrie, leaving: tuple[list[np.ndarray], np.ndarray], nodes: np.ndarray,
             cur: np.ndarray) -> np.ndarray:
    """bool per level-d node of `nodes` (in DFA states `cur`): no byte read below it leaves its state, but
    for non-ASCII bytes where the state is transparent and only whole characters lie below (utf8.py)."""
    below, (other, transparent) = trie.subtrees[0][d], leaving
    ascii_out = (below[0][nodes] & other[0][cur]) | (below[1][nodes] & other[1][cur])
    high_out = (below[2][nodes] & other[2][cur]) | (below[3][nodes] & other[3][cur])
    return (ascii_out == 0) & ((high_out == 0) | transparent[cur] & trie.whole_utf8[d][nodes])
