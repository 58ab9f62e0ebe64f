"""The seam between the engine and constrained decoding (core.runtime.constrained).

A request with a constraint carries one `TokenConstraint` object. Each step the scheduler asks it for
the tokens allowed next, the sampler masks everything else out, and the sampled token is fed back.
Where the constraint has a single path ahead, `jump_forward` re-tokenizes the forced text and the
scheduler appends it in one extend step instead of decoding it token by token.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class TokenConstraint(Protocol):
    def allowed_token_mask(self, vocab_size: int, packed: bool = False) -> torch.Tensor:
        """True where the token may come next (EOS only where the output may end): bool [vocab_size], or
        with `packed` int32 [ceil(vocab_size / 32)], bit i % 32 of word i // 32. Shared: do not write."""

    def advance(self, token_id: int) -> None:
        """Feeds the sampled token (ValueError if it is not allowed)."""

    def is_finished(self) -> bool:
        """True once nothing but the end of the output can follow."""

    def fork(self) -> "TokenConstraint":
        """An independent copy at the same point, sharing the compiled grammar: speculative decoding
        walks a draft with it to mask each draft position, leaving this one where it is."""

    def forced_text(self) -> str | None:
        """The string the constraint forces from here, or None."""

    def jump_forward(self, output_ids: list[int], tokenizer: Any, max_replace: int = 1,
                     max_new_tokens: int | None = None) -> tuple[int, list[int]] | None:
        """When text is forced: (k, tokens) = replace the last k (<= max_replace) output tokens by
        `tokens`, canonically tokenized, trailing tokens that could merge with what follows held back;
        the constraint has already moved past them. None when there is nothing to jump."""

