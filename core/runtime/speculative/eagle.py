"""The `eagle` and `eagle3` proposers: an EAGLE head (core.runtime.models.eagle) drafts a chain of tokens
from the target's hidden states (EAGLE-1/2: the final ones; EAGLE-3: three layers' inputs). It is the
draft-model proposer with another input per position: where a draft model reads token x_i at position
i, the head reads the target's hidden state h_i with the token after it, x_{i+1}; a draft step past the
target's tokens reads the head's own output instead of h.

The target's runner hands every step's exported hidden states (core.runtime.execution.hidden_export: the
final ones or EAGLE-3's three; on CUDA its decode graphs and the verify steps replayed on them copy them
into a static buffer) to `observe_target`, kept per request row and position until the head has read
them. Positions the target did not compute for the request (a prefix found in the radix cache) enter
the head with a zero feature: exact all the same (the target verifies), its first drafts there weaker.
The head's KV holds only positions read from the target's states: the chain's are freed after each
proposal."""

from __future__ import annotations

from typing import Any

import torch

from radixlm.core.runtime.execution.batch_input import BatchInput
from radixlm.core.runtime.request import Req
from radixlm.core.runtime.speculative.draft_model import DraftModelProposer

# A request's kept states are joined into one tensor of their own once they are this many pieces (one a
# step): each piece is a view of a whole step's copy, which would stay alive, every row of the batch,
# for as long as one request that has not drafted since (the head has not read its states) holds it.
MAX_STATE_PIECES = 16


class EagleProposer(DraftModelProposer):
    name = "eagle"  # "eagle3" for an EAGLE-3 head (set by the builder)

    def __init__(self, runner: Any, target_runner: Any, vocab_size: int) -> None:
        """`runner`: a ModelRunner over the head, exporting its final hidden states (the head's outputs);
        `target_runner`: the target's, observed: what it exports (`export`) is what the head reads."""
        super().__init__(runner, vocab_size)
        if target_runner.export is None or runner.export is None:
            raise ValueError("an EAGLE proposer needs runners that export hidden states")
        self.width = target_runner.export.width(target_runner.cfg.hidden_size)  # of a target state
        # target row -> [(first position, hidden states of it and the next positions)], in position order
        self.states: dict[int, list[tuple[int, torch.Tensor]]] = {}
        self.out: dict[Req, torch.Tensor] = {}  # the head's newest output per request, [1, hidden]
        self.in_step: list[Req] = []  # the requests of the head's next forward, in its order
        target_runner.hidden_sink = self.observe_target
        runner.hidden_sink = self._observe_head

    def observe_target(self, batch: BatchInput, hidden: torch.Tensor) -> None:
        """Keeps each request's hidden states of the step's positions; what it held at those positions or
        after them was computed on tokens since rejected (or recomputed), and goes. `hidden` is valid until
        the runner's next step (a graph's static buffer): what is kept is a copy."""
        hidden = hidden.clone()
        at = 0
        for row, n in zip(batch.rows, batch.extend_lens):
            first = batch.positions[at]
            kept = [(s, h if s + len(h) <= first else h[:first - s])
                    for s, h in self.states.get(row, []) if s < first]
            if len(kept) >= MAX_STATE_PIECES:
                kept = _joined(kept)
            kept.append((first, hidden[at:at + n]))  # last, whole: a tree's kept_rows reorders it
            self.states[row] = kept
            at += n

    def _observe_head(self, batch: BatchInput, hidden: torch.Tensor) -> None:
        rows = hidden[batch.logit_rows]  # a copy (hidden may be a graph's static buffer)
        for i, req in enumerate(self.in_step):
            self.out[req] = rows[i:i + 1]

    def propose(self, reqs: list[Req], budgets: list[int]) -> list[list[int]]:
        drafts = super().propose(reqs, budgets)
        self._forget_drafts(reqs)
        return drafts

    def _forget_drafts(self, reqs: list[Req]) -> None:
        """Keeps the head's KV of positions the target computed only, and the states the head has not read."""
        for req in reqs:
            kv, fed = self.held.get(req), len(req.fill_ids) - 1
            if kv is not None:
                self.allocator.free(kv.slots[fed:])
                del kv.slots[fed:], kv.ids[fed:]
                self._forget_states(req.row, len(kv.ids))  # short of fed where the head did not catch up
        self.out.clear()

    def _forget_states(self, row: int, before: int) -> None:
        """Drops the row's states of positions below `before` (the head's KV holds them now)."""
        self.states[row] = [(max(s, before), h[max(0, before - s):]) for s, h in self.states.get(row, [])
                            if s + len(h) > before]

    def release(self, req: Req) -> None:
        super().release(req)
        if req.row is not None:
            self.states.pop(req.row, None)

    def _kv_tokens(self, req: Req) -> list[int]:
        """Position i of the head reads the token after it: x_{i+1}."""
        return req.fill_ids[1:]

    def _features(self, spans: list[tuple[Req, int, int]]) -> torch.Tensor:
        self.in_step = [req for req, _, _ in spans]
        return torch.cat([self._target_states(req.row, start, end) for req, start, end in spans])

    def _chain_features(self, reqs: list[Req]) -> torch.Tensor:
        self.in_step = list(reqs)
        return torch.cat([self.out[r] for r in reqs])

    def _target_states(self, row: int, start: int, end: int) -> torch.Tensor:
        """The target's hidden states of positions [start, end) of a request, zeros where it has none."""
        runner = self.runner
        out = torch.zeros(end - start, self.width, dtype=runner.dtype, device=runner.device)
        for s, h in self.states.get(row, []):
            lo, hi = max(s, start), min(s + len(h), end)
            if lo < hi:
                out[lo - start:hi - start] = h[lo - s:hi - s]
        return out


def _joined(pieces: list[tuple[int, torch.Tensor]]) -> list[tuple[int, torch.Tensor]]:
    """The pieces (in position order) with each run of adjacent positions copied into one tensor."""
    runs: list[tuple[int, list[torch.Tensor]]] = []
    for s, h in pieces:
        if runs and runs[-1][0] + sum(len(x) for x in runs[-1][1]) == s:
            runs[-1][1].append(h)
        else:
            runs.append((s, [h]))
    return [(s, torch.cat(parts)) for s, parts in runs]
