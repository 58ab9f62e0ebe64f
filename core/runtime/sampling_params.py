"""Sampling parameters: SGLang's names, validated where they are built."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from radixlm.core.errors import InvalidRequestError


@dataclass
class SamplingParams:
    max_new_tokens: int | None = 128  # None: up to the end of the context (set per prompt by the engine)
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    seed: int | None = None
    # Additive biases on the logits, token id -> bias in [-100, 100] (OpenAI's logit_bias).
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Constrained decoding (core.runtime.constrained); at most one of them.
    regex: str | None = None
    json_schema: str | None = None
    choices: list[str] | None = None
    disable_jump_forward: bool = False

    @classmethod
    def from_dict(cls, params: dict[str, Any] | None) -> "SamplingParams":
        """Builds and validates; an unknown key or a bad value raises InvalidRequestError naming it."""
        params = dict(params or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise InvalidRequestError(
                f"unknown sampling parameter(s) {unknown}; known: {sorted(known)}", param=unknown[0]
            )
        if isinstance(params.get("stop"), str):
            params["stop"] = [params["stop"]]
        if params.get("stop") is None:
            params.pop("stop", None)
        if params.get("stop_token_ids") is None:
            params.pop("stop_token_ids", None)
        if params.get("logit_bias") is None:
            params.pop("logit_bias", None)
        if isinstance(params.get("json_schema"), dict):
            import json

            params["json_schema"] = json.dumps(params["json_schema"])
        sp = cls(**params)
        sp.validate()
        return sp

    def validate(self) -> None:
        def bad(name: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"sampling parameter '{name}' {why} (got {getattr(self, name)!r})", name)

        def check_type(name: str, types: tuple[type, ...]) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) and bool not in types or not isinstance(value, types):
                raise bad(name, f"must be {' or '.join(t.__name__ for t in types)}")

        for name in ("min_new_tokens", "top_k", "n"):
            check_type(name, (int,))
        if self.max_new_tokens is not None:
            check_type("max_new_tokens", (int,))
        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                     "repetition_penalty"):
            check_type(name, (int, float))
            if not math.isfinite(getattr(self, name)):
                raise bad(name, "must be a finite number")
        for name in ("ignore_eos", "skip_special_tokens", "no_stop_trim", "disable_jump_forward"):
            check_type(name, (bool,))
        if self.seed is not None:
            check_type("seed", (int,))
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            raise bad("max_new_tokens", "must be >= 0")
        if self.min_new_tokens < 0:
            raise bad("min_new_tokens", "must be >= 0")
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise bad("min_new_tokens", f"must be <= max_new_tokens ({self.max_new_tokens})")
        if not 0.0 <= self.temperature:
            raise bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise bad("top_k", "must be -1 (disabled) or >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad("repetition_penalty", "must be in (0, 2]")
        if not 1 <= self.n <= 128:
            raise bad("n", "must be in [1, 128]")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a non-empty string or a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise bad("stop_token_ids", "must be a list of non-negative token ids")
        if not isinstance(self.logit_bias, dict):
            raise bad("logit_bias", "must map token ids to numbers")
        try:
            self.logit_bias = {_token_id(k): float(v) for k, v in self.logit_bias.items()}
        except (TypeError, ValueError, OverflowError):
            raise bad("logit_bias", "must map token ids (integers >= 0) to numbers") from None
        for token, bias in self.logit_bias.items():
            if not -100.0 <= bias <= 100.0:  # also false for NaN
                raise InvalidRequestError(f"logit_bias value {bias} for token {token} is outside [-100, 100]",
                                          "logit_bias")
        constraints = [n for n in ("regex", "json_schema", "choices") if getattr(self, n) is not None]
        if len(constraints) > 1:
            raise InvalidRequestError(f"at most one of regex, json_schema, choices (got {constraints})",
                                      constraints[1])
        if self.regex is not None and not isinstance(self.regex, str):
            raise bad("regex", "must be a string")
        if self.json_schema is not None and not isinstance(self.json_schema, str):
            raise bad("json_schema", "must be a JSON string or a dict")
        if self.choices is not None and (
            not isinstance(self.choices, list) or not self.choices
            or not all(isinstance(c, str) for c in self.choices)
        ):
            raise bad("choices", "must be a non-empty list of strings")

    def check_vocab(self, vocab_size: int) -> None:
        """logit_bias names the model's tokens (checked once the model is known)."""
        bad = next((t for t in self.logit_bias if t >= vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"logit_bias key {bad} is not a token id in [0, {vocab_size})", "logit_bias")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _token_id(key: Any) -> int:
    """A logit_bias key as a token id: an int, or a string of digits (JSON object keys are strings)."""
    if isinstance(key, bool) or not isinstance(key, (int, str)):
        raise TypeError(key)
    if isinstance(key, str) and not (key.isascii() and key.isdigit()):
        raise ValueError(key)
    token = int(key)
    if token < 0:
        raise ValueError(key)
    return token
