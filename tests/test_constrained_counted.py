"""Bounded JSON strings counted instead of walked (counted_string.py): the terminal's language against
Python's `json` and `len` (what jsonschema counts), and the counted masks against the byte automaton
token by token over Qwen2's 151k vocabulary."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from radixlm.core.runtime.constrained import build_constraint
from radixlm.core.runtime.constrained.tokens.counted_string import CountedStringDFA, counted_string_dfa
from radixlm.testing.constrained import qwen2_tokenizer, random_walk

TEXTS = ["", "a", "ab", "abc", "abcd", "é€😀", 'q"uote', "back\\slash", "tab\tnew\nline", "\u0001", "x" * 9,
         "日本語のテキスト", "\ud7ff\ue000"]


@pytest.mark.parametrize("lo, hi", [(0, 0), (0, 3), (2, 4), (3, None), (0, None), (1, 9)])
def test_the_counted_terminal_is_json_strings_of_lo_to_hi_characters(lo, hi):
    dfa = counted_string_dfa(lo, hi)
    for text in TEXTS:
        expected = lo <= len(text) and (hi is None or len(text) <= hi)
        # Raw characters and \u escapes count the same (surrogate pairs are never generated: BMP only).
        for ascii_only in (False, True) if max(map(ord, text), default=0) < 0x10000 else (False,):
            encoded = json.dumps(text, ensure_ascii=ascii_only)
            assert dfa.fullmatch(encoded) == expected, (lo, hi, encoded)
    for bad in ['"a', 'a"', '"\\x"', '"\\ud800"', '"a""', '"\x01"']:
        assert not dfa.fullmatch(bad), bad


@pytest.fixture(scope="module")
def qwen2():
    return qwen2_tokenizer()


def _byte_level_mask(constraint, vocab_size: int) -> np.ndarray:
    """The oracle: token t is allowed iff its bytes lead somewhere from the current state, byte by byte."""
    index, state = constraint.index, constraint.state
    allowed = np.array([index.next_state(state, t) >= 0 for t in range(vocab_size)])
    if index.is_accepting(state):
        allowed[index.eos_ids] = True
    return allowed


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "tags": {"type": "array", "items": {"type": "string", "minLength": 2, "maxLength": 3}, "maxItems": 2},
    "note": {"type": "string"}}, "required": ["name", "tags", "note"]}


@pytest.mark.parametrize("doc", [
    {"name": "héllo", "tags": ["ab", "日本語"], "note": 'say "hi", ok'},
    {"name": "", "tags": [], "note": "\\n"},
])
def test_counted_masks_equal_the_byte_automaton(doc, qwen2):
    vocab = len(qwen2)
    text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False)
    jsonschema.validate(doc, SCHEMA)
    c = build_constraint("json_schema", SCHEMA, qwen2)
    for t in qwen2.encode(text):
        mask = c.allowed_token_mask(vocab).numpy()
        assert np.array_equal(mask, _byte_level_mask(c, vocab)), qwen2.decode([t])
        assert mask[t]
        c.advance(t)
    assert c.allowed_token_mask(vocab).numpy()[qwen2.eos_token_id]


def test_random_walks_over_the_real_vocabulary_validate(qwen2):
    """Qwen2's long tokens (several characters, quotes and commas in one token) against the bounds."""
    rng = np.random.default_rng(0)
    for _ in range(40):
        c = build_constraint("json_schema", SCHEMA, qwen2)
        text = qwen2.decode(random_walk(c, rng, max_tokens=80, stop_prob=0.5), clean_up_tokenization_spaces=False)
        jsonschema.validate(json.loads(text), SCHEMA)


KEYS_SCHEMA = {"type": "object", "propertyNames": {"maxLength": 3}, "additionalProperties": {"type": "integer"}}


def test_a_length_only_property_names_key_is_counted(qwen2):
    """propertyNames with lengths only, over additionalProperties: the key terminal is the counted string
    (its language that of jsonschema's propertyNames), and its masks at every key position equal each
    token read byte by byte."""
    c = build_constraint("json_schema", KEYS_SCHEMA, qwen2)
    grammar = c.index.grammar
    keys = [dfa for dfa in grammar.terminals if isinstance(dfa, CountedStringDFA) and dfa.hi == 3]
    assert len(keys) == 1
    for text in TEXTS:
        for ascii_only in (False, True) if max(map(ord, text), default=0) < 0x10000 else (False,):
            valid = jsonschema.Draft202012Validator(KEYS_SCHEMA).is_valid({text: 1})
            assert keys[0].fullmatch(json.dumps(text, ensure_ascii=ascii_only)) == valid, text
    vocab = len(qwen2)
    doc = {"é€😀": 1, "": 2, "ab": 3, 'q"': 4, "\\n": 5}
    jsonschema.validate(doc, KEYS_SCHEMA)
    for t in qwen2.encode(json.dumps(doc, separators=(",", ":"), ensure_ascii=False)):
        mask = c.allowed_token_mask(vocab).numpy()
        assert np.array_equal(mask, _byte_level_mask(c, vocab)), qwen2.decode([t])
        assert mask[t]
        c.advance(t)
    assert c.allowed_token_mask(vocab).numpy()[qwen2.eos_token_id]
    rng = np.random.default_rng(1)
    for _ in range(20):
        walk = random_walk(build_constraint("json_schema", KEYS_SCHEMA, qwen2), rng, max_tokens=40, stop_prob=0.3)
        jsonschema.validate(json.loads(qwen2.decode(walk, clean_up_tokenization_spaces=False)), KEYS_SCHEMA)
