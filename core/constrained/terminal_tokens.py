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
from radixlm.core.constrained.regex_dfa import ByteDFA
from radixlm.core.constrained.vocab import TokenTrie, TokenVocab, expand_ranges

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
    inside, uncertain = _classify(key, dfa, state, vocab)
    few = None
    if not len(uncertain):
        trie = None
    elif len(uncertain) <= FEW_TOKENS:
        trie, few = None, uncertain.tolist()
    elif len(uncertain) > vocab.size // FULL_TRIE_FRACTION:
        trie = vocab.trie  # most of the vocabulary: walking all of it costs no more than a copy of it
    else:
        trie = _trie_of(uncertain, vocab)
    found = StateTokens(np.packbits(inside, bitorder="little"), trie, few=few)
    with _lock:
        _cache[cache_key] = found
        if len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)
    return found


_tries: OrderedDict[tuple, TokenTrie] = OrderedDict()
TRIES = 256


def _trie_of(ids: np.ndarray, vocab: TokenVocab) -> TokenTrie:
    """The trie of tokens `ids`, shared by the states with the same uncertain tokens (a string body's
    states past different excluded key names all have the tokens with a quote inside, say)."""
    key = (hashlib.blake2b(np.sort(ids).astype(np.int64).tobytes(), digest_size=16).digest(), vocab.fingerprint)
    with _lock:
        found = _tries.get(key)
        if found is not None:
            _tries.move_to_end(key)
            return found
    found = TokenTrie.build(vocab.token_bytes, ids.tolist())
    with _lock:
        _tries[key] = found
        if len(_tries) > TRIES:
            _tries.popitem(last=False)
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


# Per (future of the state after first byte x, x, vocabulary): (ids of the tokens starting with x that stay
# inside, ids of those that may leave the terminal mid-token). Most of a state's first bytes lead where
# other states' do (a key terminal past the names it excludes is a plain string's body), so a state met
# for the first time walks only the subtrees of the first bytes whose future is new.
_subtrees: OrderedDict[tuple, tuple[np.ndarray, np.ndarray]] = OrderedDict()
_subtree_ids = 0  # ids held by _subtrees, bounded by SUBTREE_IDS
SUBTREE_IDS = 16_000_000  # 64 MB of int32 ids


def _classify(key: str, dfa: ByteDFA, state: int, vocab: TokenVocab) -> tuple[np.ndarray, np.ndarray]:
    """(bool [vocab]: tokens alive in the DFA through their last byte, ids of the tokens that pass an
    accepting state before their last byte), from `state`."""
    trie = vocab.trie
    first_bytes = trie.byte[1].astype(np.int64)  # the byte of each level-1 node
    nxt = dfa.transitions[state, first_bytes]
    if dfa.accepting[state]:  # the terminal may end before any byte: every token may leave it
        inside, _ = _walk(dfa, np.flatnonzero(nxt >= 0), nxt[nxt >= 0], vocab)
        return inside, np.flatnonzero(~inside & _nonempty(vocab))
    futures = {q: _future(key, dfa, q) for q in set(nxt.tolist()) if q >= 0}
    keys = {n: (futures[q], int(first_bytes[n]), vocab.fingerprint) for n, q in enumerate(nxt.tolist()) if q >= 0}
    with _lock:
        have = {}
        for n, k in keys.items():
            if k in _subtrees:
                _subtrees.move_to_end(k)
                have[n] = _subtrees[k]
    missing = np.array([n for n in keys if n not in have], dtype=np.int64)
    if len(missing):
        inside, uncertain = _walk(dfa, missing, nxt[missing], vocab)
        have.update(_store({int(n): keys[int(n)] for n in missing}, inside, uncertain, vocab))
    inside = np.zeros(vocab.size, dtype=bool)
    if have:
        inside[np.concatenate([ins for ins, _ in have.values()])] = True
        return inside, np.concatenate([unc for _, unc in have.values()])
    return inside, np.zeros(0, dtype=np.int64)


def _store(keys: dict[int, tuple], inside: np.ndarray, uncertain: np.ndarray,
           vocab: TokenVocab) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """A walk's result split by level-1 node (the tokens' first byte), kept in _subtrees and returned."""
    global _subtree_ids
    nodes = np.fromiter(keys, np.int64, count=len(keys))
    ins, unc = _split(np.flatnonzero(inside), nodes, vocab), _split(uncertain, nodes, vocab)
    out = {n: (a, b) for n, a, b in zip(keys, ins, unc)}
    with _lock:
        for n, k in keys.items():
            if k not in _subtrees:
                _subtrees[k] = out[n]
                _subtree_ids += len(out[n][0]) + len(out[n][1])
        while _subtree_ids > SUBTREE_IDS and _subtrees:
            ins, unc = _subtrees.popitem(last=False)[1]
            _subtree_ids -= len(ins) + len(unc)
    return out


def _split(ids: np.ndarray, nodes: np.ndarray, vocab: TokenVocab) -> list[np.ndarray]:
    """`ids` (sorted token ids) grouped by the level-1 node they start at, one group per node of `nodes`."""
    owner = _first_node(vocab)[ids]
    order = np.argsort(owner, kind="stable")
    ids, owner = ids[order].astype(np.int32), owner[order]
    bounds = zip(np.searchsorted(owner, nodes).tolist(), np.searchsorted(owner, nodes, side="right").tolist())
    return [ids[a:b] for a, b in bounds]


_first_nodes: dict[str, np.ndarray] = {}


def _first_node(vocab: TokenVocab) -> np.ndarray:
    """int64 [vocab]: the level-1 trie node each token starts at (-1 for empty tokens)."""
    found = _first_nodes.get(vocab.fingerprint)
    if found is None:
        index = np.full(256, -1, dtype=np.int64)
        index[vocab.trie.byte[1]] = np.arange(len(vocab.trie.byte[1]))
        first = np.fromiter((b[0] if b else 0 for b in vocab.token_bytes), np.int64, count=vocab.size)
        found = _first_nodes[vocab.fingerprint] = np.where(_nonempty(vocab), index[first], -1)
    return found


def _walk(dfa: ByteDFA, nodes: np.ndarray, states: np.ndarray, vocab: TokenVocab) -> tuple[np.ndarray, np.ndarray]:
    """From level-1 trie nodes `nodes` in DFA states `states`: (bool [vocab]: tokens below them alive
    through their last byte, ids of tokens strictly below a node where the DFA accepts). Level by level,
    following live nodes and the nodes under an exit."""
    trie = vocab.trie
    trans, accepting = dfa.transitions, dfa.accepting
    inside = np.zeros(vocab.size, dtype=bool)
    uncertain: list[np.ndarray] = []
    cur = states.astype(np.int64)
    below = np.zeros(0, dtype=np.int64)  # nodes of this level strictly under an exit node
    for d in range(1, trie.depth + 1):
        eptr = trie.end_ptr[d]
        _, idx = expand_ranges(eptr[nodes], eptr[nodes + 1] - eptr[nodes])
        inside[trie.end_tokens[d][idx]] = True
        if len(below):
            _, idx = expand_ranges(eptr[below], eptr[below + 1] - eptr[below])
            uncertain.append(trie.end_tokens[d][idx])
        under = np.union1d(below, nodes[accepting[cur]])  # this level's nodes at or under an exit
        if d == trie.depth or not len(nodes) and not len(under):
            break
        ptr = trie.child_ptr[d + 1]
        _, below = expand_ranges(ptr[under], ptr[under + 1] - ptr[under])
        parent, child = expand_ranges(ptr[nodes], ptr[nodes + 1] - ptr[nodes])
        nxt = trans[cur[parent], trie.byte[d + 1][child]]
        keep = nxt >= 0
        nodes, cur = child[keep], nxt[keep].astype(np.int64)
    ids = np.unique(np.concatenate(uncertain)) if uncertain else np.zeros(0, dtype=np.int64)
    return inside, ids[~inside[ids]]
