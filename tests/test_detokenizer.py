"""Incremental detokenization: never broken UTF-8, same text as decoding in one go, stop strings found
across token boundaries."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from radixlm.core.runtime.tokenizer.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok(tokenizer_path):
    return AutoTokenizer.from_pretrained(tokenizer_path)


TEXTS = st.text(alphabet=st.sampled_from(list("ab ,.\n") + ["é", "中", "文", "🙂", "ß", "\u0301"]), max_size=40)


@settings(max_examples=60, deadline=None)
@given(text=TEXTS)
def test_streamed_pieces_are_valid_and_add_up(tok, text):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tok, skip_special_tokens=True, stop=[], no_stop_trim=False)
    pieces = []
    for t in ids:
        detok.add(t)
        pieces.append(detok.take_new_text(final=False))
    detok.flush()
    pieces.append(detok.take_new_text(final=True))
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True) == text


@settings(max_examples=60, deadline=None)
@given(text=TEXTS, start=st.integers(0, 30), length=st.integers(1, 5))
def test_stop_string_found_wherever_it_falls(tok, text, start, length):
    stop = text[start : start + length]
    if not stop:
        return
    ids = tok(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tok, skip_special_tokens=True, stop=[stop], no_stop_trim=False)
    streamed = []
    for t in ids:
        matched = detok.add(t)
        streamed.append(detok.take_new_text(final=matched is not None))
        if matched:
            break
    detok.flush()
    streamed.append(detok.take_new_text(final=True))
    assert detok.matched_stop == stop
    assert detok.text == text[: text.index(stop)]
    assert "".join(streamed) == detok.text  # nothing past the stop string was ever streamed


@settings(max_examples=80, deadline=None)
@given(text=TEXTS, skip=st.booleans())
def test_backend_fast_path_equals_transformers(tok, text, skip):
    """The Rust-backend encode/decode used per token must give transformers' own results, special
    tokens included."""
    from radixlm.core.runtime.tokenizer.fast_path import decoder_for, encoder_for

    specials = [t for t in (tok.bos_token_id, tok.eos_token_id) if t is not None]
    assert encoder_for(tok)(text) == tok.encode(text, add_special_tokens=False)
    ids = specials[:1] + tok.encode(text, add_special_tokens=False) + specials[-1:]
    assert decoder_for(tok)(ids, skip) == tok.decode(ids, skip_special_tokens=skip)


def test_fast_path_steps_aside_when_transformers_would_clean_up(tok):
    from radixlm.core.runtime.tokenizer.fast_path import decoder_for

    tok2 = AutoTokenizer.from_pretrained(tok.name_or_path, clean_up_tokenization_spaces=True)
    ids = tok2.encode("a , b .", add_special_tokens=False)
    assert decoder_for(tok2)(ids, True) == tok2.decode(ids, skip_special_tokens=True)


def test_lazy_replace_tail_ends_with_the_text_of_the_final_ids(tok):
    """Jump-forward on a lazy detokenizer (constrained, not streamed): the replaced ids are all that
    counts, and the text at the end is that of the final ids, as with the incremental one."""
    first = tok.encode('{"name": "a', add_special_tokens=False)
    for lazy in (True, False):
        detok = IncrementalDetokenizer(tok, skip_special_tokens=True, stop=[], no_stop_trim=False, lazy=lazy)
        for t in first:
            detok.add(t)
        new = tok.encode(tok.decode(first[-1:]) + '", "age": ', add_special_tokens=False)
        assert detok.replace_tail(1, new) is None
        detok.flush()
        assert detok.ids == first[:-1] + new
        assert detok.text == tok.decode(first[:-1] + new, skip_special_tokens=True)
