"""Per terminal DFA state, the tokens whose fate does not depend on the parser stack (the XGrammar idea).

From state q of terminal t, a token either stays inside t for all its bytes (allowed whatever follows:
*context-independent*), or passes an accepting state of t after j >= 1 of its bytes (it may end t there
and go on in whatever the stack says follows: an *exit*), or neither (never allowed through t). The
first set is kept as packed bits; the exits as the distinct suffixes the tokens leave t with (the token
`1,"` leaves a number with `,"`), each with the tokens that have it. Both are computed once per
(terminal, state, vocabulary) and shared by every grammar using the terminal (JSON strings, numbers and
keys recur across schemas). A parser configuration's mask is then the union of its items'
context-independent bits and, per item, the tokens whose suffix the configuration after t's end takes
(pda.py): that configuration depends on the item's continuation alone, so only suffixes are walked
there, once per (state's exits, continuation), never the bytes inside t (XGrammar's context expansion).
Exits at j = 0 (t may end before the token) need nothing here: a configuration is closed, so it holds
what follows t's end as items of its own.

A counted string's states (counted_string.py) are counted instead (counted_tokens.py): their exits are
the tokens that close the string, and only their bytes after the quote are walked, once per continuation
(pda.py).
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterable

import numpy as np

from radixlm.core.runtime.constrained.tokens.body_states import (body_of, bytes_apart, loops, paths_apart, read_from, tokens_starting,
                                                  tokens_with)
from radixlm.core.runtime.constrained.tokens.counted_string import CountedStringDFA
from radixlm.core.runtime.constrained.tokens.counted_tokens import counted_state_tokens
from radixlm.core.runtime.constrained.tokens.literal_tokens import literal_classes, literal_rest
from radixlm.core.runtime.constrained.tokens.first_nodes import first_node, masked_by_node, split_by_node
from radixlm.core.runtime.constrained.tokens.narrow_walk import NARROW_NODES, narrow_walk, state_row
from radixlm.core.runtime.constrained.automata.regex_dfa import ByteDFA
from radixlm.core.runtime.constrained.tokens.token_classes import (CLOSING, EXITS, INSIDE, Exits, StateTokens,
                                                                   exits_replacing, state_classes)
from radixlm.core.runtime.constrained.tokens.token_walk import walk_tokens
from radixlm.core.runtime.constrained.tokens.trie_walk import other_bytes, walk_trie
from radixlm.core.runtime.constrained.tokens.vocab import TokenVocab, byte_matrix, clear_bits, set_bits

CACHE_SIZE = 8192  # (terminal, state) entries per process; a 151k vocabulary's bits are 19 KB each


_cache: OrderedDict[tuple, StateTokens] = OrderedDict()
_lock = threading.Lock()


def state_tokens(key: str, dfa: ByteDFA, state: int, vocab: TokenVocab) -> StateTokens:
    """The token classes of `state` in terminal `dfa` (named `key`: equal keys, equal DFAs), cached."""
    if isinstance(dfa, CountedStringDFA) and (found := counted_state_tokens(dfa, state, vocab)) is not None:
        return found
    named = (key, state, vocab.fingerprint)
    found = _cached(named)
    if found is not None:
        return found
    rest = literal_rest(key, dfa, state)
    if rest is not None:
        found = _literals([rest], vocab)[0]
    else:
        # A small future is named and shared by that name (states of different terminals end alike); a
        # larger one only if the state is wide (_classify): a bounded number's ~50 states hashed for each
        # of its states would cost more than walking it. A state that reads many bytes is wide: _classify
        # names its future whole, or patches its body's classes (a key past its names' letters), so a
        # search that stops past SMALL_FUTURE states would be spent for nothing.
        reads_many = len(state_row(key, dfa, state)[1]) > NARROW_NODES
        future = None if reads_many else _future(key, dfa, state, SMALL_FUTURE)
        found = _cached((future, vocab.fingerprint)) if future is not None else None
        if found is None:
            found = _classify(key, dfa, state, vocab)
            if future is not None:
                _keep((future, vocab.fingerprint), found)
    _keep(named, found)
    return found


def states_tokens(states: list[tuple[str, ByteDFA, int]], vocab: TokenVocab) -> list[StateTokens]:
    """state_tokens of each (key, dfa, state), the literal states not yet met classified together: a
    configuration of an enum's hundreds of strings pays one batch, not a call chain per string (~12 µs
    each, ~6 ms in a first mask). States met before are read off the cache under one lock."""
    found = [counted_state_tokens(dfa, state, vocab) if isinstance(dfa, CountedStringDFA) else None
             for _, dfa, state in states]  # a counted string's positions first, as state_tokens reads them
    missing = [n for n, classes in enumerate(found) if classes is None]
    if not missing:
        return found
    names = {n: (states[n][0], states[n][2], vocab.fingerprint) for n in missing}
    for n, classes in zip(names, _cached_all(list(names.values()))):
        found[n] = classes
    at_rest: dict[bytes, list[int]] = {}  # the positions of each literal rest (equal rests, equal classes)
    for n in missing:
        if found[n] is None:
            key, dfa, state = states[n]
            rest = literal_rest(key, dfa, state)
            if rest is None:
                found[n] = state_tokens(key, dfa, state, vocab)
            else:
                at_rest.setdefault(rest, []).append(n)
    if at_rest:
        for classes, at in zip(_literals(list(at_rest), vocab), at_rest.values()):
            for n in at:
                found[n] = classes
        _keep_all((names[n], found[n]) for at in at_rest.values() for n in at)
    return found


def _literals(rests: list[bytes], vocab: TokenVocab) -> list[StateTokens]:
    """The classes of literals' states with `rests` left to read (literal_tokens.py), shared per rest."""
    names = [("literal", rest, vocab.fingerprint) for rest in rests]
    found = _cached_all(names)
    missing = [n for n, classes in enumerate(found) if classes is None]
    if not missing:
        return found
    for n, (inside, tokens, starts) in zip(missing, literal_classes([rests[n] for n in missing], vocab)):
        found[n] = state_classes(None, _exits(names[n], tokens, starts, vocab), inside_ids=inside)
    _keep_all((names[n], found[n]) for n in missing)
    return found


def _cached(cache_key: tuple) -> StateTokens | None:
    return _cached_all([cache_key])[0]


def _cached_all(cache_keys: list[tuple]) -> list[StateTokens | None]:
    """Each key's entry (None where absent), read under one lock."""
    with _lock:
        found = [_cache.get(cache_key) for cache_key in cache_keys]
        for cache_key, classes in zip(cache_keys, found):
            if classes is not None:
                _cache.move_to_end(cache_key)
        return found


def _keep(cache_key: tuple, found: StateTokens) -> None:
    _keep_all([(cache_key, found)])


def _keep_all(entries: Iterable[tuple[tuple, StateTokens]]) -> None:
    with _lock:
        for cache_key, found in entries:
            _cache[cache_key] = found
        while len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)


def _packed(ids: np.ndarray, size: int) -> np.ndarray:
    """Packed bits (little bit order) of token `ids` among `size`: set one by one when they are few."""
    if len(ids) * 16 < size:
        packed = np.zeros(-(-size // 8), dtype=np.uint8)
        set_bits(packed, ids)
        return packed
    inside = np.zeros(size, dtype=bool)
    inside[ids] = True
    return np.packbits(inside, bitorder="little")


_exits_cache: OrderedDict[tuple, Exits] = OrderedDict()


def _exits(key: tuple, tokens: np.ndarray, starts: np.ndarray, vocab: TokenVocab) -> Exits | None:
    """The Exits of pairs (token, where its suffix starts), named by `key` (the subtrees they come from:
    states whose exits come from the same subtrees share them, and their walks in pda.py), cached."""
    if not len(tokens):
        return None
    with _lock:
        found = _exits_cache.get(key)
        if found is not None:
            _exits_cache.move_to_end(key)
            return found
    token_bytes = vocab.token_bytes
    tokens = tokens.tolist()
    found = Exits.build(tokens, [token_bytes[i][j:] for i, j in zip(tokens, starts.tolist())])
    with _lock:
        _exits_cache[key] = found
        if len(_exits_cache) > CACHE_SIZE:
            _exits_cache.popitem(last=False)
    return found


def _exit_pairs(dfa: ByteDFA, ids: np.ndarray, states: np.ndarray, vocab: TokenVocab) -> tuple[np.ndarray, np.ndarray]:
    """(token, j) for every position j >= 1 where the DFA, alive so far, accepts before the token's end,
    for tokens `ids` in DFA states `states` after their first byte. One numpy step per byte position,
    over all the tokens at once."""
    if not len(ids):
        return np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int32)
    mat, lens = byte_matrix([vocab.token_bytes[i] for i in ids.tolist()])
    alive, cur = np.arange(len(ids)), states.astype(np.int64)  # rows still in the DFA, and their states
    rows, cols = [np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=np.int32)]
    for j in range(1, mat.shape[1]):
        keep = (cur >= 0) & (lens[alive] > j)
        alive, cur = alive[keep], cur[keep]
        if not len(alive):  # every token dead or read: the longest ones (whitespace runs) step no further
            break
        at = alive[dfa.accepting[cur]]
        rows.append(at)
        cols.append(np.full(len(at), j, dtype=np.int32))
        cur = dfa.transitions[cur, mat[alive, j]].astype(np.int64)
    rows = np.concatenate(rows)
    return ids[rows].astype(np.int32), np.concatenate(cols)


_futures: dict[tuple[str, int], bytes | int] = {}  # a name, or the number of states it is known to exceed
# Larger futures are named by (terminal, state) instead: naming one is a search of its states (~2 µs each),
# and a wide state's first visit names every state its first bytes lead to (in a pattern key's DFA of
# hundreds of states, ~5-10 ms of searches); equal large futures of different terminals are rare.
MAX_FUTURE_STATES = 24
SMALL_FUTURE = 4  # futures named before a state is known to be wide


def _future(key: str, dfa: ByteDFA, state: int, most: int = MAX_FUTURE_STATES) -> bytes | None:
    """A name for what the DFA can still read from `state`: a hash of the automaton reachable from it,
    its states numbered in breadth-first order; None if over `most` states are reachable and it was not
    named before. Token classes depend on nothing else, so states of different terminals with the same
    future (a key terminal past the names it excludes and a plain string's body, say) share them.
    Memoized per (terminal, state)."""
    found = _futures.get((key, state))
    if isinstance(found, bytes) or found is not None and found >= most:
        return found if isinstance(found, bytes) else None
    order, queue = {state: 0}, [state]
    digest = hashlib.blake2b(digest_size=16)
    i = 0
    while i < len(queue) and len(queue) <= most:
        record, distinct = _row_shape(key, dfa, queue[i])
        i += 1
        for t in distinct:
            if t not in order:
                order[t] = len(queue)
                queue.append(t)
        digest.update(record + array("i", [order[t] for t in distinct]).tobytes())
    found = digest.digest() if len(queue) <= most else None
    if len(_futures) > 1 << 18:
        _futures.clear()
    _futures[key, state] = most if found is None else found
    return found


_row_shapes: dict[tuple[str, int], tuple[bytes, tuple[int, ...]]] = {}


def _row_shape(key: str, dfa: ByteDFA, state: int) -> tuple[bytes, tuple[int, ...]]:
    """(the state's row as bytes: number of live bytes, accepting, the live bytes, and per live byte the
    rank of its target among the distinct targets; the distinct targets in order of first use). A string
    body's ~200 moves go to a handful of states: a search numbers those, not every move."""
    found = _row_shapes.get((key, state))
    if found is None:
        head, targets = state_row(key, dfa, state)
        rank: dict[int, int] = {}
        shape = bytes(rank.setdefault(t, len(rank)) for t in targets)
        if len(_row_shapes) > 1 << 16:  # ~0.5 KB each at most (a string body state)
            _row_shapes.clear()
        found = _row_shapes[key, state] = (len(targets).to_bytes(2, "little") + head + shape, tuple(rank))
    return found


# Per (future of the state after first byte x, x, vocabulary): (ids of the tokens starting with x that stay
# inside, and the exits of those that may leave the terminal mid-token: token ids and where their suffix
# starts). Most of a state's first bytes lead where other states' do (a key terminal past the names it
# excludes is a plain string's body), so a state met for the first time walks only the subtrees of the
# first bytes whose future is new.
_subtrees: OrderedDict[tuple, tuple[np.ndarray, np.ndarray, np.ndarray]] = OrderedDict()
_subtree_ids = 0  # ids held by _subtrees, bounded by SUBTREE_IDS
SUBTREE_IDS = 16_000_000  # 64 MB of int32 ids


def _classify(key: str, dfa: ByteDFA, state: int, vocab: TokenVocab) -> StateTokens:
    """The token classes of `state`. A state few tokens follow (a literal, a number) is walked whole. A
    wide state (a string body) is shared by its future with every state that has it, whatever its
    terminal (a key past its excluded names and a plain string), and is built from per-first-byte
    subtrees shared the same way."""
    trie = vocab.trie
    first_bytes = trie.byte[1].astype(np.int64)  # the byte of each level-1 node
    nxt = dfa.transitions[state, first_bytes]
    live = np.flatnonzero(nxt >= 0)
    walked = narrow_walk(key, dfa, live, nxt[live], vocab)
    if walked is not None:
        inside, uncertain = walked
        tokens, starts = _exit_pairs(dfa, uncertain, _after_first(nxt, live, vocab, uncertain), vocab)
        exits_key = (_future(key, dfa, state, SMALL_FUTURE) or (key, state), vocab.fingerprint)
        return state_classes(_packed(inside, vocab.size), _exits(exits_key, tokens, starts, vocab))
    found = _patched(key, dfa, state, vocab)
    if found is not None:
        return found
    # A future of a few states (a string body's) is often known. A pattern key's state before its match
    # reaches every state of its terminal (no name): it is read again first.
    future = _future(key, dfa, state)
    found = _cached((future, vocab.fingerprint)) if future is not None else None
    if found is None:
        found = _reread(key, dfa, state, vocab)
    if found is not None:
        if future is not None:
            _keep((future, vocab.fingerprint), found)
        return found
    shared = (future or (key, state), vocab.fingerprint)
    found = _cached(shared)
    if found is None:
        have, keys = _wide(key, dfa, state, nxt, live, vocab)
        nodes = sorted(have)
        exits_key = tuple(keys[n] for n in nodes if len(have[n][1]))
        tokens, starts = (np.concatenate([have[n][i] for n in nodes] or [np.zeros(0, np.int32)]) for i in (1, 2))
        found = state_classes(_inside_bits(have, keys, vocab), _exits(exits_key, tokens, starts, vocab))
    _keep(shared, found)
    return found


_apart: OrderedDict[tuple, tuple[StateTokens, StateTokens]] = OrderedDict()  # see _patched
APART = 512  # 19 KB of bits each (Qwen2)


def _patched(key: str, dfa: ByteDFA, state: int, vocab: TokenVocab) -> StateTokens | None:
    """A state that is its terminal's string body except along a few paths (a key past letters of the names
    it excludes, body_states.py): the body's classes less the tokens that die on those paths; None if it is
    not such a state. Kept per (body's classes, paths), so terminals that exclude alike share them and
    their exit walks (pda.py)."""
    body = body_of(key, dfa, state)
    dying = None if body is None else paths_apart(key, dfa, state, body, vocab)
    if dying is None:
        return None
    base = state_tokens(key, dfa, body, vocab)
    if base[INSIDE] is None or base[CLOSING] is not None:
        return None
    if not dying:
        return base
    shared = (id(base), dying)
    with _lock:
        found = _apart.get(shared)
    if found is not None and found[0] is base:  # an id is the base's while the entry holds it
        return found[1]
    apart = tokens_starting(vocab, dying)
    inside, exits = base[INSIDE].copy(), base[EXITS]
    clear_bits(inside, apart)
    if exits is not None:
        keep = ~np.isin(exits.pair_token, apart, kind="table")  # ids < vocabulary: ~10x the default sort
        if not keep.all():
            exits = Exits(exits.tree, exits.pair_suffix[keep], exits.pair_token[keep]) if keep.any() else None
    found = state_classes(inside, exits)
    with _lock:
        _apart[shared] = (base, found)
        if len(_apart) > APART:
            _apart.popitem(last=False)
    return found


def _reread(key: str, dfa: ByteDFA, state: int, vocab: TokenVocab) -> StateTokens | None:
    """A wide state that reads like another state of its terminal except on a few bytes (a pattern key
    before its pattern has matched, like its state after: a string body, except on `"`): that state's
    classes, when known, with the tokens containing those bytes read again from this one (body_states.py);
    None if no such state is found. A walk of the whole vocabulary is ~10 ms."""
    for other in loops(key, dfa, state):
        bad = bytes_apart(dfa, state, other)
        again = None if bad is None else tokens_with(vocab, bad)
        base = None if again is None else _known(key, dfa, other, vocab)
        if base is None or base[INSIDE] is None or base[CLOSING] is not None:
            continue
        ids = again[0]
        inside, tokens, starts = read_from(dfa, state, again)
        bits = base[INSIDE].copy()
        clear_bits(bits, ids)
        set_bits(bits, inside)
        return state_classes(bits, exits_replacing(base[EXITS], ids, tokens, starts, vocab))
    return None


def _known(key: str, dfa: ByteDFA, state: int, vocab: TokenVocab) -> StateTokens | None:
    """The state's classes if they are cached, by its name or its future; None rather than a walk."""
    found = _cached((key, state, vocab.fingerprint))
    if found is None:
        future = _future(key, dfa, state)
        found = _cached((future, vocab.fingerprint)) if future is not None else None
    return found


# The last wide states built: (their subtree per level-1 node and its name, their inside bits). A key terminal
# past one letter of its excluded names differs from a plain string body in that letter's subtree alone, so
# its bits are the body's with that subtree's tokens changed, not ~150k ids packed anew (~300 µs).
_bases: list[tuple[dict[int, tuple], dict[int, tuple], np.ndarray]] = []
BASES = 4


def _inside_bits(have: dict[int, tuple], keys: dict[int, tuple], vocab: TokenVocab) -> np.ndarray:
    """Packed bits of the inside tokens of the subtrees `have` (per level-1 node, named by `keys`): a recent
    wide state's bits with the differing subtrees' tokens cleared and set, when they are few."""
    total = sum(len(x[0]) for x in have.values())
    best, fewest, best_changed = None, total // 4, set()  # patching over a quarter of the ids costs a pack
    with _lock:
        bases = list(_bases)
    for base in bases:
        base_have, base_keys, _ = base
        changed = {n for n, _ in keys.items() ^ base_keys.items()}  # nodes whose subtree differs, or is missing
        ids = sum(len(base_have[n][0]) if n in base_have else 0 for n in changed)
        ids += sum(len(have[n][0]) if n in have else 0 for n in changed)
        if ids < fewest:
            best, fewest, best_changed = base, ids, changed
    if best is None:
        packed = _packed(np.concatenate([have[n][0] for n in sorted(have)] or [np.zeros(0, np.int32)]), vocab.size)
    else:
        base_have, _, packed = best
        packed = packed.copy()
        gone = [base_have[n][0] for n in best_changed if n in base_have]
        if gone:
            clear_bits(packed, np.concatenate(gone).astype(np.int64))
        new = [have[n][0] for n in best_changed if n in have]
        if new:
            set_bits(packed, np.concatenate(new).astype(np.int64))
    with _lock:
        _bases.insert(0, (have, keys, packed))
        del _bases[BASES:]
    return packed


def _wide(key: str, dfa: ByteDFA, state: int, nxt: np.ndarray, live: np.ndarray,
          vocab: TokenVocab) -> tuple[dict[int, tuple], dict[int, tuple]]:
    """From `state` (nxt: the state after each level-1 trie node's byte, live: the nodes where it is
    alive), per level-1 node: (ids of the tokens below it alive in the DFA through their last byte; the
    exits of the other tokens that pass an accepting state after their first byte and before their last,
    as token ids and the positions where they may leave), and the subtree's name. Most of a state's first
    bytes lead where other states' do, so only the subtrees of first bytes whose future is new are
    walked."""
    first_bytes = vocab.trie.byte[1].astype(np.int64)
    futures = {q: _future(key, dfa, q) or (key, q) for q in set(nxt[live].tolist())}
    keys = {n: (futures[q], b, vocab.fingerprint) for n, q, b in
            zip(live.tolist(), nxt[live].tolist(), first_bytes[live].tolist())}
    with _lock:
        have = {}
        for n, k in keys.items():
            if k in _subtrees:
                _subtrees.move_to_end(k)
                have[n] = _subtrees[k]
    missing = np.array([n for n in keys if n not in have], dtype=np.int64)
    if len(missing):
        walked = narrow_walk(key, dfa, missing, nxt[missing], vocab)
        if walked is None:
            leaving = other_bytes(dfa)  # a token at a time where the state's loops decide most, else down the trie
            walked = None if leaving is None else walk_tokens(dfa, state, missing, *leaving, vocab)
            walked = walked or walk_trie(key, dfa, missing, nxt[missing], vocab)
        inside, uncertain = walked
        tokens, starts = _exit_pairs(dfa, uncertain, _after_first(nxt, missing, vocab, uncertain), vocab)
        have.update(_store({int(n): keys[int(n)] for n in missing}, inside, tokens, starts, vocab))
    return have, keys


def _after_first(nxt: np.ndarray, nodes: np.ndarray, vocab: TokenVocab, ids: np.ndarray) -> np.ndarray:
    """The DFA state after the first byte of each token of `ids` (below level-1 `nodes`; nxt: the state
    after each level-1 node's byte)."""
    if not len(ids):  # most narrow states: no token leaves mid-way
        return np.zeros(0, dtype=np.int64)
    after = np.full(len(nxt), -1, dtype=np.int64)
    after[nodes] = nxt[nodes]
    return after[first_node(vocab)[ids]]


def _store(keys: dict[int, tuple], inside: np.ndarray, tokens: np.ndarray, starts: np.ndarray,
           vocab: TokenVocab) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """A walk's result (the inside tokens: their ids, or a bool [vocab] mask of them; exit pairs) split by
    level-1 node (the tokens' first byte), kept in _subtrees and returned."""
    global _subtree_ids
    nodes = np.fromiter(keys, np.int64, count=len(keys))
    if inside.dtype == bool:  # a wide walk's ~150k: grouped through the ids kept in node order, not sorted
        ins = masked_by_node(inside, nodes, vocab)
    if len(nodes) == 1:  # one first byte (a literal, a narrow walk's usual case): nothing to split
        ins = ins if inside.dtype == bool else [inside.astype(np.int32)]
        exit_tokens, exit_starts = [tokens], [starts]
    else:
        ins = ins if inside.dtype == bool else split_by_node(inside, nodes, vocab)[0]
        exit_tokens, exit_starts = split_by_node(tokens, nodes, vocab, starts)
    out = {n: (a, b, c) for n, a, b, c in zip(keys, ins, exit_tokens, exit_starts)}
    with _lock:
        for n, k in keys.items():
            if k not in _subtrees:
                _subtrees[k] = out[n]
                _subtree_ids += len(out[n][0]) + 2 * len(out[n][1])
        while _subtree_ids > SUBTREE_IDS and _subtrees:
            ins, exit_tokens, _ = _subtrees.popitem(last=False)[1]
            _subtree_ids -= len(ins) + 2 * len(exit_tokens)
    return out
