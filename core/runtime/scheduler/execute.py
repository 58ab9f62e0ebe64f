"""Runs the scheduler's steps through the model runner and applies their results: an extend step
(prefill chunks, jump-forward continuations, riding decodes) or a decode step, whose sampled tokens
TokenAdvance (advance.py) applies to their requests.

Overlap scheduling (enable_overlap_schedule): a decode step may be left pending, its tokens still on
the device; the next decode step of the same requests is launched with those tokens as its input
(`chain_decode`) before the pending one's results are applied, so the host work of step N (appending,
finish checks, stop strings, emitting) runs while the device computes step N+1. A request that step N
finishes has had one more token computed by step N+1: that token is dropped, and its KV slot went to
the radix cache with the request's others (it holds the finished token's KV, written by step N+1).
Where a request's sampling reads the token just sampled (its constraint's mask, a penalty, a seeded
draw, a min_new_tokens ban: `samples_late`), the chained step is sampled late: launched, then the pending
step applied, then sampled with the masks and penalties as of that token. The host work, masks included,
still runs while the device computes the chained step's forward; only the sampling waits for it.

An extend step that computes jump-forward text (continuations) with the running requests riding along
chains the same way (`chain_extend`): when the riders are the pending step's requests, each rides as a
one-token extend whose input is its pending token on the device, one position further on; the pending
step is applied while the extend computes (a rider it finishes or makes jump gives up its riding slot),
and the rows of the continuations and the riders still running are sampled late and left pending, in
the order of `running`, so that the next decode step chains on them. Otherwise (no pending step, the
riders not the running requests in order, no memory for their slots) the pending step is applied first
and the running requests ride on their applied tokens, unchained. A prefill of new prompts is launched
before the pending step is applied (`run_extend`), and nothing rides along it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from radixlm.core.runtime.options import EngineOptions
from radixlm.core.runtime.request import Req
from radixlm.core.runtime.execution.sampler import DeviceSample, Sampler, device_tensor
from radixlm.core.runtime.scheduler.batch import decode_batch, extend_batch, record_input_logprobs
from radixlm.core.runtime.scheduler.advance import TokenAdvance
from radixlm.core.runtime.scheduler.finish import Finish
from radixlm.core.runtime.scheduler.memory import KVMemory
from radixlm.core.runtime.scheduler.prefill import Extend
from radixlm.core.runtime.scheduler.queues import RequestQueues
from radixlm.core.runtime.stats import EngineStats


@dataclass
class PendingDecode:
    """A decode step launched and sampled but not applied: its requests, in batch order, and their
    tokens on the device."""

    reqs: list[Req]
    sample: DeviceSample


class Executor:
    def __init__(self, runner: Any, sampler: Sampler, memory: KVMemory, queues: RequestQueues, stats: EngineStats,
                 opts: EngineOptions, tokenizer: Any, eos_token_ids: list[int], context_len: int) -> None:
        self.runner = runner
        self.sampler = sampler
        self.memory = memory
        self.queues = queues
        self.stats = stats
        self.context_len = context_len
        self.advance = TokenAdvance(sampler, queues, stats, opts, tokenizer, eos_token_ids, context_len, runner.device)

    def run_extend(self, extends: list[Extend], pending: PendingDecode | None = None) -> None:
        """One extend step. A pending decode step (overlap) is applied after the extend is launched, so
        its host work runs while the device computes the extend; the extend's requests must not
        depend on its tokens (riding decodes do: `chain_extend`)."""
        batch, logit_use = extend_batch(extends)
        self.stats.prefill_tokens_total += len(batch.input_ids)
        logits = self.runner.forward(batch)
        if pending is not None:
            self.resolve(pending)
        to_sample = self._after_extend(extends, logit_use, logits)
        if to_sample:
            self.advance.sample_and_advance([r for r, _ in to_sample], logits[self._rows(to_sample, logits)])

    def chain_extend(self, extends: list[Extend], pending: PendingDecode) -> PendingDecode | None:
        """An extend step whose riding decodes are the pending step's requests (`PrefillPlanner.ride_ahead`),
        their input its tokens on the device, chained like `chain_decode`: launched, then the pending
        step applied while the device computes (a request it finishes or makes jump gives up its riding
        slot), then the rows of the continuations and riders still running sampled late, with the masks
        as of the applied tokens, and left pending in the order of `running`. Returns the new pending step."""
        batch, logit_use = extend_batch(extends, future=pending.sample.tokens)
        self.stats.prefill_tokens_total += len(batch.input_ids)
        logits = self.runner.forward(batch)
        kept = self._resolve_aside(pending)
        gone = {id(r) for r, keep in zip(pending.reqs, kept) if not keep}
        live = [(e, use) for e, use in zip(extends, logit_use) if id(e.req) not in gone]
        to_sample = self._after_extend([e for e, _ in live], [use for _, use in live], logits)
        if not to_sample:
            return None
        order = {id(r): k for k, r in enumerate(self.queues.running)}
        to_sample.sort(key=lambda item: order[id(item[0])])
        reqs, logits = [r for r, _ in to_sample], logits[self._rows(to_sample, logits)]
        try:
            return self._pending(reqs, logits)
        except Exception:
            self.advance.sample_and_advance(reqs, logits)
            return None

    def _after_extend(self, extends: list[Extend], logit_use: list[tuple[int, int, int]],
                      logits: torch.Tensor) -> list[tuple[Req, int]]:
        """Records input logprobs, caches prefixes, moves requests whose prompt completed to running;
        returns the requests to sample and their logit rows."""
        to_sample: list[tuple[Req, int]] = []
        for ext, (row0, first, count) in zip(extends, logit_use):
            req = ext.req
            if req.input_logprob_start() is not None and count:
                try:
                    record_input_logprobs(req, logits[row0 : row0 + count], first)
                except Exception:
                    self.queues.fail(req, "computing logprobs")
            if req.finished:
                continue
            if not ext.finishes_prompt:
                self.memory.cache_prefix(req)
                continue
            if not ext.rides_along:
                req.prefill_done = True
                if len(req.output_ids) >= req.params.max_new_tokens:
                    self.queues.finish(req, Finish("length"))  # max_new_tokens == 0: prefill (scoring) only
                    continue
                self.memory.cache_prefix(req)
                self.queues.running.append(req)
            to_sample.append((req, row0 + count - 1))
        return to_sample

    @staticmethod
    def _rows(to_sample: list[tuple[Req, int]], logits: torch.Tensor) -> torch.Tensor:
        return device_tensor([i for _, i in to_sample], torch.int64, logits.device)

    def run_decode(self, defer: bool = False) -> PendingDecode | None:
        """One decode step for the running requests. With `defer` (overlap) and every request chainable,
        the step is left pending: returned, its tokens still on the device."""
        queues = self.queues
        retract, fits = self.memory.make_decode_room(queues.running)
        for req in retract:
            queues.requeue(req, retracted=True)
        if not fits:
            queues.finish(queues.running[0], Finish("abort"),
                          error=f"KV pool of {self.memory.allocator.num_slots} tokens cannot hold this request")
        if not queues.running:
            return None
        reqs = list(queues.running)
        new_slots = self.memory.allocator.alloc(len(reqs))
        assert new_slots is not None
        logits = self.runner.forward(decode_batch(reqs, new_slots))
        if defer and self.chains(reqs):
            try:
                return self._pending(reqs, logits)
            except Exception:
                pass  # sample_and_advance samples again and finds the request at fault
        self.advance.sample_and_advance(reqs, logits)
        return None

    def chain_decode(self, pending: PendingDecode) -> PendingDecode | None:
        """Launches the next decode step of the pending step's requests, its input their tokens on the
        device, then applies the pending step's results (one step behind). Returns the new pending step.
        When the requests cannot chain (one is no longer chainable, no free slots) it applies the pending
        step first and runs a plain decode step instead."""
        reqs = pending.reqs
        new_slots = None
        if reqs == self.queues.running and self.chains(reqs):
            new_slots = self.memory.alloc(len(reqs))
        if new_slots is None:
            self.resolve(pending)
            return self.run_decode(defer=True)
        logits = self.runner.forward(decode_batch(reqs, new_slots, future=pending.sample.tokens))
        if any(self.samples_late(r) for r in reqs):
            return self._apply_then_sample(pending, logits)
        try:
            nxt = self._pending(reqs, logits)
        except Exception:
            self.resolve(pending)
            self.advance.sample_and_advance(reqs, logits)  # skips the requests that the pending step finished
            return None
        self.resolve(pending)
        return nxt

    def _apply_then_sample(self, pending: PendingDecode, logits: torch.Tensor) -> PendingDecode | None:
        """Late sampling of a chained step: applies the pending step, then samples the chained step for
        the requests still running."""
        reqs = pending.reqs
        keep = [i for i, kept in enumerate(self._resolve_aside(pending)) if kept]
        if not keep:
            return None
        if len(keep) < len(reqs):
            reqs, logits = [reqs[i] for i in keep], logits[device_tensor(keep, torch.int64, logits.device)]
        try:
            return self._pending(reqs, logits)
        except Exception:
            self.advance.sample_and_advance(reqs, logits)
            return None

    def _resolve_aside(self, pending: PendingDecode) -> list[bool]:
        """Applies the pending step with each of its requests set apart from its newest slot, the one the
        step launched after it (chained) wrote: as without overlap, a jump forward may then re-tokenize
        the applied token with the forced text. Requests still running take the slot back; the others
        (finished, or waiting to compute jumped text) give it up. Returns, per request, whether it kept it."""
        reqs = pending.reqs
        chained = [r.slots.pop() for r in reqs]
        try:
            self.resolve(pending)
        except BaseException:  # the step fails: discard_unapplied frees what running requests hold beyond their tokens
            for req, slot in zip(reqs, chained):
                if req.finished:
                    self.memory.allocator.free([slot])
                else:
                    req.slots.append(slot)
            raise
        running = {id(r) for r in self.queues.running}
        kept = []
        for req, slot in zip(reqs, chained):
            kept.append(id(req) in running)
            if kept[-1]:
                req.slots.append(slot)
            else:
                self.memory.allocator.free([slot])
        return kept

    def _pending(self, reqs: list[Req], logits: torch.Tensor) -> PendingDecode:
        """Samples the step on the device with the requests' masks and starts copying its tokens. Raises
        where a request's own host work does (its sampling values): the caller then samples the step
        with `sample_and_advance`, which finds the request at fault."""
        sample = self.sampler.sample_on_device(logits, reqs, self.advance.masks(reqs))
        sample.start_copy()
        return PendingDecode(reqs, sample)

    def resolve(self, pending: PendingDecode) -> None:
        """Applies a pending step's tokens; requests that finished meanwhile (in the step before it, or
        aborted) drop theirs."""
        result = pending.sample.resolve(pending.reqs)
        live = [i for i, r in enumerate(pending.reqs) if not r.finished]
        self.advance.apply([pending.reqs[i] for i in live], [(result, i) for i in live])

    def discard_unapplied(self) -> None:
        """After a failed step: gives back the slots held for tokens never applied (a chained step's
        input), so that each running request's slots match its tokens again before it is aborted."""
        for req in self.queues.running:
            extra = req.slots[req.seq_len:]
            if extra:
                del req.slots[req.seq_len:]
                self.memory.allocator.free(extra)

    def chains(self, reqs: list[Req]) -> bool:
        """Whether the requests' next decode step may be launched before their newest tokens are applied.
        Not for a lone request that may jump forward: a jump leaves its chained step unused, which at
        batch 1 is a whole step of the device (in a batch, one row of many)."""
        if len(reqs) == 1 and self.advance.jumps_forward(reqs[0]):
            return False
        return all(self.chainable(r) for r in reqs)

    def chains_extend(self, pending: PendingDecode) -> bool:
        """Whether an extend step may take the pending step's requests riding on its tokens: they are
        the running requests, in order, and each one's step after next fits its context."""
        return pending.reqs == self.queues.running and all(self.chainable(r) for r in pending.reqs)

    def chainable(self, req: Req) -> bool:
        """Whether the request's next step may be launched before its newest token is on the host: the
        step after next still fits its context."""
        return req.seq_len + 1 < self.context_len

    @staticmethod
    def samples_late(req: Req) -> bool:
        """Whether sampling the request's next token reads its newest one: a constraint mask, a penalty,
        a min_new_tokens ban or a seeded draw (keyed by the output position)."""
        p = req.params
        return (req.constraint is not None or p.seed is not None or len(req.output_ids) < p.min_new_tokens
                or p.repetition_penalty != 1.0 or bool(p.frequency_penalty) or bool(p.presence_penalty))
