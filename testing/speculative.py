"""A proposer for tests and GPU checks (tests/test_speculative.py, benchmarks/gpu_check_spec.py): it knows
each prompt's output without speculation and drafts it, corrupted at a position that varies from step to
step (sometimes none), so that verify steps see every accepted length from 0 to the whole draft, with
per-request draft lengths. With `tree`, it drafts trees: the (maybe corrupted) truth beside two wrong
branches that share a prefix with it, the wrong ones first among siblings, so that the kept path often
runs through later children and rows of rejected branches sit between kept ones."""

from __future__ import annotations

from typing import Any

from radixlm.core.runtime.speculative.tree import merge_continuations


class OracleProposer:
    name = "oracle"
    free = True

    def __init__(self, expected: dict[tuple[int, ...], list[int]], vocab_size: int, corrupt: bool = True,
                 tree: bool = False) -> None:
        self.expected = expected  # prompt ids -> output ids without speculation
        self.vocab_size = vocab_size
        self.corrupt = corrupt  # False: the expected tokens as they are, the whole budget
        self.tree = tree
        self.calls = 0

    def propose(self, reqs: list[Any], budgets: list[int]) -> list[list[int]]:
        drafts = []
        for req, k in zip(reqs, budgets):
            self.calls += 1
            truth = self.expected.get(tuple(req.inp.input_ids), [])
            n = len(req.output_ids)
            if not self.corrupt:
                drafts.append(list(truth[n:n + k]))
                continue
            # the request's own guess length varies: k, k - 1, ... per request and step
            draft = list(truth[n:n + max(0, k - (self.calls + n) % 3)])
            wrong = (self.calls * 7 + n) % (k + 3)
            if wrong < len(draft):
                draft[wrong] = (draft[wrong] + 1) % self.vocab_size
            if self.tree and draft:
                branches = [self._wrong(draft, (self.calls + n) % len(draft)), draft,
                            self._wrong(truth[n:n + k], (self.calls * 3 + n) % len(draft))]
                drafts.append(merge_continuations(branches, k))
            else:
                drafts.append(draft)
        return drafts

    def _wrong(self, tokens: list[int], at: int) -> list[int]:
        """The tokens with the one at `at` replaced (and cut after it)."""
        return tokens[:at] + [(tokens[at] + 2) % self.vocab_size]

    def draft_class(self, req: Any) -> int:
        return 0

    def release(self, req: Any) -> None:
        pass
