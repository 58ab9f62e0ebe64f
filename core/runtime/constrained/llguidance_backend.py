"""The optional llguidance backend (PyPI `llguidance`, as SGLang's `--grammar-backend llguidance`): the
same TokenConstraint interface (core.runtime.constraint) over llguidance's LLMatcher."""

from __future__ import annotations

import copy
import re
import threading
import weakref
from typing import Any

import numpy as np
import torch

from radixlm.core.runtime.constrained.schema.schema_input import load_schema
from radixlm.core.runtime.constrained.tokens.vocab import TokenVocab, whole_characters

_tokenizers: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def _ll_tokenizer(tokenizer: Any, vocab: TokenVocab):
    """llguidance's tokenizer of `tokenizer` (about a second to build; cached per tokenizer and EOS ids)."""
    import llguidance

    with _lock:
        per = _tokenizers.setdefault(tokenizer, {})
        found = per.get(vocab.eos_ids)
        if found is None:
            # What llguidance.hf.from_tokenizer does, for any Rust-backed tokenizer (that one accepts only
            # transformers' class, and imports transformers): the backend's JSON, without padding or truncation.
            backend = copy.copy(getattr(tokenizer, "backend_tokenizer", tokenizer))
            backend.no_padding()
            backend.no_truncation()
            found = per[vocab.eos_ids] = llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab.size,
                                                                eos_token=list(vocab.eos_ids))
    return found


def llguidance_grammar(kind: str, spec: Any, whitespace_pattern: str | None = None) -> str:
    """The llguidance grammar (its JSON form) of a constraint spec."""
    from llguidance import LLMatcher

    if kind == "json_schema":
        options = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
        if whitespace_pattern:
            options = {"whitespace_flexible": True, "whitespace_pattern": whitespace_pattern}
        return LLMatcher.grammar_from_json_schema(load_schema(spec), defaults=options)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec)
    if kind == "choices":
        if not isinstance(spec, (list, tuple)) or not spec or not all(isinstance(c, str) for c in spec):
            raise ValueError("choices must be a non-empty list of strings")
        return LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in spec))
    raise ValueError(f"unknown constraint kind {kind!r}")


class LLGuidanceConstraint:
    """One request's llguidance matcher behind the TokenConstraint interface."""

    def __init__(self, matcher, vocab: TokenVocab) -> None:
        self.matcher = matcher
        self.vocab = vocab

    def allowed_token_mask(self, vocab_size: int, packed: bool = False) -> torch.Tensor:
        words = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.int32)
        out = np.zeros(-(-vocab_size // 32), dtype=np.int32)
        n = min(len(out), len(words))
        out[:n] = words[:n]
        if vocab_size % 32 and n == len(out):  # no bits past vocab_size
            out[-1] &= np.int32((1 << (vocab_size % 32)) - 1)
        tensor = torch.from_numpy(out)
        if packed:
            return tensor
        bits = np.unpackbits(out.view(np.uint8), bitorder="little")[:vocab_size]
        return torch.from_numpy(bits.astype(bool))

    def advance(self, token_id: int) -> None:
        if not self.matcher.consume_token(token_id):
            raise ValueError(f"token {token_id} is not allowed here: {self.matcher.get_error()}")

    def is_finished(self) -> bool:
        return self.matcher.is_stopped()

    def fork(self) -> "LLGuidanceConstraint":
        return LLGuidanceConstraint(self.matcher.deep_copy(), self.vocab)

    def forced_text(self) -> str | None:
        return whole_characters(self.matcher.compute_ff_bytes())

    def jump_forward(self, output_ids: list[int], tokenizer: Any, max_replace: int = 1,
                     max_new_tokens: int | None = None) -> tuple[int, list[int]] | None:
        """llguidance's own forced tokens (it holds back those that could merge with what follows)."""
        tokens = self.matcher.compute_ff_tokens()
        if max_new_tokens is not None:
            tokens = tokens[:max_new_tokens]
        if not tokens or not self.matcher.consume_tokens(tokens):
            return None
        return 0, list(tokens)


def build_llguidance_constraint(kind: str, spec: Any, tokenizer: Any, vocab: TokenVocab,
                                whitespace_pattern: str | None = None) -> LLGuidanceConstraint:
    try:
        from llguidance import LLMatcher
    except ImportError:
        raise ValueError("grammar_backend 'llguidance' needs the llguidance package (pip install llguidance)") from None
    ll_tok = _ll_tokenizer(tokenizer, vocab)
    grammar = llguidance_grammar(kind, spec, whitespace_pattern)
    error = LLMatcher.validate_grammar(grammar, ll_tok)
    if error:
        raise ValueError(f"llguidance refused the {kind}: {error}")
    matcher = LLMatcher(ll_tok, grammar, log_level=0)
    if matcher.is_error():
        raise ValueError(f"llguidance refused the {kind}: {matcher.get_error()}")
    return LLGuidanceConstraint(matcher, vocab)
