"""The grammar engine's token masks on regexes: equal to outlines-core's Index, to a per-token brute force
through the regex's DFA, and to the tokenizer's own decoding; the batch mask helper."""

from __future__ import annotations

import re

import numpy as np
import outlines_core
import pytest
import torch

from radixlm.core.runtime.constrained import (apply_token_masks, build_constraint, grammar_to_regex,
                                              json_schema_to_grammar, regex_to_dfa)
from radixlm.core.runtime.constrained.tokens.masks import unpack_bitmask
from radixlm.testing.constrained import qwen2_tokenizer, random_walk
from radixlm.core.runtime.constrained.tokens.vocab import token_bytes_of, vocab_of

# Regexes on which the two dialects agree: no \d, \w, \s, \b (Unicode tables differ), and no accepting
# state that a longer match could leave through a non-accepting one. outlines-core builds its index with
# leftmost-first match semantics, which in such states drops those continuations: after "Par" in
# (Paris|Par|Parma|Pa) it forbids "ma", after "0" in a JSON number it forbids ".", after "α" in [α-ω]+ a
# token holding only the first byte of the next letter. Python's fullmatch allows all of them.
SHARED_DIALECT = [
    r"((25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])",
    r"(19|20)[0-9][0-9]-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    r"[a-zA-Z0-9._%+-]+@[a-zA-Z0-9-]+\.(com|org|net)",
    r'\{"name": "[^"]{1,10}", "age": [0-9]{1,3}\}',
    r'"([^"\\]|\\.)*"',
    r"(Paris|London|Lisbon|Porto)",
    r"[α-ω]{1,3}!",
    r"a[^!]{0,3}z!",
    r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?;",
    r"(true|false|null)",
    r"[\U0001F600-\U0001F64F]{1,2} ok",
    r"[^a-z]{2}",
    r"\[([0-9]+(, [0-9]+)*)?\]",
    grammar_to_regex(json_schema_to_grammar({"type": "object", "properties": {"id": {"type": "integer"}, "tags": {
        "type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2}}, "required": ["id"]})),
]
QWEN_SHARED_DIALECT = [SHARED_DIALECT[i] for i in (0, 1, 4, 5, 6, 10, 12)]


@pytest.fixture(scope="module")
def tiny_tokenizer(tokenizer_path):
    """The test checkpoints' byte-level BPE tokenizer (1000 tokens)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(tokenizer_path)


def _sentencepiece_tokenizer(byte_fallback: bool):
    """A small Llama-2-style tokenizer: `▁` for spaces, <0xNN> byte-fallback tokens, Strip decoder."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    if byte_fallback:
        vocab |= {f"<0x{i:02X}>": 3 + i for i in range(256)}
    pieces = list("▁abcdefghijklmnopqrstuvwxyz.,0123456789") + ["▁t", "he", "▁the", "▁a", "▁c", "at", "▁cat"]
    for p in pieces:
        vocab.setdefault(p, len(vocab))
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "a"), ("▁", "c"), ("a", "t"), ("▁c", "at")]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=byte_fallback, unk_token="<unk>"))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def _index(pattern: str, tokenizer):
    """The grammar engine's index of `pattern` (a configuration id per state, 0 = the start)."""
    return build_constraint("regex", pattern, tokenizer).index


def _reached(index, limit: int = 60) -> list[int]:
    """Configurations reached from the start by allowed tokens, breadth first (at most `limit`)."""
    seen, queue = [0], [0]
    while queue and len(seen) < limit:
        state = queue.pop(0)
        for t in index.allowed_tokens(state).tolist():
            nxt = index.next_state(state, t)
            if nxt not in seen and len(seen) < limit:
                seen.append(nxt)
                queue.append(nxt)
    return seen


def _compare_with_outlines(pattern: str, tokenizer) -> int:
    """Pairs our states with outlines-core's by following the same tokens from both initial states and
    asserts equal allowed-token sets (EOS included) in every pair. Returns the number of states compared."""
    vocab = vocab_of(tokenizer)
    ours = _index(pattern, tokenizer)
    eos = vocab.eos_ids[0]
    by_bytes: dict[bytes, list[int]] = {}
    for i, b in enumerate(vocab.token_bytes):
        if b and i != eos:
            by_bytes.setdefault(b, []).append(i)
    theirs = outlines_core.Index(pattern, outlines_core.Vocabulary(eos, by_bytes))
    transitions = theirs.get_transitions()
    ours_of = {theirs.get_initial_state(): 0}
    queue = [theirs.get_initial_state()]
    while queue:
        t_state = queue.pop()
        o_state = ours_of[t_state]
        t_moves = transitions.get(t_state, {})
        expected = set(t_moves)
        got = set(ours.allowed_tokens(o_state).tolist()) | ({eos} if ours.is_accepting(o_state) else set())
        assert got == expected, (pattern, sorted(got ^ expected)[:10])
        assert ours.is_accepting(o_state) == theirs.is_final_state(t_state)
        for token, t_next in t_moves.items():
            if token != eos and t_next not in ours_of:
                ours_of[t_next] = ours.next_state(o_state, token)
                queue.append(t_next)
    return len(ours_of)


@pytest.mark.parametrize("pattern", SHARED_DIALECT)
def test_equals_outlines_core_index(pattern, tiny_tokenizer):
    assert _compare_with_outlines(pattern, tiny_tokenizer) > 1


@pytest.mark.parametrize("pattern", QWEN_SHARED_DIALECT)
def test_equals_outlines_core_index_qwen_vocab(pattern):
    assert _compare_with_outlines(pattern, qwen2_tokenizer()) > 1


@pytest.mark.parametrize("pattern", SHARED_DIALECT + [r"\w+ \d", r"(?i)straße"])
def test_equals_per_token_brute_force(pattern, tiny_tokenizer):
    """Every reached configuration allows what walking each token's bytes one by one through the regex's
    own minimal DFA (regex_dfa.py, no trie, no parser) gives, and accepts where that DFA accepts."""
    vocab = vocab_of(tiny_tokenizer)
    index, dfa = _index(pattern, tiny_tokenizer), regex_to_dfa(pattern)
    pairs, queue = {0: 0}, [0]  # configuration -> the DFA state after the same tokens
    while queue and len(pairs) < 80:
        state = queue.pop(0)
        q = pairs[state]
        brute = [t for t, b in enumerate(vocab.token_bytes) if b and dfa.walk(b, q) >= 0]
        np.testing.assert_array_equal(index.allowed_tokens(state), brute)
        assert index.is_accepting(state) == bool(dfa.accepting[q])
        for t in brute[:: max(1, len(brute) // 20)]:
            nxt = index.next_state(state, t)
            if nxt not in pairs:
                pairs[nxt] = dfa.walk(vocab.token_bytes[t], q)
                queue.append(nxt)


def test_token_bytes_match_decoding_byte_level(tiny_tokenizer):
    for tokenizer in (tiny_tokenizer, qwen2_tokenizer()):
        token_bytes, special = token_bytes_of(tokenizer)
        assert tokenizer.eos_token_id in special and all(token_bytes[i] == b"" for i in special)
        rng = np.random.default_rng(0)
        sample = rng.choice(len(token_bytes), size=min(3000, len(token_bytes)), replace=False)
        ids = [int(i) for i in sample if i not in special]
        for i in ids:
            try:
                text = token_bytes[i].decode()
            except UnicodeDecodeError:  # a piece of a multi-byte character
                continue
            assert tokenizer.decode([int(i)]) == text, i
        # Whole sequences, partial characters included, decode to the joined bytes.
        for _ in range(50):
            seq = [int(i) for i in rng.choice(ids, size=8)]
            joined = b"".join(token_bytes[i] for i in seq).decode(errors="replace")
            assert tokenizer.decode(seq, clean_up_tokenization_spaces=False) == joined


def test_sentencepiece_style_vocab():
    tokenizer = _sentencepiece_tokenizer(byte_fallback=True)
    token_bytes, special = token_bytes_of(tokenizer)
    ids = tokenizer.convert_tokens_to_ids(["▁the", "<0x0A>", "<0xE2>", "a", "</s>", "<s>"])
    assert [token_bytes[i] for i in ids] == [b" the", b"\n", b"\xe2", b"a", b"", b""]
    assert set(ids[-2:]) <= special
    rng = np.random.default_rng(0)
    pattern = r"( the| cat|\n|é){1,4}"
    for _ in range(100):
        c = build_constraint("regex", pattern, tokenizer)
        ids = random_walk(c, rng)
        joined = b"".join(token_bytes[i] for i in ids).decode()
        assert re.fullmatch(pattern, joined)
        # The tokenizer's decoder strips the one leading space; otherwise it writes the same text.
        assert tokenizer.decode(ids) == (joined[1:] if joined.startswith(" ") else joined)


def test_pattern_the_vocabulary_cannot_spell_raises():
    tokenizer = _sentencepiece_tokenizer(byte_fallback=False)  # no 'é' and no byte tokens
    with pytest.raises(ValueError, match="no sequence of this tokenizer's tokens"):
        build_constraint("regex", r"é+", tokenizer)
    # A branch it cannot spell is dropped; the rest still works: no token holds é's bytes, so "cat" is forced.
    c = build_constraint("regex", r"(é|cat)", tokenizer)
    assert c.forced_text() == "cat" and c.index.allowed_tokens(c.state).size > 0


def test_special_tokens_never_allowed_eos_only_when_accepting(tiny_tokenizer):
    vocab_size = len(tiny_tokenizer)
    special = set(tiny_tokenizer.all_special_ids)
    eos = tiny_tokenizer.eos_token_id
    index = _index(r"(.|\n){0,3}", tiny_tokenizer)  # allows every non-special token
    for state in _reached(index):
        mask = index.mask(state, vocab_size).numpy()
        assert not mask[list(special - {eos})].any()
        assert mask[eos] == index.is_accepting(state)


def test_packed_mask_equals_bool_mask_with_padded_vocab(tiny_tokenizer):
    index = _index(r"[a-c]+[0-9]{2}", tiny_tokenizer)
    for vocab_size in (len(tiny_tokenizer), len(tiny_tokenizer) + 24, 1003):
        for state in _reached(index):
            as_bool = index.mask(state, vocab_size)
            packed = index.mask(state, vocab_size, packed=True)
            assert packed.dtype == torch.int32 and packed.shape == (-(-vocab_size // 32),)
            assert torch.equal(unpack_bitmask(packed, vocab_size), as_bool)


def _reference_masked(logits: torch.Tensor, masks: list) -> torch.Tensor:
    out = logits.clone()
    for i, m in enumerate(masks):
        if m is not None:
            for t in range(logits.shape[1]):
                if not bool(m[t]):
                    out[i, t] = float("-inf")
    return out


@pytest.mark.parametrize("rows", [[True, False, True, False], [True] * 3, [False, False], [True] * 10 + [False]])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("rescue", [True, False])
def test_apply_token_masks(rows, packed, rescue, tiny_tokenizer):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    vocab_size = len(tiny_tokenizer) + 8
    index = _index(r"[a-z]{1,3}[0-9]", tiny_tokenizer)
    reached = _reached(index)
    states = [reached[i % len(reached)] for i in range(len(rows))]
    bool_masks = [index.mask(s, vocab_size) if on else None for s, on in zip(states, rows)]
    masks = [index.mask(s, vocab_size, packed=True) if on and packed else m
             for s, on, m in zip(states, rows, bool_masks)]
    logits = torch.randn(len(rows), vocab_size)
    expected = _reference_masked(logits, bool_masks)
    got = apply_token_masks(logits.clone().to(device), masks, rescue_banned_rows=rescue).cpu()
    assert torch.equal(got, expected)


@pytest.mark.parametrize("packed", [False, True])
def test_apply_token_masks_row_with_every_allowed_token_banned(packed, tiny_tokenizer):
    """A bias that put -inf on every allowed token must not leave a row nothing can be sampled from."""
    vocab_size = len(tiny_tokenizer)
    index = _index(r"[0-9]", tiny_tokenizer)
    mask = index.mask(0, vocab_size, packed=packed)
    allowed = index.mask(0, vocab_size)
    logits = torch.randn(2, vocab_size)
    logits[0, allowed] = float("-inf")
    apply_token_masks(logits, [mask, None])
    assert torch.equal(logits[0] == 0, allowed) and torch.isneginf(logits[0][~allowed]).all()
    assert torch.isfinite(logits[1]).all()
