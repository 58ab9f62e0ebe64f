"""A request's speculative state: how often its draft tokens are kept (recent drafts weigh most), the
class of its newest draft, and the counters its meta_info reports."""

from __future__ import annotations

from dataclasses import dataclass

# Each verify step of the request multiplies its earlier evidence by this: about its last 5 drafts count.
DECAY = 0.8
# Each step it does not draft, by this: after ~30 such steps its rate has moved halfway back to its draft
# class's, so a request that stopped drafting tries again where drafts of that class are kept.
IDLE_DECAY = 0.98
# The draft class's rate counts as this many drafts of evidence beside the request's own.
PRIOR_WEIGHT = 2.0


@dataclass
class SpecState:
    kept: float = 0.0  # draft tokens kept (decayed)
    cut: float = 0.0  # drafts cut short by a rejected token (decayed)
    draft_class: int = 0  # the proposer's class of the newest draft (core.runtime.speculative.proposer)
    verify_ct: int = 0  # verify steps that checked a draft of this request
    accepted: int = 0  # draft tokens accepted in all
    drafted: int = 0  # draft tokens proposed in all

    def rate(self, prior: float) -> float:
        """The chance that its next draft token is kept, given the one before it was: kept tokens over kept
        tokens and rejections (the estimate for draft lengths cut by a first rejection), with `prior` (its
        draft class's rate) as PRIOR_WEIGHT drafts' worth of evidence."""
        return (self.kept + PRIOR_WEIGHT * prior) / (self.kept + self.cut + PRIOR_WEIGHT)

    def record(self, drafted: int, accepted: int, cut: bool) -> None:
        """A verify step checked `drafted` tokens of this request and kept `accepted` of them; `cut`: a
        draft token after the last kept one was rejected (a chain kept short of its end; in a tree, the
        last kept node had children)."""
        self.verify_ct += 1
        self.drafted += drafted
        self.accepted += accepted
        self.kept = DECAY * self.kept + accepted
        self.cut = DECAY * self.cut + cut

    def idle(self) -> None:
        """A step in which it did not draft."""
        self.kept *= IDLE_DECAY
        self.cut *= IDLE_DECAY

    @property
    def accept_length(self) -> float:
        """Tokens per verify step on average: the accepted draft tokens plus the one the target adds."""
        return 1.0 + self.accepted / self.verify_ct if self.verify_ct else 0.0
