"""Bounded JSON strings (minLength / maxLength) as one terminal whose token classes are counted, not walked.

The terminal is `"`, between lo and hi JSON string characters, `"`; its DFA is the product of one
character's DFA (UTF-8 and escapes, json_lexical.STRING_CHAR) with a counter of the characters written,
built directly (no regex): state 1 + i * width + j is "i characters written, j bytes into the next one".
Every character position is a state of its own, so walking the vocabulary from each (what the general
token classes of terminal_tokens.py do) would cost milliseconds per position. Instead each token is
read once per vocabulary, from a character boundary, as a string body: how many whole characters it
writes before it ends, stops inside a character, or closes the string with `"`. From a boundary with i
characters written, the tokens that stay inside are then "at most hi - i characters" (one lookup in
bitsets cumulated by count), and the tokens that close the string and go on after it are the ones whose
count lies in [lo - i, hi - i] and whose bytes after the quote the continuation takes (computed once per
continuation by the parser, pda.py).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import numpy as np

from radixlm.core.runtime.constrained.automata import json_lexical
from radixlm.core.runtime.constrained.tokens.counted_table import CountedTable
from radixlm.core.runtime.constrained.automata.regex_dfa import ByteDFA, regex_to_dfa
from radixlm.core.runtime.constrained.tokens.vocab import TokenTrie, TokenVocab, byte_matrix

QUOTE = ord('"')
_PURE, _PARTIAL, _CLOSED, _BAD = 0, 1, 2, 3  # token kinds, read from a character boundary


@dataclass(frozen=True)
class CountedStringDFA(ByteDFA):
    """The DFA of `"` + lo..hi string characters + `"` (hi None: unbounded), with its layout."""

    lo: int
    hi: int | None
    width: int  # states per character position: the character DFA's non-accepting states

    def written(self, state: int) -> int | None:
        """The characters written at `state` if it is a character boundary inside the string (0 before the
        opening quote too), else None."""
        s = max(state - 1, 0)
        cap = self.lo if self.hi is None else self.hi
        if s < 0 or s % self.width or s // self.width > cap or state >= self.num_states - 1:
            return None
        return s // self.width

    @property
    def stored(self) -> bool:
        """Whether the move table is stored (else computed from the state number: a long string)."""
        return isinstance(self.transitions, np.ndarray)


@functools.lru_cache(maxsize=1)
def _char_dfa() -> ByteDFA:
    return regex_to_dfa(json_lexical.STRING_CHAR)


def counted_states(lo: int, hi: int | None) -> int:
    """How many states counted_string_dfa(lo, hi) has (to check a budget before building it)."""
    width = int((~_char_dfa().accepting).sum())
    return 1 + (lo if hi is None else hi) * width + (width if hi is None else 1) + 1


# Past this many states a counted string's table is computed from the state number (counted_table.py), not
# stored: 8,192 states are ~540 characters and 8 MB of table.
STORED_STATES = 8192


@functools.lru_cache(maxsize=16)  # stored tables: 8 MB each at most
def counted_string_dfa(lo: int, hi: int | None) -> CountedStringDFA:
    """The DFA of a JSON string of lo..hi characters, quotes included (hi None: at least lo)."""
    char = _char_dfa()
    inner = np.flatnonzero(~char.accepting)  # the character DFA's states before its end, start first
    assert inner[0] == 0 and char.accepting.sum() == 1
    width = len(inner)
    slot = np.full(char.num_states, -1, dtype=np.int64)
    slot[inner] = np.arange(width)
    done = int(np.flatnonzero(char.accepting)[0])
    step = char.transitions[inner]  # [width, 256]
    n = counted_states(lo, hi)
    accepting = np.zeros(n, dtype=bool)
    accepting[n - 1] = True
    table = CountedTable(np.where(step >= 0, slot[np.maximum(step, 0)], -1), step == done, lo, hi, n)
    if n > STORED_STATES:
        return CountedStringDFA(transitions=table, accepting=accepting, lo=lo, hi=hi, width=width)
    return CountedStringDFA(transitions=table.stored(), accepting=accepting, lo=lo, hi=hi, width=width)


@dataclass(eq=False)
class StringTokens:
    """Every token of a vocabulary read as a string body from a character boundary, as packed bitsets
    cumulated by count: inside[c] = the tokens that stay in a string with room for c more characters;
    closing[c] = the tokens that close the string after at most c characters (their bytes after the
    quote, if any, are the suffix trie's). closing_exact[c] is closing[c] minus those below c."""

    inside: np.ndarray  # uint8 [max_count + 1, bytes]
    closing: np.ndarray  # uint8 [max_count + 1, bytes]
    ends_at_quote: np.ndarray  # uint8 [bytes]: closing tokens whose last byte is the quote
    suffixes: TokenTrie | None  # the bytes after the quote of the other closing tokens, under their ids

    @property
    def max_count(self) -> int:
        return self.inside.shape[0] - 1

    def allowed_inside(self, room: int | None) -> np.ndarray:
        return self.inside[self.max_count if room is None else min(room, self.max_count)]

    def closing_between(self, lo: int, hi: int | None) -> np.ndarray:
        """Packed: the closing tokens with between lo and hi characters before the quote."""
        top = self.closing[self.max_count if hi is None else min(hi, self.max_count)]
        return top if lo <= 0 else top & ~self.closing[min(lo - 1, self.max_count)]


_tokens: dict[tuple[str, bool], StringTokens] = {}
_lock = threading.Lock()


def string_tokens(vocab: TokenVocab, opening: bool = False) -> StringTokens:
    """The vocabulary read as string bodies from a character boundary, or with `opening` from before the
    opening quote (tokens that do not start with one are never allowed there); cached per vocabulary
    (grammar_index_cache.prepare_vocab reads it when an engine starts)."""
    key = (vocab.fingerprint, opening)
    with _lock:
        found = _tokens.get(key)
        if found is None:
            found = _tokens[key] = _read_tokens(vocab.token_bytes, opening)
    if not opening:
        inner_tokens(vocab, 1)  # and from inside a character, with it: a mask never waits for them
    return found


def _read_tokens(token_bytes: list[bytes], opening: bool) -> StringTokens:
    """All tokens read from a character boundary (empty tokens, and with `opening` those without a leading
    quote, are never allowed; the quote is skipped), as cumulated bitsets."""
    mat, lens = byte_matrix(token_bytes)
    skip = int(opening)
    allowed = (lens > 0) & (mat[:, 0] == QUOTE) if opening else lens > 0
    mat, lens = mat[:, skip:], np.maximum(lens - skip, 0)
    kind, count, quote_at = _read(mat, lens, allowed, 0)
    need = np.where(kind == _PARTIAL, count + 1, count)  # a partial character needs room for itself
    top = int(need[kind != _BAD].max(initial=0))
    by_count = np.arange(top + 1)[:, None]
    inside = ((kind == _PURE) | (kind == _PARTIAL))[None, :] & (need[None, :] <= by_count)
    closing = (kind == _CLOSED)[None, :] & (count[None, :] <= by_count)
    pack = functools.partial(np.packbits, bitorder="little", axis=-1)
    ends = (kind == _CLOSED) & (quote_at == lens - 1)
    tails = np.flatnonzero((kind == _CLOSED) & ~ends)
    suffix_bytes = [b""] * len(token_bytes)
    for t in tails.tolist():
        suffix_bytes[t] = token_bytes[t][skip + quote_at[t] + 1:]
    suffixes = TokenTrie.build(suffix_bytes, tails.tolist()) if len(tails) else None
    return StringTokens(pack(inside), pack(closing), pack(ends), suffixes)


def _read(mat: np.ndarray, lens: np.ndarray, allowed: np.ndarray, start: int) -> tuple[np.ndarray, ...]:
    """Every allowed token (rows of `mat`, `lens` bytes each) through the character DFA from its state
    `start`, one byte position per numpy step: (kind, whole characters written before the token ends or
    closes the string, where the closing quote is (-1 if none))."""
    char = _char_dfa()
    done = int(np.flatnonzero(char.accepting)[0])
    size = len(lens)
    kind = np.where(allowed, _PURE, _BAD)
    state = np.full(size, start, dtype=np.int64)
    count = np.zeros(size, dtype=np.int64)
    quote_at = np.full(size, -1, dtype=np.int64)
    live = np.flatnonzero(allowed)
    for d in range(mat.shape[1]):
        live = live[(d < lens[live]) & (kind[live] == _PURE)]  # the tokens still being read
        if not len(live):
            break
        b = mat[live, d]
        closes = (state[live] == 0) & (b == QUOTE)
        kind[live[closes]] = _CLOSED
        quote_at[live[closes]] = d
        live, b = live[~closes], b[~closes]
        nxt = char.transitions[state[live], b]
        kind[live[nxt < 0]] = _BAD
        whole = nxt == done
        count[live[whole]] += 1
        state[live] = np.where(whole | (nxt < 0), 0, nxt)
    kind[(kind == _PURE) & (state != 0)] = _PARTIAL
    return kind, count, quote_at


@dataclass(eq=False)
class InnerTokens:
    """The tokens that read on from one byte inside a character (a UTF-8 sequence or an escape begun), as
    ids: a few thousand (those starting with a continuation byte, or an escape's rest), so kept sparse.
    Per token: the characters it needs room for (the one begun included), whether it closes the string,
    and the characters before its quote."""

    ids: np.ndarray  # int64, sorted: the tokens not dead from this byte
    need: np.ndarray  # room needed to stay inside (tokens that close: the characters before the quote)
    closes: np.ndarray  # bool: the token closes the string
    ends_at_quote: np.ndarray  # bool: ... with its last byte
    after_quote: list[bytes]  # per token: its bytes after the quote (b"" if none)

    def inside(self, need: int, room: int | None) -> np.ndarray:
        """Ids of the tokens that stay in the string or end it with its quote, from a place where `need`
        more characters are needed and `room` are left (None: no bound)."""
        fits = self.need <= (self.need.max(initial=0) if room is None else room)
        return self.ids[fits & (~self.closes | self.ends_at_quote & (self.need >= need))]

    def closing(self, need: int, room: int | None) -> np.ndarray:
        """Ids of the tokens that close the string within the bounds and go on after the quote."""
        fits = self.need <= (self.need.max(initial=0) if room is None else room)
        return self.ids[fits & self.closes & ~self.ends_at_quote & (self.need >= need)]


_inner: dict[str, list[InnerTokens]] = {}


def inner_tokens(vocab: TokenVocab, slot: int) -> InnerTokens:
    """The vocabulary read from `slot` bytes into a character (slot >= 1: counted state 1 + i * width +
    slot); every slot's built together, once per vocabulary (with string_tokens, where constraints are
    built: a mask never waits for them)."""
    with _lock:
        found = _inner.get(vocab.fingerprint)
    if found is None:
        char = _char_dfa()
        mat, lens = byte_matrix(vocab.token_bytes)
        found = []
        for start in np.flatnonzero(~char.accepting).tolist():
            ids = np.flatnonzero((lens > 0) & (char.transitions[start, mat[:, 0]] >= 0))  # a few thousand
            kind, count, quote_at = _read(mat[ids], lens[ids], np.ones(len(ids), dtype=bool), start)
            alive = kind != _BAD
            ids, kind, count, quote_at, n = ids[alive], kind[alive], count[alive], quote_at[alive], lens[ids][alive]
            closes = kind == _CLOSED
            after = [vocab.token_bytes[t][q + 1:] for t, q in zip(ids.tolist(), quote_at.tolist())]
            found.append(InnerTokens(ids, np.where(kind == _PARTIAL, count + 1, count), closes,
                                     closes & (quote_at == n - 1), after))
        with _lock:
            found = _inner.setdefault(vocab.fingerprint, found)
    return found[slot]
