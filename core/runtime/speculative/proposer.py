"""What a proposer is: something that guesses the next tokens of running requests."""

from __future__ import annotations

from typing import Protocol

from radixlm.core.runtime.request import Req


class Proposer(Protocol):
    name: str  # the speculative_algorithm it implements (the label of its metrics)

    def propose(self, reqs: list[Req], budgets: list[int]) -> list[list[int]]:
        """Up to budgets[i] draft tokens to follow reqs[i]'s newest token (fewer, or none, where it has
        no good guess; nothing where the budget is 0)."""

    def release(self, req: Req) -> None:
        """Drops what the proposer holds for a request that finished or was retracted."""
