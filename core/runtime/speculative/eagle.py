"""The `eagle` and `eagle3` proposers: an EAGLE head (core.runtime.models.eagle) drafts a chain of tokens
from the target's hidden states (EAGLE-1/2: the final ones; EAGLE-3: three layers' inputs). It is the draft-model proposer with another input per position: where a
draft model reads token x_i at position i, the head reads the target's hidden state h_i with the token
after it, x_{i+1}; a draft step past the target's tokens reads the head's own output instead of h.

The target's runner hands every eager step's hidden states to `observe_target` (which is why its CUDA
graphs are off with EAGLE), kept per request row and position until the head has read them. Positions
the target did not compute for the request (a prefix found in the radix cache) enter the head with a
zero feature: exact all the same (the target verifies), its first drafts there weaker. The head's KV
holds only positions read from the target's states: the chain's are freed after each proposal."""

from __future__ import annotations

from typing import Any

import torch

from radixlm.core.runtime.execution.batch_input import BatchInput
from radixlm.core.runtime.request import Req
from radixlm.core.runtime.speculative.draft_model import DraftModelProposer


class EagleProposer(DraftModelProposer):
    name = "eagle"  # "eagle3" for an EAGLE-3 head (set by the builder)

    def __init__(self, runner: Any, target_runner: Any, vocab_size: int, aux: bool = False) -> None:
        """`runner`: a ModelRunner over the head; `target_runner`: the target's, observed; `aux`: the head
        reads the target's aux_hidden (EAGLE-3: three layers' inputs) instead of its final hidden states."""
        super().__init__(runner, vocab_size)
        self.target_model = target_runner.model
        self.aux = aux
        self.width = target_runner.cfg.hidden_size * (3 if aux else 1)  # of a target state
        # target row -> [(first position, hidden states of it and the next positions)], in position order
        self.states: dict[int, list[tuple[int, torch.Tensor]]] = {}
        self.out: dict[Req, torch.Tensor] = {}  # the head's newest output per request, [1, hidden]
        self.in_step: list[Req] = []  # the requests of the head's next forward, in its order
        target_runner.hidden_sink = self.observe_target
        runner.hidden_sink = self._observe_head

    def observe_target(self, batch: BatchInput, hidden: torch.Tensor) -> None:
        """Keeps each request's hidden states of the step's positions; what it held at those positions or
        after them was computed on tokens since rejected (or recomputed), and goes."""
        if self.aux:
            hidden = self.target_model.aux_hidden
        at = 0
        for row, n in zip(batch.rows, batch.extend_lens):
            first = batch.positions[at]
            kept = [(s, h if s + len(h) <= first else h[:first - s])
                    for s, h in self.states.get(row, []) if s < first]
            kept.append((first, hidden[at:at + n]))
            self.states[row] = kept
            at += n

    def _observe_head(self, batch: BatchInput, hidden: torch.Tensor) -> None:
        rows = hidden[batch.logit_rows]
        for i, req in enumerate(self.in_step):
            self.out[req] = rows[i:i + 1]

    def propose(self, reqs: list[Req], budgets: list[int]) -> list[list[int]]:
        drafts = super().propose(reqs, budgets)
        self._forget_drafts(reqs)
        return drafts

    def _forget_drafts(self, reqs: list[Req]) -> None:
        """Keeps only the head's KV and states of positions the target computed."""
        for req in reqs:
            kv, fed = self.held.get(req), len(req.fill_ids) - 1
            if kv is not None:
                self.allocator.free(kv.slots[fed:])
                del kv.slots[fed:], kv.ids[fed:]
                self.states[req.row] = [(s, h[max(0, fed - s):]) for s, h in self.states.get(req.row, [])
                                        if s + len(h) > fed]
        self.out.clear()

    def release(self, req: Req) -> None:
        super().release(req)
        if req.row is not None:
            self.states.pop(req.row, None)

    def _kv_tokens(self, req: Req) -> list[int]:
        """Position i of the head reads the token after it: x_{i+1}."""
        return req.fill_ids[1:]

    def _feed(self, spans: list[tuple[Req, int, int]]) -> None:
        parts = [self._target_states(req.row, start, end) for req, start, end in spans]
        self.runner.model.features = torch.cat(parts)
        self.in_step = [req for req, _, _ in spans]

    def _feed_chain(self, reqs: list[Req]) -> None:
        self.runner.model.features = torch.cat([self.out[r] for r in reqs])
        self.in_step = list(reqs)

    def _target_states(self, row: int, start: int, end: int) -> torch.Tensor:
        """The target's hidden states of positions [start, end) of a request, zeros where it has none."""
        runner = self.runner
        out = torch.zeros(end - start, self.width, dtype=runner.dtype, device=runner.device)
        for s, h in self.states.get(row, []):
            lo, hi = max(s, start), min(s + len(h), end)
            if lo < hi:
                out[lo - start:hi - start] = h[lo - s:hi - s]
        return out
