"""Per terminal DFA state, the tokens whose fate does not depend on the parser stack (the XGrammar idea).

From state q of terminal t, a token either stays inside t for all its bytes (allowed whatever follows:
*context-independent*), or passes an accepting state of t before its last byte (it may end t there and
go on in whatever the stack says follows: *uncertain*), or neither (never allowed through t). The first
set is kept as packed bits, the uncertain tokens as a small trie of their own; both are computed once
per (terminal, state, vocabulary) and shared by every grammar using the terminal (JSON strings,
numbers and keys recur across schemas). A parser configuration's mask is then the union of its items'
context-independent bits and a walk of only the uncertain tokens through the configuration.

A bounded string's character boundaries (counted_string.py) are counted instead: their uncertain
tokens are the ones that close the string, and only their bytes after the quote are walked, once per
continuation (pda.py).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from radixlm.core.constrained.counted_string import CountedStringDFA, string_tokens
from radixlm.core.constrained.index import expand_ranges
from radixlm.core.constrained.regex_dfa import ByteDFA
from radixlm.core.constrained.vocab import TokenTrie, TokenVocab

FULL_TRIE_FRACTION = 4  # more uncertain tokens than 1/4 of the vocabulary: walk the whole trie
FEW_TOKENS = 256  # up to this many uncertain tokens are walked one by one (no trie, no numpy steps)
CACHE_SIZE = 8192  # (terminal, state) entries per process; a 151k vocabulary's bits are 19 KB each


@dataclass
class StateTokens:
    inside: np.ndarray  # uint8 packed bits (little bit order) of the context-independent tokens
    uncertain: TokenTrie | None  # a trie holding the tokens that may leave the terminal mid-token
    few: list[int] | None = None  # or, when they are few, their ids (uncertain is then None)
    # Counted string boundaries: packed bits of the tokens that close the string and go on after the
    # quote, and the trie of those bytes after the quote (uncertain is then None).
    closing: np.ndarray | None = None
    after_quote: TokenTrie | None = None


_cache: OrderedDict[tuple, StateTokens] = OrderedDict()
_lock = threading.Lock()


def state_tokens(key: str, dfa: ByteDFA, state: int, vocab: TokenVocab) -> StateTokens:
    """The token classes of `state` in terminal `dfa` (named `key`: equal keys, equal DFAs), cached."""
    if isinstance(dfa, CountedStringDFA) and (written := dfa.written(state)) is not None:
        return _counted(dfa, written, state == 0, vocab)  # a few bitwise operations: not worth a cache entry
    cache_key = (_future(key, dfa, state), vocab.fingerprint)
    with _lock:
        found = _cache.get(cache_key)
        if found is not None:
            _cache.move_to_end(cache_key)
            return found
    inside, uncertain = _classify(dfa, state, vocab)
    few = None
    if not len(uncertain):
        trie = None
    elif len(uncertain) <= FEW_TOKENS:
        trie, few = None, uncertain.tolist()
    elif len(uncertain) > vocab.size // FULL_TRIE_FRACTION:
        trie = vocab.trie  # most of the vocabulary: walking all of it costs no more than a copy of it
    else:
        trie = TokenTrie.build(vocab.token_bytes, uncertain.tolist())
    found = StateTokens(np.packbits(inside, bitorder="little"), trie, few=few)
    with _lock:
        _cache[cache_key] = found
        if len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)
    return found


def _counted(dfa: CountedStringDFA, written: int, opening: bool, vocab: TokenVocab) -> StateTokens:
    strings = string_tokens(vocab, opening)
    room = None if dfa.hi is None else dfa.hi - written
    closing = strings.closing_between(dfa.lo - written, room)
    inside = strings.allowed_inside(room) | (closing & strings.ends_at_quote)
    return StateTokens(inside, None, closing=closing & ~strings.ends_at_quote, after_quote=strings.suffixes)


_futures: dict[tuple[str, int], object] = {}
MAX_FUTURE_STATES = 512  # larger futures are named by (terminal, state) instead


def _future(key: str, dfa: ByteDFA, state: int) -> object:
    """A name for what the DFA can still read from `state`: a hash of the automaton reachable from it,
    its states numbered in breadth-first order. Token classes depend on nothing else, so states of
    different terminals with the same future (a key terminal past the names it excludes and a plain
    string's body, say) share them. Memoized per (terminal, state)."""
    found = _futures.get((key, state))
    if found is not None:
        return found
    trans, accepting = dfa.transitions, dfa.accepting
    order, queue = {state: 0}, [state]
    digest = hashlib.blake2b(digest_size=16)
    i = 0
    while i < len(queue) and len(queue) <= MAX_FUTURE_STATES:
        s = queue[i]
        i += 1
        row = trans[s]
        live = np.flatnonzero(row >= 0)
        targets = row[live].tolist()
        for t in targets:
            if t not in order:
                order[t] = len(queue)
                queue.append(t)
        digest.update(bytes([bool(accepting[s]), len(live) & 255]) + live.astype(np.uint8).tobytes()
                      + np.array([order[t] for t in targets], dtype=np.int32).tobytes())
    found = digest.digest() if len(queue) <= MAX_FUTURE_STATES else (key, state)
    if len(_futures) > 1 << 18:
        _futures.clear()
    _futures[key, state] = found
    return found


_nonempty_cache: dict[str, np.ndarray] = {}


def _nonempty(vocab: TokenVocab) -> np.ndarray:
    found = _nonempty_cache.get(vocab.fingerprint)
    if found is None:
        found = _nonempty_cache[vocab.fingerprint] = np.fromiter(map(len, vocab.token_bytes), np.int64) > 0
    return found


def _classify(dfa: ByteDFA, state: int, vocab: TokenVocab) -> tuple[np.ndarray, np.ndarray]:
    """(bool [vocab]: tokens alive in the DFA through their last byte, ids of the tokens strictly below
    a trie node where the DFA accepts). Level by level, following live nodes and nodes below an exit."""
    trie = vocab.trie
    trans, accepting = dfa.transitions, dfa.accepting
    inside = np.zeros(vocab.size, dtype=bool)
    uncertain: list[np.ndarray] = []
    nodes, cur = np.zeros(1, dtype=np.int64), np.array([state], dtype=np.int64)
    below = np.zeros(0, dtype=np.int64)  # nodes of the previous level at or under an exit node
    everything = bool(accepting[state])  # the terminal may end before any byte: every token is uncertain
    for d in range(1, trie.depth + 1):
        ptr, eptr = trie.child_ptr[d], trie.end_ptr[d]
        if len(below) and not everything:
            _, below = expand_ranges(ptr[below], ptr[below + 1] - ptr[below])
            _, idx = expand_ranges(eptr[below], eptr[below + 1] - eptr[below])
            uncertain.append(trie.end_tokens[d][idx])
        if len(nodes):
            parent, child = expand_ranges(ptr[nodes], ptr[nodes + 1] - ptr[nodes])
            nxt = trans[cur[parent], trie.byte[d][child]]
            keep = nxt >= 0
            nodes, cur = child[keep], nxt[keep].astype(np.int64)
            _, idx = expand_ranges(eptr[nodes], eptr[nodes + 1] - eptr[nodes])
            inside[trie.end_tokens[d][idx]] = True
            exits = nodes[accepting[cur]]
            if len(exits) and not everything:
                below = np.union1d(below, exits)
                # Candidates are walked anyway: past a quarter of a level, take them all.
                everything = len(below) * FULL_TRIE_FRACTION > len(trie.byte[d])
        if not len(nodes) and not len(below):
            break
    if everything:
        return inside, np.flatnonzero(~inside & _nonempty(vocab))
    ids = np.unique(np.concatenate(uncertain)) if uncertain else np.zeros(0, dtype=np.int64)
    return inside, ids[~inside[ids]]
