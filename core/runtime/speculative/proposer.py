"""What a proposer is: something that guesses the next tokens of running requests."""

from __future__ import annotations

from typing import Protocol

from radixlm.core.runtime.request import Req
from radixlm.core.runtime.speculative.tree import DraftTree


class Proposer(Protocol):
    name: str  # the speculative_algorithm it implements (the label of its metrics)
    # True when drafting costs nothing worth counting (a lookup): it drafts its whole budget and the
    # speculator cuts the drafts; False (a model runs per token): the speculator sizes budgets first.
    free: bool
    # Optional, False where absent: True when its drafts may be trees (its budget then counts nodes, not depth).
    trees: bool

    def propose(self, reqs: list[Req], budgets: list[int]) -> list[list[int] | DraftTree]:
        """Up to budgets[i] draft tokens to follow reqs[i]'s newest token (fewer, or none, where it has
        no good guess; nothing where the budget is 0): a chain, or a tree of several continuations."""

    def draft_class(self, req: Req) -> int:
        """The class of the request's newest draft: drafts of one class are kept at a similar rate (ngram:
        its match length), which is what a request's first drafts are judged by."""

    # Optional: kept_rows(req, rows), told after a verify step of a tree which of the request's verify rows
    # it kept (0: its newest token), by proposers that keep what the target computed per row (EAGLE).

    def release(self, req: Req) -> None:
        """Drops what the proposer holds for a request that finished or was retracted."""
