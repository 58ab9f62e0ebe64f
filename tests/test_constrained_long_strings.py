"""Long counted strings (maxLength 32767): their moves computed from the state number (counted_table.py)
and their token classes counted per place (counted_tokens.py), checked against the stored table, a walk
of the vocabulary trie through the automaton, and a brute-force reading of JSON strings in Python, token
by token over Qwen2's 151k vocabulary along real text. (Mask times: benchmarks/bench_long_strings.py.)"""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

import radixlm.core.runtime.constrained.tokens.counted_string as counted_string
from radixlm.core.runtime.constrained import build_constraint
from radixlm.core.runtime.constrained.tokens import terminal_tokens, trie_walk
from radixlm.core.runtime.constrained.tokens.counted_table import CountedTable
from radixlm.core.runtime.constrained.tokens.token_classes import AFTER_QUOTE, CLOSING, INSIDE, INSIDE_IDS
from radixlm.core.runtime.constrained.grammar_index_cache import prepare_vocab
from radixlm.testing.constrained import qwen2_tokenizer

TEXT = ('Die Straße führt nach Zürich; 日本語のテキストと絵文字 😀🎉, "quoted", back\\slash, tab\tand\nnewline, '
        'Ελληνικά, العربية, ꙮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \u2028 end.')


@pytest.mark.parametrize("lo, hi", [(0, 3), (2, 4), (3, None), (0, None), (5, 5), (0, 40), (7, None)])
def test_computed_moves_equal_the_stored_table(lo, hi):
    """Every way the parser and the walks index a table (a move, a row, rows, broadcast moves)."""
    stored = counted_string.counted_string_dfa(lo, hi)
    assert stored.stored
    n = stored.num_states
    lazy = _lazy(lo, hi)
    assert len(lazy) == n and lazy.shape == (n, 256)
    assert np.array_equal(lazy[np.arange(n)], stored.transitions)
    assert all(lazy[q, b] == stored.transitions[q, b] for q in range(n) for b in range(256))
    rng = np.random.default_rng(0)
    states, data = rng.integers(0, n, 64), rng.integers(0, 256, 64)
    assert np.array_equal(lazy[states, data], stored.transitions[states, data])
    assert np.array_equal(lazy[3 % n, data], stored.transitions[3 % n, data])
    assert np.array_equal(lazy[states[:, None], data[None, :]], stored.transitions[states[:, None], data[None, :]])


def _lazy(lo: int, hi: int | None) -> CountedTable:
    """The computed table of counted_string_dfa(lo, hi), however short."""
    saved = counted_string.STORED_STATES
    counted_string.STORED_STATES = 0
    try:
        return counted_string.counted_string_dfa.__wrapped__(lo, hi).transitions
    finally:
        counted_string.STORED_STATES = saved


def test_a_long_string_is_not_stored():
    dfa = counted_string.counted_string_dfa(0, 32767)
    assert not dfa.stored and dfa.num_states > 400_000
    assert dfa.fullmatch(json.dumps("x" * 32767)) and not dfa.fullmatch(json.dumps("x" * 32768))
    bmp = "".join(c for c in TEXT if ord(c) < 0x10000)  # \\u escapes of surrogates are never generated
    assert dfa.fullmatch(json.dumps(TEXT, ensure_ascii=False)) and dfa.fullmatch(json.dumps(bmp))


@pytest.fixture(scope="module")
def qwen2():
    tokenizer = qwen2_tokenizer()
    return tokenizer, prepare_vocab(tokenizer)


def _walked(dfa, state, vocab):
    """The oracle for one terminal state: a walk of the vocabulary trie through the automaton's moves
    (terminal_tokens' level-wise walk): inside tokens, and the (token, suffix after the closing quote) exits."""
    first = vocab.trie.byte[1].astype(np.int64)
    nxt = dfa.transitions[state, first]
    live = np.flatnonzero(nxt >= 0)
    alive, uncertain = trie_walk.walk_trie(f"walk:{dfa.lo}:{dfa.hi}", dfa, live, nxt[live], vocab)
    tokens, starts = terminal_tokens._exit_pairs(dfa, uncertain, terminal_tokens._after_first(nxt, live, vocab, uncertain),
                                                 vocab)
    inside = set(np.flatnonzero(alive).tolist())
    exits = {(t, vocab.token_bytes[t][j:]) for t, j in zip(tokens.tolist(), starts.tolist())}
    return inside, exits


def _counted(dfa, state, vocab):
    classes = terminal_tokens.state_tokens(f"counted:{dfa.lo}:{dfa.hi}", dfa, state, vocab)
    inside = classes[INSIDE_IDS].tolist() if classes[INSIDE] is None else \
        np.flatnonzero(np.unpackbits(classes[INSIDE], count=vocab.size, bitorder="little")).tolist()
    closing = np.unpackbits(classes[CLOSING], count=vocab.size, bitorder="little")
    exits = set()
    if classes[AFTER_QUOTE] is not None:
        suffixes = classes[AFTER_QUOTE].tree.suffixes
        exits = {(t, suffixes[s]) for s, t in zip(classes[AFTER_QUOTE].pair_suffix.tolist(),
                                                   classes[AFTER_QUOTE].pair_token.tolist()) if closing[t]}
    return set(inside), exits


@pytest.mark.parametrize("lo, hi, positions", [
    (0, 32767, [0, 1, 5000, 32767 - 300, 32767 - 129, 32767 - 40, 32767 - 1, 32767]),
    (700, 900, [0, 560, 690, 699, 700, 850, 899, 900]),
    (3, None, [0, 1, 2, 3]),
])
def test_counted_classes_equal_a_walk_of_the_vocabulary(lo, hi, positions, qwen2):
    """At character boundaries and one byte into a character (after `\\`, inside a 2-, 3- and 4-byte
    UTF-8 sequence), near the bounds and far from them."""
    _, vocab = qwen2
    dfa = counted_string.counted_string_dfa(lo, hi)
    width = dfa.width
    slots = [0, width - 1] + [j for j in (1, 2, 5, 9) if j < width]
    for i in positions:
        for j in slots:
            state = 1 + i * width + j
            if dfa.transitions[state] .max() < 0 and j:  # no such state (past hi only the boundary)
                continue
            assert _counted(dfa, state, vocab) == _walked(dfa, state, vocab), (i, j)
    assert _counted(dfa, 0, vocab) == _walked(dfa, 0, vocab)


class _Oracle:
    """Which tokens may follow a prefix of `{"text":"..."}` whose string has lo..hi characters, read from
    the bytes in Python: UTF-8, escapes (no `\\u` of a surrogate: never generated), control characters,
    characters counted as jsonschema counts them (code points)."""

    HEAD = b'{"text":"'

    def __init__(self, lo: int, hi: int | None) -> None:
        self.lo, self.hi = lo, hi

    def mask(self, prefix: bytes, token_bytes: list[bytes]) -> np.ndarray:
        """bool [vocabulary]: the tokens after which the output is still a prefix of a valid document."""
        if len(prefix) <= len(self.HEAD):
            return np.array([bool(t) and self.viable(prefix + t) for t in token_bytes])
        count, tail = self._boundary(prefix[len(self.HEAD):])
        if tail.startswith(b'"'):  # the string is closed: only the rest of `}` may follow
            return np.array([bool(t) and b"}".startswith(tail[1:] + t) for t in token_bytes]) & self._body(tail, count)
        return np.array([bool(t) and self._body(tail + t, count) for t in token_bytes])

    def viable(self, data: bytes) -> bool:
        if len(data) <= len(self.HEAD):
            return self.HEAD.startswith(data)
        return data.startswith(self.HEAD) and self._body(data[len(self.HEAD):], 0)

    def _boundary(self, body: bytes) -> tuple[int, bytes]:
        """(characters, bytes after the last character boundary) of a string body without its quote."""
        count, i = 0, 0
        while True:
            n = self._char(body, i)
            if n <= 0 or i + n > len(body) or body[i] == 0x22:  # the closing quote is no character
                return count, body[i:]
            i, count = i + n, count + 1

    def _char(self, body: bytes, i: int) -> int:
        """The byte length of the character at body[i] (read from its first bytes), 0 if it is none."""
        b = body[i] if i < len(body) else -1
        if b == 0x5C:
            return 6 if body[i + 1:i + 2] == b"u" else 2
        return 1 if 0x20 <= b < 0x80 else 2 if 0xC2 <= b < 0xE0 else 3 if 0xE0 <= b < 0xF0 else 4 if 0xF0 <= b < 0xF5 \
            else 0

    def _body(self, body: bytes, count: int) -> bool:
        i = 0
        while i < len(body):
            if body[i] == 0x22:  # the closing quote
                return self.lo <= count and self._room(count) and b"}".startswith(body[i + 1:])
            n = self._char(body, i)
            chunk = body[i:i + n]
            if not n or not self._valid_start(chunk):
                return False
            if len(chunk) < n:
                return self._room(count + 1)
            i, count = i + n, count + 1
        return self._room(count)

    @staticmethod
    def _valid_start(chunk: bytes) -> bool:
        """Whether `chunk` begins a character as JSON strings write it (the first bytes of one at least)."""
        if chunk[0] == 0x5C:
            esc = chunk[1:2]
            if not esc or esc in b'"\\/bfnrt':
                return True
            digits = chunk[2:].decode("latin-1")
            surrogate = len(digits) >= 2 and digits[0] in "dD" and digits[1] in "89abcdefABCDEF"
            return esc == b"u" and all(c in "0123456789abcdefABCDEF" for c in digits) and not surrogate
        try:
            chunk.decode("utf-8")
        except UnicodeDecodeError as e:
            return e.reason == "unexpected end of data"
        return True

    def _room(self, count: int) -> bool:
        return self.hi is None or count <= self.hi


@pytest.mark.parametrize("lo, hi, text", [
    (0, 32767, TEXT * 3),
    (620, 650, (TEXT * 6)[:640]),  # a computed table too (650 characters: over 8,192 states), near both bounds
])
def test_masks_along_real_text_equal_a_brute_force_reading(lo, hi, text, qwen2):
    tokenizer, vocab = qwen2
    schema = {"type": "object", "properties": {"text": {"type": "string", "minLength": lo, "maxLength": hi}},
              "required": ["text"], "additionalProperties": False}
    doc = json.dumps({"text": text}, separators=(",", ":"), ensure_ascii=False)
    jsonschema.validate(json.loads(doc), schema)
    ids = tokenizer.encode(doc, add_special_tokens=False)
    constraint = build_constraint("json_schema", schema, tokenizer)
    oracle, token_bytes = _Oracle(lo, hi), vocab.token_bytes
    ends = np.cumsum([len(token_bytes[t]) for t in ids])
    inside_character = [n + 1 for n, end in enumerate(ends[:-1]) if _mid_character(doc.encode()[:end])]
    checked = set(range(0, len(ids), max(len(ids) // 5, 1))) | set(inside_character[:4]) | {len(ids) - 2, len(ids) - 1}
    prefix = b""
    for n, token in enumerate(ids):
        if n in checked:
            mask = constraint.allowed_token_mask(len(tokenizer))[:vocab.size].numpy()
            want = oracle.mask(prefix, token_bytes)
            assert np.array_equal(mask, want), (n, prefix[-20:], np.flatnonzero(mask != want)[:10])
        constraint.advance(token)
        prefix += token_bytes[token]
    assert inside_character, "the text splits no character between tokens: it tests no state inside one"
    assert prefix == doc.encode() and constraint.index.is_accepting(constraint.state)
    assert len(checked) >= 6


def _mid_character(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def test_one_character_past_max_length_is_refused(qwen2):
    """The closing quote is refused after 32,768 characters and allowed after 32,767."""
    tokenizer, vocab = qwen2
    schema = {"type": "string", "maxLength": 32767}
    body = ("Straße 日本 " * 4000)[:32767]
    constraint = build_constraint("json_schema", schema, tokenizer)
    quote = tokenizer.encode('"', add_special_tokens=False)[0]
    letter = tokenizer.encode("x", add_special_tokens=False)[0]
    for token in tokenizer.encode('"' + body[:-1], add_special_tokens=False):
        constraint.advance(token)
    mask = constraint.allowed_token_mask(len(tokenizer))
    assert mask[quote] and mask[letter]  # 32,766 characters written
    constraint.advance(letter)
    mask = constraint.allowed_token_mask(len(tokenizer))
    assert mask[quote] and not mask[letter]  # 32,767
    assert np.flatnonzero(mask[:vocab.size].numpy()).tolist() == [t for t in range(vocab.size)
                                                                   if vocab.token_bytes[t].startswith(b'"')
                                                                   and len(vocab.token_bytes[t]) == 1]


def test_positions_sharing_their_classes_share_masks_that_equal_a_brute_force_reading(qwen2):
    """Every position of a long string is a configuration of its own, whose classes repeat: their bits
    are computed once per signature (pda.GrammarIndex._allowed_bits) and must still be each position's."""
    tokenizer, vocab = qwen2
    schema = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 32767}},
              "required": ["text"], "additionalProperties": False}
    doc = json.dumps({"text": TEXT * 2}, separators=(",", ":"), ensure_ascii=False)
    ids = tokenizer.encode(doc, add_special_tokens=False)
    constraint = build_constraint("json_schema", schema, tokenizer)
    oracle, token_bytes, prefix, states = _Oracle(0, 32767), vocab.token_bytes, b"", set()
    for n, token in enumerate(ids[:-2]):
        mask = constraint.allowed_token_mask(len(tokenizer))[:vocab.size].numpy()
        states.add(constraint.state)
        if n in (30, 31, 60, len(ids) - 3):
            assert np.array_equal(mask, oracle.mask(prefix, token_bytes)), n
        constraint.advance(token)
        prefix += token_bytes[token]
    assert len(constraint.index._same_pieces) < len(states) // 2  # most masks came from shared bits
