"""The per-request constraint (core.engine.constraint.TokenConstraint) and the factory the engine calls."""

from __future__ import annotations

import bisect
import re
from typing import Any

import torch

from radixlm.core.constrained.index import TokenIndex, get_index
from radixlm.core.constrained.json_schema import json_schema_to_regex
from radixlm.core.constrained.vocab import vocab_of

KINDS = ("regex", "json_schema", "choices")


class FSMConstraint:
    """Follows one request's output through a token index: the state after the tokens fed so far."""

    def __init__(self, index: TokenIndex) -> None:
        self.index = index
        self._token_bytes = index.token_bytes
        self.state = 0
        self._finished = False  # EOS was fed
        self._written = bytearray()  # the output's bytes so far
        # (bytes written, state) after each step, for rollback_to_text
        self._marks_len: list[int] = [0]
        self._marks_state: list[int] = [0]

    def allowed_token_mask(self, vocab_size: int, packed: bool = False) -> torch.Tensor:
        """bool [vocab_size] (or packed int32 words, see TokenIndex.mask); EOS only where accepting.
        Shared and cached per state: read it, never write to it."""
        return self.index.mask(self.state, vocab_size, packed)

    def advance(self, token_id: int) -> None:
        if self._finished:
            raise ValueError("the constraint is finished; no token may follow")
        if self.index.is_eos(token_id):
            if not self.index.is_accepting(self.state):
                raise ValueError(f"EOS token {token_id} is not allowed before the output matches")
            self._finished = True
            return
        nxt = self.index.next_state(self.state, token_id)
        if nxt < 0:
            raise ValueError(f"token {token_id} ({self._token_bytes[token_id]!r}) is not allowed here")
        self.state = nxt
        self._written += self._token_bytes[token_id]
        self._marks_len.append(len(self._written))
        self._marks_state.append(nxt)

    def is_finished(self) -> bool:
        return self._finished or self.index.is_terminal(self.state)

    def forced_text(self) -> str | None:
        if self.is_finished():
            return None
        return self.index.fsm.forced_text(self.state)

    def rollback_to_text(self, text: str) -> None:
        """Moves to the state after `text`, the whole output so far (it may differ from what was fed in
        its tail, e.g. after jump-forward re-tokenized it). ValueError if `text` leaves the pattern."""
        data = text.encode()
        common = 0
        limit = min(len(data), len(self._written))
        while common < limit and data[common] == self._written[common]:
            common += 1
        k = bisect.bisect_right(self._marks_len, common) - 1  # last step boundary inside the common prefix
        base_len, base_state = self._marks_len[k], self._marks_state[k]
        state = self.index.dfa.walk(data[base_len:], base_state)
        if state < 0:
            raise ValueError(f"text {text!r} does not follow the constraint")
        del self._marks_len[k + 1:], self._marks_state[k + 1:]
        if len(data) > base_len:
            self._marks_len.append(len(data))
            self._marks_state.append(state)
        self.state, self._written, self._finished = state, bytearray(data), False


def constraint_regex(kind: str, spec: Any, whitespace_pattern: str | None = None) -> str:
    """The regex a constraint of `kind` enforces; ValueError naming the problem if `spec` is invalid."""
    if kind == "regex":
        if not isinstance(spec, str):
            raise ValueError(f"regex must be a string, got {type(spec).__name__}")
        return spec
    if kind == "json_schema":
        return json_schema_to_regex(spec, whitespace_pattern=whitespace_pattern)
    if kind == "choices":
        if not isinstance(spec, (list, tuple)) or not spec or not all(isinstance(c, str) for c in spec):
            raise ValueError("choices must be a non-empty list of strings")
        return "|".join(re.escape(c) for c in spec)
    raise ValueError(f"unknown constraint kind {kind!r}; expected one of {KINDS}")


def build_constraint(kind: str, spec: Any, tokenizer: object, *, eos_token_ids: list[int] | None = None,
                     whitespace_pattern: str | None = None) -> FSMConstraint:
    """A fresh constraint for one request. kind: 'regex' (a Python regex, fullmatch semantics),
    'json_schema' (a JSON string, dict or pydantic model class) or 'choices' (a list of strings).
    EOS ids default to the tokenizer's eos_token_id. Invalid input raises ValueError naming the problem;
    the token index is built (or found in the cache) before this returns."""
    pattern = constraint_regex(kind, spec, whitespace_pattern)
    vocab = vocab_of(tokenizer, eos_token_ids)
    return FSMConstraint(get_index(pattern, vocab))
