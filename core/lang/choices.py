"""How `select` picks among choices from their token logprobs (SGLang's three methods).

A backend scores each choice as a continuation of the state's text and hands the method, per
choice, the logprobs of the choice's tokens (`input_token_logprobs[i]`: a list of
(logprob, token_id, text|None)) and their mean (`normalized_prompt_logprobs[i]`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

TokenLogprob = tuple  # (logprob: float | None, token_id: int, text: str | None)


@dataclass
class ChoicesDecision:
    decision: str
    meta_info: dict[str, Any] = field(default_factory=dict)


def _argmax_first(values: list[float]) -> int:
    """Index of the largest value; ties go to the earliest choice."""
    best = 0
    for i, value in enumerate(values):
        if value > values[best]:
            best = i
    return best


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


class ChoicesSamplingMethod(ABC):
    @property
    def requires_unconditional_logprobs(self) -> bool:
        """True if the method also needs each choice scored on its own, without the prompt."""
        return False

    @abstractmethod
    def __call__(self, *, choices: list[str], normalized_prompt_logprobs: list[float],
                 input_token_logprobs: list[list[TokenLogprob]],
                 output_token_logprobs: list[list[TokenLogprob]],
                 unconditional_token_logprobs: list[list[TokenLogprob]] | None = None,
                 ) -> ChoicesDecision: ...

    def _meta(self, normalized_prompt_logprobs: list[float], input_token_logprobs: list[list[TokenLogprob]],
              output_token_logprobs: list[list[TokenLogprob]], **extra: Any) -> dict[str, Any]:
        return {"normalized_prompt_logprobs": normalized_prompt_logprobs,
                "input_token_logprobs": input_token_logprobs,
                "output_token_logprobs": output_token_logprobs, **extra}


class TokenLengthNormalized(ChoicesSamplingMethod):
    """The choice with the highest mean token logprob (the default)."""

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None) -> ChoicesDecision:
        best = _argmax_first(normalized_prompt_logprobs)
        return ChoicesDecision(choices[best], self._meta(normalized_prompt_logprobs, input_token_logprobs,
                                                         output_token_logprobs))

    def __repr__(self) -> str:
        return "token_length_normalized"


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Compare choices token by token, keeping those with the best logprob at each position; a
    choice shorter than the longest is padded with its own mean logprob."""

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None) -> ChoicesDecision:
        width = max(len(tokens) for tokens in input_token_logprobs)
        matrix = []
        for tokens in input_token_logprobs:
            row = [lp for lp, *_ in tokens]
            pad = _mean(row) if row else float("-inf")
            matrix.append(row + [pad] * (width - len(row)))
        remaining = list(range(len(choices)))
        for j in range(width):
            best = max(matrix[i][j] for i in remaining)
            remaining = [i for i in remaining if matrix[i][j] == best]
            if len(remaining) == 1:
                break
        return ChoicesDecision(choices[remaining[0]], self._meta(
            normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
            greedy_logprob_matrix=matrix))

    def __repr__(self) -> str:
        return "greedy_token_selection"


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """The choice with the highest mean of (logprob given the prompt - logprob without it); the
    first unconditional logprob (None: nothing precedes it) counts as 0."""

    @property
    def requires_unconditional_logprobs(self) -> bool:
        return True

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None) -> ChoicesDecision:
        if unconditional_token_logprobs is None:
            raise ValueError("unconditional_likelihood_normalized needs unconditional token logprobs")
        scores = []
        for conditional, unconditional in zip(input_token_logprobs, unconditional_token_logprobs):
            if len(conditional) != len(unconditional):
                raise ValueError("conditional and unconditional logprobs differ in length")
            base = [lp if lp is not None else 0.0 for lp, *_ in unconditional]
            scores.append(_mean([c[0] - u for c, u in zip(conditional, base)]))
        best = _argmax_first(scores)
        return ChoicesDecision(choices[best], self._meta(
            normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
            unconditional_token_logprobs=unconditional_token_logprobs,
            normalized_unconditional_prompt_logprobs=scores))

    def __repr__(self) -> str:
        return "unconditional_likelihood_normalized"


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
