"""The compile path's per-process parts: the tokenizer's share built once (grammar_index_cache.prepare_vocab,
the vocabulary read as JSON string content, checked token by token against Python's own json decoder),
and compiles with the cyclic garbage collector paused (gc_paused) across threads."""

from __future__ import annotations

import codecs
import gc
import json
import threading

import numpy as np
import pytest

from radixlm.core.constrained.counted_string import string_tokens
from radixlm.core.constrained.grammar_index_cache import gc_paused, prepare_vocab
from radixlm.core.constrained.testing import qwen2_tokenizer


@pytest.fixture(scope="module")
def vocab():
    return prepare_vocab(qwen2_tokenizer())


def _oracle(data: bytes) -> tuple[str, int]:
    """What a token's bytes do inside a JSON string, from Python's json: ('inside', characters) when they
    are whole characters of a string body, ('closing', characters before the quote) when they end the
    string (whatever follows), ('partial', characters + 1) when they end inside a UTF-8 character, else
    ('bad', 0)."""
    for cut in range(len(data)):
        if data[cut:cut + 1] == b'"' and _body(data[:cut]) is not None:
            return "closing", _body(data[:cut])
    body = _body(data)
    if body is not None:
        return "inside", body
    for end in range(len(data) - 1, max(len(data) - 4, -1), -1):  # a UTF-8 character cut short
        rest = data[end:]
        if _body(data[:end]) is not None and b'"' not in rest and b"\\" not in rest:
            try:
                if codecs.getincrementaldecoder("utf-8")().decode(rest, final=False) == "":
                    return "partial", _body(data[:end]) + 1
            except UnicodeDecodeError:
                pass
    return "bad", 0


def _body(data: bytes) -> int | None:
    """The characters of `data` read as a whole JSON string body (what jsonschema counts), else None."""
    try:
        return len(json.loads(b'"' + data + b'"'))
    except (ValueError, UnicodeDecodeError):
        return None


def test_prepare_vocab_reads_the_vocabulary_once_as_json_python_does(vocab):
    reads = string_tokens(vocab)
    assert string_tokens(vocab) is reads  # built by prepare_vocab, cached per process
    rng = np.random.default_rng(0)
    quoted = [i for i, b in enumerate(vocab.token_bytes) if b'"' in b or b"\\" in b]
    sample = sorted(set(rng.choice(vocab.size, 3000, replace=False).tolist()) | set(quoted[:1500]))
    top = reads.max_count
    inside = np.unpackbits(reads.allowed_inside(None), bitorder="little")[:vocab.size].astype(bool)
    closing = np.unpackbits(reads.closing_between(0, None), bitorder="little")[:vocab.size].astype(bool)
    checked = 0
    for t in sample:
        data = vocab.token_bytes[t]
        if not data:
            assert not inside[t] and not closing[t]
            continue
        kind, count = _oracle(data)
        if kind == "bad" and b"\\" in data:
            continue  # an escape cut short (this oracle does not tell it from a bad one)
        assert inside[t] == (kind in ("inside", "partial")), (data, kind)
        assert closing[t] == (kind == "closing"), (data, kind)
        if kind in ("inside", "partial") and count <= top:
            room = np.unpackbits(reads.allowed_inside(count), bitorder="little")[t]
            less = np.unpackbits(reads.allowed_inside(count - 1), bitorder="little")[t] if count else 0
            assert room and not less, (data, kind, count)
        checked += 1
    assert checked > 3000


def test_gc_is_paused_while_any_compile_runs_and_restored_after():
    assert gc.isenabled()
    started, release = threading.Barrier(3), threading.Event()
    seen = []

    def compile_() -> None:
        with gc_paused():
            started.wait()
            release.wait()
            seen.append(gc.isenabled())

    threads = [threading.Thread(target=compile_) for _ in range(2)]
    for th in threads:
        th.start()
    started.wait()
    assert not gc.isenabled()
    release.set()
    for th in threads:
        th.join()
    assert seen == [False, False] and gc.isenabled()
    gc.disable()  # a process that turned it off itself keeps it off
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
