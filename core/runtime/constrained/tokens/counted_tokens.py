"""The token classes of a counted string's states (counted_string.py), counted rather than walked.

At a character boundary with i characters written, the tokens that stay inside are "at most hi - i
characters" and those that close the string are the ones with lo - i to hi - i characters before the
quote (cumulated bitsets, StringTokens); one byte into a character (a UTF-8 sequence or an escape begun),
the same read of the few thousand tokens that can go on from there (InnerTokens). No token writes more
characters than it has bytes, so bounds further away than that are told apart no further: the classes
are cached per (characters still needed, room left) up to that horizon, and a string of 32,767
characters costs what one of 200 does, whatever its position.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from radixlm.core.runtime.constrained.tokens.counted_string import CountedStringDFA, inner_tokens, string_tokens
from radixlm.core.runtime.constrained.tokens.token_classes import Exits, StateTokens, state_classes
from radixlm.core.runtime.constrained.tokens.vocab import TokenVocab, set_bits

CACHE_SIZE = 1024  # (vocabulary, place, bounds) entries; a boundary's are 19 KB of bits each (Qwen2)

_cache: OrderedDict[tuple, StateTokens] = OrderedDict()
_exits: dict[tuple, Exits | None] = {}
_lock = threading.Lock()


def counted_state_tokens(dfa: CountedStringDFA, state: int, vocab: TokenVocab) -> StateTokens | None:
    """The classes of `state` of a counted string; None for its final state (past the closing quote)."""
    if state >= dfa.num_states - 1:
        return None
    written, slot = divmod(max(state - 1, 0), dfa.width)
    opening = state == 0
    top = (string_tokens(vocab, opening).max_count if slot == 0 else vocab.trie.depth) + 1
    need = min(max(dfa.lo - written, 0), top)
    room = None if dfa.hi is None or dfa.hi - written > top else dfa.hi - written
    key = (vocab.fingerprint, opening, slot, need, room)
    with _lock:
        found = _cache.get(key)
        if found is not None:
            _cache.move_to_end(key)
            return found
    found = _boundary(vocab, opening, need, room) if slot == 0 else _inner(vocab, slot, need, room)
    with _lock:
        _cache[key] = found
        if len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)
    return found


def _boundary(vocab: TokenVocab, opening: bool, need: int, room: int | None) -> StateTokens:
    """At a character boundary: a few operations on 19 KB bitsets (~20 µs)."""
    strings = string_tokens(vocab, opening)
    closing = strings.closing_between(need, room)
    inside = strings.allowed_inside(room) | (closing & strings.ends_at_quote)
    return state_classes(inside, closing=closing & ~strings.ends_at_quote, after_quote=quote_exits(vocab, opening))


def _inner(vocab: TokenVocab, slot: int, need: int, room: int | None) -> StateTokens:
    """Inside a character: the ids of the few thousand tokens that go on from there."""
    reads = inner_tokens(vocab, slot)
    closing = np.zeros(-(-vocab.size // 8), dtype=np.uint8)
    set_bits(closing, reads.closing(need, room))
    return state_classes(None, inside_ids=reads.inside(need, room), closing=closing,
                       after_quote=_inner_exits(vocab, slot))


def _inner_exits(vocab: TokenVocab, slot: int) -> Exits | None:
    """The bytes after the quote of the tokens that close the string from `slot` and go on, as exits."""
    key = (vocab.fingerprint, "inside", slot)
    if key not in _exits:
        reads = inner_tokens(vocab, slot)
        going_on = np.flatnonzero(reads.closes & ~reads.ends_at_quote).tolist()
        found = None if not going_on else Exits.build(reads.ids[going_on].tolist(),
                                                      [reads.after_quote[n] for n in going_on])
        with _lock:
            _exits.setdefault(key, found)
    return _exits[key]


def quote_exits(vocab: TokenVocab, opening: bool) -> Exits | None:
    """The bytes after the closing quote of the tokens that close a string from a character boundary and go
    on (counted_string.py's suffix trie, read back as exits), cached per vocabulary."""
    key = (vocab.fingerprint, "opening" if opening else "boundary")
    if key not in _exits:
        found, trie = None, string_tokens(vocab, opening).suffixes
        if trie is not None:
            tokens = [int(i) for d in range(1, trie.depth + 1) for i in trie.end_tokens[d]]
            lengths = [d for d in range(1, trie.depth + 1) for _ in range(len(trie.end_tokens[d]))]
            found = Exits.build(tokens, [vocab.token_bytes[i][-n:] for i, n in zip(tokens, lengths)])
        with _lock:
            _exits.setdefault(key, found)
    return _exits[key]
