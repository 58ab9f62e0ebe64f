"""Encode and decode straight through a fast tokenizer's Rust backend, where that gives exactly what
transformers' `encode`/`decode` give. Detokenization and jump-forward call these for every token of
every request; transformers' Python wrappers cost ~10x more per call than the backend itself."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _backend(tokenizer: Any) -> Any | None:
    """The Rust tokenizer, when transformers would hand it the call unchanged: no space clean-up after
    decoding, no padding or truncation configured for encoding."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    if getattr(backend, "padding", None) is not None or getattr(backend, "truncation", None) is not None:
        return None
    return backend


def decoder_for(tokenizer: Any) -> Callable[[list[int], bool], str]:
    """decode(ids, skip_special_tokens) -> text, as tokenizer.decode gives it."""
    backend = _backend(tokenizer)
    if backend is None:
        return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)


def encoder_for(tokenizer: Any) -> Callable[[str], list[int]]:
    """encode(text) -> ids without special tokens added, as tokenizer.encode(text, add_special_tokens=False)."""
    backend = _backend(tokenizer)
    if backend is None:
        return lambda text: list(tokenizer.encode(text, add_special_tokens=False))
    return lambda text: backend.encode(text, add_special_tokens=False).ids
