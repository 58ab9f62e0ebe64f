"""The scheduler's speculative unit: where a decode step would run, it asks the proposer for drafts (of the
lengths the DraftPolicy finds worth checking) and, when any request has one, runs a verify step instead:
one extend step of every running request's newest token and its draft (requests without one ride along as
one-token extends), sampled at every position. Each request keeps the draft tokens the target agrees
with and the target's own token after them; the KV slots of the rejected positions are freed at once, so
the request (and the radix cache after it) only ever holds KV of accepted tokens."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from radixlm.core.runtime.request import Req, Status
from radixlm.core.runtime.execution.sampler import SampleResult, device_tensor
from radixlm.core.runtime.speculative.policy import DraftPolicy
from radixlm.core.runtime.speculative.proposer import Proposer
from radixlm.core.runtime.speculative.state import SpecState
from radixlm.core.runtime.speculative.tree import DraftTree, accepted_path
from radixlm.core.runtime.speculative.verify import constrained_draft, verify_batch, views

logger = logging.getLogger("radixlm")


class Speculator:
    def __init__(self, proposer: Proposer, executor: Any, max_draft: int, adaptive: bool, context_len: int) -> None:
        """`executor` is the scheduler's Executor: its runner, sampler, memory, queues, stats and
        TokenAdvance are the ones a decode step uses. `adaptive`: draft lengths from a DraftPolicy (else
        always the most that fits)."""
        self.proposer = proposer
        self.executor = executor
        self.max_draft = max_draft
        self.policy = DraftPolicy(executor.runner.device.type) if adaptive else None
        self.context_len = context_len
        self.packed = executor.runner.device.type == "cuda"  # as TokenAdvance.masks

    def state(self, req: Req) -> SpecState:
        if req.spec is None:
            req.spec = SpecState()
        return req.spec

    def step(self) -> None:
        """One step of the running requests: a verify step where any has a draft worth checking, else a
        decode step (also when memory is short: it retracts if it must). Both are timed for the policy."""
        ex = self.executor
        start = time.perf_counter()
        reqs = list(ex.queues.running)
        drafts, masks = self._drafts(reqs)
        slots = ex.memory.alloc(sum(len(d) + 1 for d in drafts)) if any(drafts) else None
        if slots is None:
            ex.run_decode()
            if self.policy is not None:
                self.policy.times.record_decode(len(reqs), time.perf_counter() - start)
            return
        batch, own = verify_batch(reqs, drafts, slots, ex.memory.table)
        ex.stats.spec_verify_steps_total += 1
        logits = ex.runner.forward(batch)
        self._accept(reqs, drafts, own, masks, logits)
        if self.policy is not None:
            self.policy.times.record_verify(len(batch.input_ids), time.perf_counter() - start)

    def _drafts(self, reqs: list[Req]) -> tuple[list[DraftTree], list[list[torch.Tensor | None]]]:
        """Each request's draft (without the nodes its grammar forbids, cut to the policy's length) and the
        grammar's mask at each of its verify rows."""
        rooms = [self._room(r) for r in reqs]
        # A tree proposer's budget is nodes (its deeper ones are cut below); a chain's, both limits.
        trees = getattr(self.proposer, "trees", False)
        caps = [nodes if trees else min(nodes, depth) for nodes, depth in rooms]
        states = [self.state(r) for r in reqs]
        if self.policy is not None and not self.proposer.free:  # size the drafts before paying for them
            caps = self.policy.lengths(states, [s.draft_class for s in states], caps)
        proposed = self.proposer.propose(reqs, caps) if any(caps) else [[] for _ in reqs]
        drafts = [d if isinstance(d, DraftTree) else DraftTree.chain(d) for d in proposed]
        masks: list[list[torch.Tensor | None]] = []
        for i, req in enumerate(reqs):
            try:
                drafts[i], req_masks = constrained_draft(req, drafts[i].cut(caps[i]).within_depth(rooms[i][1]),
                                                         self.executor.sampler.vocab_size, self.packed)
            except Exception:  # its constraint fails: the decode path finds that and ends the request
                logger.exception("drafting for request %s failed; it decodes without a draft", req.rid)
                drafts[i], req_masks = DraftTree([], []), [None]
            masks.append(req_masks)
            if drafts[i]:
                states[i].draft_class = self.proposer.draft_class(req)
        if self.policy is not None:
            lengths = self.policy.lengths(states, [s.draft_class for s in states], [len(d) for d in drafts])
            for i, k in enumerate(lengths):
                drafts[i], masks[i] = drafts[i].cut(k), masks[i][:k + 1]
                if not k:
                    states[i].idle()
        return drafts, masks

    def _room(self, req: Req) -> tuple[int, int]:
        """The draft nodes the request may take this step (speculative_num_draft_tokens, within the
        context: its verify rows take table columns) and the draft's depth (within max_new_tokens and the
        context, as the target adds one token after the kept ones). A chain's length is both."""
        left = self.context_len - req.seq_len
        depth = min(req.params.max_new_tokens - len(req.output_ids), left) - 1
        return max(0, min(self.max_draft, left)), max(0, min(self.max_draft, depth))

    def _accept(self, reqs: list[Req], drafts: list[DraftTree], own: list[list[int]],
                masks: list[list[torch.Tensor | None]], logits: torch.Tensor) -> None:
        """Samples every row and applies each request's accepted path (tree.accepted_path: the target's
        own token at every row it keeps, so outputs keep the target's distribution). The path's KV slots
        become the request's next positions; every other row's are freed in this step."""
        ex = self.executor
        rows = [v for req, draft in zip(reqs, drafts) for v in views(req, draft)]
        try:
            result = ex.sampler.sample(logits, rows, [m for ms in masks for m in ms])
            results: list[tuple[SampleResult, int] | None] = []
            at = 0
            for draft in drafts:
                results.append((result, at))
                at += len(draft) + 1
        except Exception:  # find the request(s) at fault: sample each alone
            logger.warning("sampling a verify step of %d requests failed; sampling them one by one", len(reqs))
            results = self._sample_alone(reqs, drafts, masks, logits)
        now = time.monotonic()
        for req, draft, slots, row in zip(reqs, drafts, own, results):
            if row is None:
                ex.memory.allocator.free(slots)
                ex.queues.fail(req, "sampling")
                continue
            result, first = row
            path = accepted_path(draft, result.token_ids[first:first + len(draft) + 1])
            on_path = [0] + [node + 1 for node in path]  # the verify rows kept
            kept = [slots[r] for r in on_path]
            ex.memory.allocator.free([s for r, s in enumerate(slots) if r not in on_path])  # the rejected rows' KV
            if draft.tokens:
                if not draft.is_chain:  # the path's slots, scattered among the tree's, become its next positions
                    ex.memory.table.write(req.row, req.seq_len - 1, kept)
                    kept_rows = getattr(self.proposer, "kept_rows", None)  # (Proposer's optional hook)
                    if kept_rows is not None:
                        kept_rows(req, on_path)
                cut = draft.has_children(path[-1] if path else -1)
                if self.policy is not None:
                    self.policy.record(req.spec, len(draft), len(path), cut)
                else:
                    req.spec.record(len(draft), len(path), cut)
                ex.stats.record_verify(len(draft), len(path))
            self._apply(req, result, [first + r for r in on_path], kept, now)

    def _apply(self, req: Req, result: SampleResult, rows: list[int], slots: list[int], now: float) -> None:
        """Applies the request's accepted tokens (the samples at `rows` of the result) one by one, as decode
        steps would, its KV growing with them: after each token the request holds the KV of every token
        but its newest. A token that ends the request, or makes it jump forward (it waits again), ends the
        run; the rest's KV is freed."""
        advance = self.executor.advance
        req.slots.append(slots[0])  # its newest token, computed by this step
        for j in range(len(slots)):
            advance.apply_token(req, result, rows[j], now)
            if req.status is not Status.RUNNING:
                self.executor.memory.allocator.free(slots[j + 1:])
                return
            if j + 1 < len(slots):
                req.slots.append(slots[j + 1])

    def _sample_alone(self, reqs: list[Req], drafts: list[DraftTree], masks: list[list[torch.Tensor | None]],
                      logits: torch.Tensor) -> list[tuple[SampleResult, int] | None]:
        ex, out, at = self.executor, [], 0
        for req, draft, req_masks in zip(reqs, drafts, masks):
            n = len(draft) + 1
            index = device_tensor(list(range(at, at + n)), torch.int64, logits.device)
            at += n
            try:
                out.append((ex.sampler.sample(logits[index], views(req, draft), req_masks), 0))
            except Exception:
                logger.exception("sampling the verify rows of request %s failed", req.rid)
                out.append(None)
        return out
