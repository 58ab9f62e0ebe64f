"""A request's speculative state: how many tokens to draft next, the back-off after misses, and the
counters its meta_info reports."""

from __future__ import annotations

from dataclasses import dataclass

# After a draft with nothing accepted a request skips drafting for 1, 2, 4, ... steps, at most this many.
MAX_SKIP_STEPS = 32


@dataclass
class SpecState:
    max_draft: int  # speculative_num_draft_tokens
    adaptive: bool = True
    draft_len: int = 0  # tokens to draft next (0: set to max_draft on first use)
    skip: int = 0  # steps left without drafting
    misses: int = 0  # drafts in a row with nothing accepted
    verify_ct: int = 0  # verify steps that checked a draft of this request
    accepted: int = 0  # draft tokens accepted in all
    drafted: int = 0  # draft tokens proposed in all

    def budget(self) -> int:
        """How many tokens to draft this step (0: none), counting down a skip."""
        if self.skip > 0:
            self.skip -= 1
            return 0
        if not self.draft_len:
            self.draft_len = self.max_draft
        return self.draft_len

    def record(self, drafted: int, accepted: int) -> None:
        """A verify step checked `drafted` tokens of this request and kept `accepted` of them."""
        self.verify_ct += 1
        self.drafted += drafted
        self.accepted += accepted
        if not self.adaptive:
            return
        if accepted == 0:
            # Misses in a row double the pause: a request whose drafts keep failing soon drafts once
            # in MAX_SKIP_STEPS steps, a cost of a few percent of its steps.
            self.misses += 1
            self.skip = min(1 << (self.misses - 1), MAX_SKIP_STEPS)
            self.draft_len = max(1, self.draft_len // 2)
        else:
            self.misses = 0
            # A full accept grows the next draft; a partial one sizes it to what was accepted, plus one.
            self.draft_len = min(self.max_draft, 2 * self.draft_len if accepted == drafted else accepted + 1)

    @property
    def accept_length(self) -> float:
        """Tokens per verify step on average: the accepted draft tokens plus the one the target adds."""
        return 1.0 + self.accepted / self.verify_ct if self.verify_ct else 0.0
