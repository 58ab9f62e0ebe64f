"""The seam between the engine and constrained decoding (core.constrained).

A request with a constraint carries one `TokenConstraint` object. Each step the scheduler asks it for
the tokens allowed next, the sampler masks everything else out, and the sampled token is fed back.
Where the constraint has a single path ahead, `forced_text` returns it and the scheduler may append
it in one extend step (jump-forward) instead of decoding it token by token.
"""

from __future__ import annotations

from typing import Protocol

import torch


class TokenConstraint(Protocol):
    def allowed_token_mask(self, vocab_size: int) -> torch.Tensor:
        """Bool tensor [vocab_size] (CPU), True where the token may come next (EOS only where accepting)."""

    def advance(self, token_id: int) -> None:
        """Feeds the sampled (or jump-forward) token."""

    def is_finished(self) -> bool:
        """True once nothing but the end of the output can follow."""

    def forced_text(self) -> str | None:
        """The string the constraint forces from here (jump-forward), or None."""

    def rollback_to_text(self, text: str) -> None:
        """Resets the state to the one reached after `text` (used after jump-forward re-tokenization)."""


class ConstraintFactory(Protocol):
    def __call__(self, kind: str, spec: str | list[str], tokenizer: object) -> TokenConstraint:
        """Builds a constraint for kind in ('regex', 'json_schema', 'choices'); invalid spec raises ValueError."""
