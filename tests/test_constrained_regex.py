"""Regex constraints: Python's `re` is the oracle for the DFA and for every random token walk."""

from __future__ import annotations

import random
import re
import zlib

import numpy as np
import pytest

from radixlm.core.runtime.constrained import build_constraint, regex_to_dfa
from radixlm.testing.constrained import qwen2_tokenizer, random_walk

REGEXES = [
    # IP addresses
    r"((25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])",
    r"(\d{1,3}\.){3}\d{1,3}",
    r"([0-9a-fA-F]{1,4}:){7}[0-9a-fA-F]{1,4}",
    r"(([0-9a-fA-F]{1,4}:){1,7}:|:(:[0-9a-fA-F]{1,4}){1,7}|([0-9a-fA-F]{1,4}:){1,6}:[0-9a-fA-F]{1,4})",
    # dates and times
    r"\d{4}-\d{2}-\d{2}",
    r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    r"([01]?[0-9]|2[0-3]):[0-5][0-9](:[0-5][0-9])?",
    r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)",
    # emails, URLs, identifiers
    r"[a-zA-Z0-9._%+-]+@[a-zA-Z0-9.-]+\.[a-zA-Z]{2,}",
    r"\w+([.-]?\w+)*@\w+([.-]?\w+)*(\.\w{2,3})+",
    r"https?://[a-z0-9.-]+\.[a-z]{2,6}(/[a-zA-Z0-9._~-]*)*",
    r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}",
    r"([0-9A-F]{2}:){5}[0-9A-F]{2}",
    r"[A-Za-z_][A-Za-z0-9_]*",
    r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(-[0-9A-Za-z-]+(\.[0-9A-Za-z-]+)*)?",
    # numbers
    r"-?\d+",
    r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?",
    r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?",
    r"0[xX][0-9a-fA-F]+",
    r"\$\d{1,3}(,\d{3})*(\.\d{2})?",
    r"(100|[1-9]?[0-9])(\.[0-9]{1,2})?%",
    r"\d{5}(-\d{4})?",
    r"\d{4}( \d{4}){3}",
    r"\(\d{3}\) \d{3}-\d{4}",
    r"#([0-9a-fA-F]{3}){1,2}",
    r"[01]{8}",
    r"M{0,3}(CM|CD|D?C{0,3})(XC|XL|L?X{0,3})(IX|IV|V?I{0,3})",
    # JSON fragments
    r'\{"name": "[^"]{1,20}", "age": [0-9]{1,3}\}',
    r"\[(\d+(, \d+)*)?\]",
    r'"([^"\\]|\\.)*"',
    r"(true|false|null)",
    r'"(name|age|city)": ("[a-z]*"|\d+)',
    r'\{("[a-z]{1,8}": (\d+|"[^"\\]{0,6}")(, )?){1,3}\}',
    # unicode classes
    r"[α-ω]+",
    r"[\u4e00-\u9fff]{1,5}",
    r"[\U0001F600-\U0001F64F]+ ok",
    r"[àâçéèêëîïôûùüÿñæœ]+",
    r"\w+",
    r"a\s+b",
    r"\S{1,10}",
    r"\D{2,5}",
    r"[Α-Ωα-ω]{2}\d{2}",
    r"[а-яА-ЯёЁ]+( [а-яА-ЯёЁ]+)?",
    # alternations of literals
    r"(apple|banana|cherry|date|elderberry)",
    r"(Paris|Par|Parma|Pa)",
    r"(Yes|No)\.",
    r"The quick brown fox jumps over the lazy dog\.",
    # operators, flags, anchors
    r"(?i)hello world",
    r"(?s)a.b",
    r"a.{0,5}z",
    r"colou?r",
    r"(ab){2,4}",
    r"((a|b)c)+d",
    r"a.*?b",
    r"^\d+$",
    r"a\tb\\c\.",
    r"[^aeiou\s]{3,8}",
    r"[KQRBN]?[a-h]?[1-8]?x?[a-h][1-8](=[QRBN])?[+#]?",
    r"(- [a-z ]{1,10}\n){1,3}",
    r'("[^"]*"|[^,\n]*)(,("[^"]*"|[^,\n]*)){2}',
    r"(abc)?",
    r"[\x41-\x5a]{3}",
    r"[A-Z][a-z]+( [a-z]+){2,6}\.",
]

# A subset walked with the real 151k vocabulary as well.
QWEN_REGEXES = [REGEXES[i] for i in (0, 3, 5, 8, 17, 27, 33, 35, 36, 43, 46, 57)]


@pytest.mark.parametrize("pattern", ["[ab]*a", "(ab|cd)*e?[0-9]{2,4}"])
def test_minimize_refines_the_rows_themselves_when_hashes_collide(pattern, monkeypatch):
    """Moore's rounds label blocks by hashes; should they collide (forced here: every hash 0, one block),
    minimize sees a partition that does not respect acceptance ("[ab]*a": every state's moves agree) or
    transitions, and refines on the rows themselves: the same minimal DFA, which agrees with re."""
    from radixlm.core.runtime.constrained.automata import dfa_minimize

    want = regex_to_dfa(pattern)
    monkeypatch.setattr(dfa_minimize, "_mixed", lambda h: h * 0)
    got = regex_to_dfa(pattern)
    assert np.array_equal(got.transitions, want.transitions) and np.array_equal(got.accepting, want.accepting)
    for text in ["a", "ba", "ab", "abab", "cd12", "ab1", "e123", "abcde9999", "b"]:
        assert got.fullmatch(text) == (re.fullmatch(pattern, text) is not None), text


def test_one_pass_minimization_of_finite_languages_matches_moore(monkeypatch):
    """A DFA without cycles (a finite language) is minimized in one pass, successors first; Moore's rounds
    (forced here by turning the one pass off) give the same DFAs, byte for byte: every third regex above
    (finite ones and others) and length-bounded products and differences with a counted string. A cyclic
    DFA is left to Moore's rounds."""
    from radixlm.core.runtime.constrained.automata import dfa_minimize
    from radixlm.core.runtime.constrained.automata.dfa_product import dfa_difference, dfa_intersection
    from radixlm.core.runtime.constrained.tokens.counted_string import counted_string_dfa

    def built():
        dfas = [regex_to_dfa(p) for p in REGEXES[::3]]
        counted = counted_string_dfa(2, 40)
        dfas.append(dfa_intersection(regex_to_dfa('"[a-z0-9_]+"'), counted))
        dfas.append(dfa_intersection(regex_to_dfa('"(ab|c)*d?"'), counted))
        dfas.append(dfa_difference(counted, regex_to_dfa('"x[a-z]*"')))
        return dfas

    one_pass = built()
    finite = sum(dfa_minimize._acyclic_blocks(d.transitions, d.accepting) is not None for d in one_pass)
    assert 8 < finite < len(one_pass) - 4  # both ways are exercised
    monkeypatch.setattr(dfa_minimize, "MAX_ACYCLIC_MOVES", 0)
    for got, want in zip(one_pass, built()):
        assert np.array_equal(got.transitions, want.transitions) and np.array_equal(got.accepting, want.accepting)


@pytest.fixture(scope="module")
def tiny_tokenizer(tokenizer_path):
    """The test checkpoints' byte-level BPE tokenizer (1000 tokens)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(tokenizer_path)


def test_enough_regexes():
    assert len(REGEXES) >= 50 and len(set(REGEXES)) == len(REGEXES)


def _alphabet(pattern: str) -> str:
    """Characters a fuzzed string is made of: the pattern's own characters plus some others."""
    return "".join(sorted(set(pattern) | set("aZ09 .-_:\n\"\\é中😀αя٣"))).replace("\x00", "")


@pytest.mark.parametrize("pattern", REGEXES)
def test_dfa_agrees_with_re(pattern):
    """Random strings (and mutations of strings that match) are accepted iff re.fullmatch accepts them."""
    dfa = regex_to_dfa(pattern)
    rng = random.Random(pattern)
    alphabet = _alphabet(pattern)
    compiled = re.compile(pattern)
    for _ in range(400):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        assert dfa.fullmatch(s) == bool(compiled.fullmatch(s)), s


@pytest.mark.parametrize("pattern", REGEXES)
def test_random_walks_fullmatch(pattern, tiny_tokenizer):
    """Hundreds of random token walks through the constraint all decode to a full match."""
    rng = np.random.default_rng(zlib.crc32(pattern.encode()))
    vocab_size = len(tiny_tokenizer)
    eos = tiny_tokenizer.eos_token_id
    for i in range(200):
        constraint = build_constraint("regex", pattern, tiny_tokenizer)
        ids = random_walk(constraint, rng)
        text = tiny_tokenizer.decode(ids, clean_up_tokenization_spaces=False)
        assert re.fullmatch(pattern, text), (text, ids)
        if i % 20 == 0:  # the mask says the same as the index, EOS exactly where accepting
            mask = constraint.allowed_token_mask(vocab_size).numpy()
            assert mask[eos]
            expected = np.zeros(vocab_size, dtype=bool)
            expected[constraint.index.allowed_tokens(constraint.state)] = True
            expected[eos] = True
            np.testing.assert_array_equal(mask, expected)


@pytest.mark.parametrize("pattern", QWEN_REGEXES)
def test_random_walks_fullmatch_qwen_vocab(pattern):
    tokenizer = qwen2_tokenizer()
    rng = np.random.default_rng(zlib.crc32(pattern.encode()))
    for _ in range(30):
        constraint = build_constraint("regex", pattern, tokenizer)
        ids = random_walk(constraint, rng, max_tokens=24)
        text = tokenizer.decode(ids)
        assert re.fullmatch(pattern, text), (text, ids)


def _feed(constraint, tokenizer, text: str) -> None:
    for t in tokenizer.encode(text, add_special_tokens=False):
        constraint.advance(t)


def test_eos_only_in_accepting_states(tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id
    c = build_constraint("regex", r"ab(c)?", tiny_tokenizer)
    assert not c.allowed_token_mask(len(tiny_tokenizer))[eos]
    with pytest.raises(ValueError, match="EOS"):
        c.advance(eos)
    _feed(c, tiny_tokenizer, "ab")
    assert c.allowed_token_mask(len(tiny_tokenizer))[eos] and not c.is_finished()
    _feed(c, tiny_tokenizer, "c")
    assert c.is_finished()  # nothing but the end can follow
    mask = c.allowed_token_mask(len(tiny_tokenizer))
    assert mask.sum() == 1 and mask[eos]
    c.advance(eos)
    assert c.is_finished()


def test_disallowed_token_raises(tiny_tokenizer):
    c = build_constraint("regex", r"[0-9]+", tiny_tokenizer)
    letter = tiny_tokenizer.convert_tokens_to_ids("a")
    assert not c.allowed_token_mask(len(tiny_tokenizer))[letter]
    with pytest.raises(ValueError, match="not allowed"):
        c.advance(letter)


@pytest.mark.parametrize("pattern, construct", [
    (r"(a)\1", "backreference"),
    (r"(?P<x>a)(?P=x)", "backreference"),
    (r"a(?=b)", "lookahead"),
    (r"a(?!b)", "negative lookahead"),
    (r"(?<=a)b", "lookbehind"),
    (r"(?<!a)b", "negative lookbehind"),
    (r"(a)?(?(1)b|c)", "conditional"),
    (r"\bword\b", "word boundary"),
    (r"a++", "possessive"),
    (r"(?>ab)", "atomic group"),
    (r"a^b", "anchor"),
    (r"a(b", "invalid regex"),
    (r"[^\x00-\U0010ffff]", "matches no string"),
])
def test_unsupported_or_invalid_regex_raises_naming_it(pattern, construct, tiny_tokenizer):
    with pytest.raises(ValueError, match=re.escape(construct)):
        build_constraint("regex", pattern, tiny_tokenizer)


def test_choices_are_literal_alternatives(tiny_tokenizer):
    choices = ["a+b", "(x)", "Paris", "Par", "日本"]
    rng = np.random.default_rng(0)
    seen = set()
    for _ in range(100):
        c = build_constraint("choices", choices, tiny_tokenizer)
        text = tiny_tokenizer.decode(random_walk(c, rng), clean_up_tokenization_spaces=False)
        assert text in choices
        seen.add(text)
    assert seen == set(choices)
    for bad in ([], "abc", [1, 2], None):
        with pytest.raises(ValueError, match="choices"):
            build_constraint("choices", bad, tiny_tokenizer)
    with pytest.raises(ValueError, match="unknown constraint kind"):
        build_constraint("grammar", "x", tiny_tokenizer)


def test_forced_text_is_the_compressed_edge(tiny_tokenizer):
    """forced_text is the longest string the pattern fixes from the current state (jump-forward)."""
    c = build_constraint("regex", r'\{"name": "[a-z]+", "age": [0-9]+\}', tiny_tokenizer)
    assert c.forced_text() == '{"name": "'
    _feed(c, tiny_tokenizer, '{"name": "bo')
    assert c.forced_text() is None  # a letter or the closing quote
    _feed(c, tiny_tokenizer, 'b"')
    assert c.forced_text() == ', "age": '
    _feed(c, tiny_tokenizer, ', "age": 4')
    assert c.forced_text() is None
    _feed(c, tiny_tokenizer, "2}")
    assert c.is_finished() and c.forced_text() is None
    # The forced string stops before a character whose bytes are not all fixed.
    c = build_constraint("regex", r"ab(é|è)", tiny_tokenizer)
    assert c.forced_text() == "ab"
    c = build_constraint("regex", r"(?i)x", tiny_tokenizer)
    assert c.forced_text() is None


def _jump(c, tokenizer, output: list[int], **kw) -> list[int]:
    """Applies a jump-forward plan to `output` as the engine does; returns the new output."""
    plan = c.jump_forward(output, tokenizer, **kw)
    assert plan is not None
    k, tokens = plan
    return output[: len(output) - k] + tokens


def test_jump_forward_appends_canonical_tokens_and_holds_back_the_last_piece(tiny_tokenizer):
    tok = tiny_tokenizer
    pattern = r'\{"name": "[a-z]+", "age": [0-9]+\}'
    c = build_constraint("regex", pattern, tok)
    out = _jump(c, tok, [])
    text = tok.decode(out)
    # '{"name": "' minus its last pre-tokenizer piece (' "', which could merge with the name's first letters)
    assert text == '{"name":' and out == tok.encode(text, add_special_tokens=False)
    assert c.forced_text() == ' "'
    assert c.jump_forward(out, tok) is None  # what is left is only the held-back piece
    for t in tok.encode(' "bob"', add_special_tokens=False):
        c.advance(t)
        out.append(t)
    out = _jump(c, tok, out)
    assert tok.decode(out) == '{"name": "bob", "age":'
    # The pattern's end is reached by the forced text: nothing is held back, the constraint finishes.
    for t in tok.encode(" 42", add_special_tokens=False):
        c.advance(t)
        out.append(t)
    assert c.jump_forward(out, tok) is None  # a digit or the closing brace: nothing forced
    c2 = build_constraint("regex", r"[0-9]+ items\.", tok)
    out2 = []
    for t in tok.encode("12 ", add_special_tokens=False):
        c2.advance(t)
        out2.append(t)
    out2 = _jump(c2, tok, out2, max_replace=1)
    assert tok.decode(out2) == "12 items." and c2.is_finished()
    # Re-tokenizing the boundary: the last token ' ' and the forced 'items.' become ' items' + '.'.
    assert out2 == tok.encode("12 items.", add_special_tokens=False)


def test_jump_forward_respects_max_new_tokens(tiny_tokenizer):
    c = build_constraint("regex", r"The quick brown fox jumps over the lazy dog\.", tiny_tokenizer)
    out = _jump(c, tiny_tokenizer, [], max_new_tokens=2)
    assert len(out) == 2
    assert tiny_tokenizer.decode(out) == "The quick brown fox jumps over the lazy dog."[: len(tiny_tokenizer.decode(out))]
    assert c.jump_forward(out, tiny_tokenizer, max_new_tokens=0) is None


def test_jump_forward_random_walks_stay_valid(tiny_tokenizer):
    """Random walks that take every jump-forward offered still fully match."""
    rng = np.random.default_rng(7)
    for pattern in [r'\{"name": "[a-z]{1,8}", "age": [0-9]{1,3}, "tags": \["(red|green)"(, "(red|green)")*\]\}',
                    r"(Paris|London) is in (France|England)\.", r"\d{4}-\d\d-\d\dT\d\d:00:00Z"]:
        for _ in range(100):
            c = build_constraint("regex", pattern, tiny_tokenizer)
            out: list[int] = []
            while not c.is_finished():
                plan = c.jump_forward(out, tiny_tokenizer)
                if plan is not None:
                    k, tokens = plan
                    out = out[: len(out) - k] + tokens
                    continue
                if c.index.is_accepting(c.state) and rng.random() < 0.3:
                    break
                allowed = c.index.allowed_tokens(c.state)
                t = int(allowed[rng.integers(len(allowed))])
                c.advance(t)
                out.append(t)
            assert re.fullmatch(pattern, tiny_tokenizer.decode(out, clean_up_tokenization_spaces=False))
