"""The scheduler loop: owns the waiting queue, the running batch, the radix cache and the model runner.

Each step it either prefills (new requests, or the next chunk of a long prompt) or decodes one token
for every running request; new prefills join the running batch as soon as they finish (continuous
batching). When KV memory runs short it evicts cached prefixes, then retracts running requests,
which later resume from where they were with identical greedy output. It talks to the front end only
through messages (core.engine.messages): requests, aborts and calls on `inbox`, outputs and call replies
on `outbox`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from radixlm.core.constrained import GrammarBudget, build_constraint
from radixlm.core.tokenizer.detokenizer import IncrementalDetokenizer
from radixlm.core.engine.messages import (
    Abort, CallReply, CheckInvariants, FinishReason, FlushCache, GenerateOutput, GenerateRequest, GetStats,
    InboxMessage, OutboxMessage, StatsSnapshot,
)
from radixlm.core.engine.memory_pool import SlotAllocator
from radixlm.core.engine.model_runner import BatchInput, ModelRunner
from radixlm.core.engine.options import EngineOptions
from radixlm.core.engine.radix_cache import RadixCache
from radixlm.core.engine.request import Req, Status
from radixlm.core.engine.sampler import SampleResult, Sampler, top_logprob_entries
from radixlm.core.engine.schedule_policy import SchedulePolicy
from radixlm.core.engine.stats import EngineStats, TimedRadixCache

logger = logging.getLogger("radixlm")

# A waiting request whose new tokens share at least this many leading tokens with a request already
# in this prefill batch waits one step, so it reuses that prefix from the cache instead of recomputing
# it alongside (what makes a batch of prompts with a shared prefix compute the prefix once).
IN_BATCH_SHARED_PREFIX = 16
# Jump-forward continuations wait (decoding goes on) until they are a quarter of the running batch or
# have waited this many steps.
JUMP_GATHER_RATIO = 4
JUMP_GATHER_STEPS = 4


@dataclass
class _Extend:
    req: Req
    start: int  # first position computed in this step
    length: int  # new tokens in this step
    finishes_prompt: bool  # the chunk reaches the end of fill_ids: sample the next token after it
    rides_along: bool = False  # a running request decoding its next token inside this extend step


class Scheduler:
    def __init__(self, runner: ModelRunner, opts: EngineOptions, tokenizer, eos_token_ids: list[int]) -> None:
        self.runner = runner
        self.opts = opts
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        # What one request may use in all (the Engine admits nothing longer): the model's context (or the
        # context_length option), or the KV pool when that is smaller.
        self.context_len = min(opts.context_length or runner.cfg.context_len, runner.num_slots)
        self.allocator = SlotAllocator(runner.num_slots)
        self.stats = EngineStats()
        self.tree = TimedRadixCache(RadixCache(self.allocator, disable=opts.disable_radix_cache), self.stats)
        self.policy = SchedulePolicy(opts.schedule_policy, opts.schedule_fairness_bound, self.tree, opts.random_seed)
        self.generator = torch.Generator(device=runner.device).manual_seed(opts.random_seed)
        self.sampler = Sampler(runner.cfg.vocab_size, eos_token_ids, self.generator)
        self.inbox: "queue.Queue[InboxMessage]" = queue.Queue()
        self.outbox: "queue.Queue[OutboxMessage]" = queue.Queue()
        # In its own process the loop also puts its statistics on the outbox, at most this often (s).
        self.publish_interval: float | None = None
        self._published_at = 0.0
        self._budget = GrammarBudget(max_compile_seconds=opts.grammar_max_compile_seconds,
                                     max_configs=opts.grammar_max_configs)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked: Req | None = None  # a request midway through a chunked prefill
        self.live: dict[str, Req] = {}  # rid -> request not finished: aborts find theirs in O(1)
        self._waiting_has_finished = False  # finished requests left in `waiting`, dropped in one pass
        # Read by other threads without waiting for the loop: when it last got anything done, and the
        # statistics as of then (replaced whole, never mutated).
        self.last_progress = time.monotonic()
        self.snapshot: dict[str, Any] = {}
        self._arrivals = 0
        self._jump_wait = 0  # decode steps jump-forward continuations have been left waiting
        self._stop = threading.Event()

    # ---- the loop --------------------------------------------------------------------------

    def run_forever(self) -> None:
        self._publish()
        while not self._stop.is_set():
            self._drain_inbox(block=not (self.waiting or self.running or self.chunked))
            if self._stop.is_set():
                break
            try:
                self.step()
            except Exception:  # a failure of the batch itself (not of one request's own work)
                logger.exception("scheduler step failed; aborting the requests in flight")
                self._abort_all("internal server error (the server log has the details)", status_code=500)
            self._publish()
        self._abort_all("engine shut down")
        self._publish()

    def _publish(self, force: bool = False) -> None:
        self.snapshot = self.get_stats()
        self.last_progress = time.monotonic()
        if self.publish_interval is not None and (force or self.last_progress - self._published_at >= self.publish_interval):
            self._published_at = self.last_progress
            self.outbox.put(StatsSnapshot(self.snapshot, self.last_progress))

    def stop(self) -> None:
        self._stop.set()
        self.inbox.put(None)

    def step(self) -> None:
        self._sweep_waiting()
        extends = self._schedule_prefill()
        if extends:
            if self.running and all(e.req.output_ids for e in extends):
                # Only continuations (jump-forward text, resumed requests): a few tokens, so the running
                # requests decode in the same step instead of stalling behind it.
                extends += self._ride_along()
            self._run_extend(extends)
        elif self.running:
            self._run_decode()
        if self.opts.debug_check_invariants:
            self.check_invariants()

    def _drain_inbox(self, block: bool) -> None:
        while True:
            try:
                msg = self.inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            self.last_progress = time.monotonic()
            if msg is None:  # stop (what stop() sends; a front end in another process sends it too)
                self._stop.set()
                return
            if isinstance(msg, GenerateRequest):
                self._add_request(msg)
            elif isinstance(msg, Abort):
                self._abort(msg.rid, "aborted by request")
            elif isinstance(msg, (FlushCache, GetStats, CheckInvariants)):
                self._answer(msg)

    def _answer(self, call: FlushCache | GetStats | CheckInvariants) -> None:
        reply = CallReply(call.call_id)
        try:
            if isinstance(call, FlushCache):
                reply.value = self.flush_cache()
            elif isinstance(call, GetStats):
                reply.value = self.get_stats()
            else:
                self.check_invariants()
        except Exception as exc:
            reply.error = exc
        self._publish(force=True)  # what the caller reads next (a flush, say) shows in the snapshot
        self.outbox.put(reply)

    def _add_request(self, inp: GenerateRequest) -> None:
        p = inp.sampling_params
        # The scheduler decodes only to find stop strings (the output text is the front end's); a stream
        # decodes as it goes too, so that jump-forward replaces only tokens the front end has decoded.
        lazy = not (inp.stream or p.stop)
        detok = IncrementalDetokenizer(self.tokenizer, p.skip_special_tokens, p.stop, p.no_stop_trim, lazy=lazy)
        req = Req(inp=inp, detok=detok, arrival=self._arrivals)
        self._arrivals += 1
        self.stats.requests_total += 1
        self.waiting.append(req)
        if inp.rid in self.live:  # the Engine refuses these; a front end that does not must not hijack one
            self._finish(req, "abort", None, error=f"request id {inp.rid!r} is already in use", status_code=400)
            return
        self.live[inp.rid] = req
        if inp.constraint is not None:
            try:
                req.constraint = self._build_constraint(inp)
                self._jump_forward(req)  # text forced from the very start goes in with the prompt
            except ValueError as e:  # the front end validated the spec: only another front end gets here
                self._finish(req, "abort", None, error=f"invalid {inp.constraint.kind}: {e}", status_code=400)
            except Exception:
                self._fail(req, "constraining")

    def _build_constraint(self, inp: GenerateRequest) -> Any:
        """The request's live constraint, built from its spec (a cache hit when the front end compiled
        the same spec in this process to validate it)."""
        spec = inp.constraint
        return build_constraint(spec.kind, spec.value(), self.tokenizer, eos_token_ids=self.eos_token_ids,
                                backend=self.opts.grammar_backend, budget=self._budget)

    def _sweep_waiting(self) -> None:
        if self._waiting_has_finished:
            self.waiting = [r for r in self.waiting if not r.finished]
            self._waiting_has_finished = False

    # ---- prefill ---------------------------------------------------------------------------

    def _schedule_prefill(self) -> list[_Extend]:
        budget = self.opts.chunked_prefill_size if self.opts.chunked_prefill_size > 0 else 1 << 62
        extends: list[_Extend] = []
        if self.chunked is not None:
            req, self.chunked = self.chunked, None
            ext = self._plan_extend(req, budget)
            if ext is None:
                self.chunked = req
                return []
            extends.append(ext)
            budget -= ext.length
            if not ext.finishes_prompt:
                self.chunked = req
        if not self.waiting or budget <= 0 or self.chunked is not None:
            return extends
        if not extends and self._defer_jumps():
            return []
        slots_left = self.opts.max_running_requests - len(self.running) - len(extends)
        in_batch: list[list[int]] = []
        taken: set[int] = set()
        for req in self.policy.order(self.waiting):
            if slots_left <= 0 or budget <= 0:
                break
            if self.runner.req_to_token.available() == 0:
                break
            if self._shares_with_batch(req, in_batch):
                continue
            ext = self._plan_extend(req, budget)
            if ext is None:
                break  # out of memory: later requests must not overtake this one
            taken.add(id(req))
            extends.append(ext)
            in_batch.append(req.fill_ids)
            budget -= ext.length
            slots_left -= 1
            if not ext.finishes_prompt:
                self.chunked = req
                break
        if extends:
            for req in self.waiting:
                if id(req) not in taken:
                    req.passed_over += 1
            self.waiting = [r for r in self.waiting if id(r) not in taken]
        return extends

    def _defer_jumps(self) -> bool:
        """When only jump-forward continuations wait, and few next to the decoding batch, let them
        gather for a few steps: one extend step for many jumps instead of an eager (not graph-captured)
        extend step nearly every step, which made jump-forward slower than plain decoding at batch 64."""
        if (self.running and all(r.row is not None for r in self.waiting)
                and len(self.waiting) * JUMP_GATHER_RATIO < len(self.running)
                and self._jump_wait < JUMP_GATHER_STEPS):
            self._jump_wait += 1
            return True
        self._jump_wait = 0
        return False

    def _ride_along(self) -> list[_Extend]:
        """Running requests as one-token extends, for as many as memory allows now."""
        rides = []
        for req in self.running:
            ext = self._plan_extend(req, 1)
            if ext is None:
                break
            ext.rides_along = True
            rides.append(ext)
        return rides

    def _shares_with_batch(self, req: Req, in_batch: list[list[int]]) -> bool:
        if self.tree.disable or not in_batch:
            return False
        ids = req.fill_ids
        # Shares >= IN_BATCH_SHARED_PREFIX tokens past its cached prefix with a request in the batch:
        # a slice comparison (in C) instead of walking every pair token by token.
        need = len(self.tree.match_prefix(ids)[0]) + IN_BATCH_SHARED_PREFIX
        head = ids[:need]
        return len(head) == need and any(other[:need] == head for other in in_batch)

    def _plan_extend(self, req: Req, budget: int) -> _Extend | None:
        """Matches the request's prefix, allocates KV for its next chunk, and fills its table row.
        Returns None (with nothing held) when memory does not allow it now."""
        fill = req.fill_ids
        if req.row is None:
            # The last token is always computed (its logits give the next token); input logprobs
            # need the logits of every position from the first wanted one.
            limit = len(fill) - 1
            start = req.input_logprob_start()
            if start is not None:
                limit = min(limit, max(start - 1, 0))
            slots, node = self.tree.match_prefix(fill[:limit])
            self.tree.inc_lock_ref(node)
            length = min(len(fill) - len(slots), budget)
            new = self._alloc(length)
            if new is None:
                self.tree.dec_lock_ref(node)
                return None
            req.row = self.runner.req_to_token.alloc()
            req.slots, req.cached_len, req.last_node = list(slots), len(slots), node
            if req.cached_tokens is None:  # first scheduled
                req.cached_tokens = len(slots)
                req.scheduled_time = time.monotonic()
                self.stats.cached_tokens_total += len(slots)
                self.stats.prompt_tokens_total += len(req.inp.input_ids)
            self.runner.req_to_token.write(req.row, 0, slots)
        else:
            length = min(len(fill) - req.kv_len, budget)
            new = self._alloc(length)
            if new is None:
                return None
        start = req.kv_len
        self.runner.req_to_token.write(req.row, start, new)
        req.slots.extend(new)
        req.status = Status.RUNNING
        return _Extend(req, start, length, finishes_prompt=start + length == len(fill))

    def _alloc(self, n: int) -> list[int] | None:
        slots = self.allocator.alloc(n)
        if slots is None:
            self.tree.evict(n - self.allocator.available())
            slots = self.allocator.alloc(n)
        return slots

    def _run_extend(self, extends: list[_Extend]) -> None:
        batch = BatchInput(False, [], [], [], [], [], [], [])
        # Per request: which rows of this step's logits it uses (input logprob rows, then sampling row).
        logit_use: list[tuple[int, int, int]] = []  # (first logit index, first position, count)
        for ext in extends:
            req, base = ext.req, len(batch.input_ids)
            end = ext.start + ext.length
            batch.input_ids.extend(req.fill_ids[ext.start:end])
            batch.positions.extend(range(ext.start, end))
            batch.out_cache_loc.extend(req.slots[ext.start:end])
            batch.rows.append(req.row)
            batch.seq_lens.append(end)
            batch.extend_lens.append(ext.length)
            # Logits are needed from the first input-logprob position on, and at the last prompt
            # position when the prompt completes (it gives the next token).
            lp_start = req.input_logprob_start()
            first = end if lp_start is None else min(max(lp_start - 1, ext.start), end)
            if ext.finishes_prompt:
                first = min(first, end - 1)
            logit_use.append((len(batch.logit_rows), first, end - first))
            batch.logit_rows.extend(range(base + first - ext.start, base + end - ext.start))
        self.stats.prefill_tokens_total += len(batch.input_ids)
        logits = self.runner.forward(batch)

        to_sample: list[tuple[Req, int]] = []
        for ext, (row0, first, count) in zip(extends, logit_use):
            req = ext.req
            if req.input_logprob_start() is not None and count:
                try:
                    self._record_input_logprobs(req, logits[row0 : row0 + count], first)
                except Exception:
                    self._fail(req, "computing logprobs")
            if req.finished:
                continue
            if not ext.finishes_prompt:
                self._cache_prefix(req)
                continue
            if not ext.rides_along:
                req.prefill_done = True
                if len(req.output_ids) >= req.params.max_new_tokens:
                    self._finish(req, "length", None)  # max_new_tokens == 0: prefill (scoring) only
                    continue
                self._cache_prefix(req)
                self.running.append(req)
            to_sample.append((req, row0 + count - 1))
        if to_sample:
            rows = torch.tensor([i for _, i in to_sample], device=logits.device)
            self._sample_and_advance([r for r, _ in to_sample], logits[rows])

    def _record_input_logprobs(self, req: Req, logits: torch.Tensor, first_pos: int) -> None:
        """logits[j] is the distribution after position first_pos + j, i.e. over token first_pos + j + 1."""
        prompt = req.inp.input_ids
        start = req.input_logprob_start()
        if start == 0 and not req.input_token_logprobs:
            req.input_token_logprobs.append((None, prompt[0], None))
            req.input_top_logprobs.append(None)
        logprobs = torch.log_softmax(logits, dim=-1)
        for j in range(logits.shape[0]):
            target = first_pos + j + 1
            if target >= len(prompt) or target < start:
                continue
            req.input_token_logprobs.append((float(logprobs[j, prompt[target]]), prompt[target], None))
            k = req.inp.top_logprobs_num
            req.input_top_logprobs.append(top_logprob_entries(logprobs[j], k) if k else None)

    def _cache_prefix(self, req: Req) -> None:
        """Caches what the request has computed so far, so its next chunk and other requests reuse it
        while it is still running."""
        if self.tree.disable:
            return
        slots, node = self.tree.cache_unfinished(req.fill_ids[: req.kv_len], req.slots, req.cached_len, req.last_node)
        req.slots, req.cached_len, req.last_node = list(slots), len(slots), node
        self.runner.req_to_token.write(req.row, 0, slots)

    # ---- decode ----------------------------------------------------------------------------

    def _run_decode(self) -> None:
        self._ensure_decode_memory()
        if not self.running:
            return
        new_slots = self.allocator.alloc(len(self.running))
        assert new_slots is not None
        batch = BatchInput(True, [], [], new_slots, [], [], [1] * len(self.running), list(range(len(self.running))))
        for req, slot in zip(self.running, new_slots):  # the runner records the slots in req_to_token
            pos = req.seq_len - 1
            req.slots.append(slot)
            batch.input_ids.append(req.output_ids[-1])
            batch.positions.append(pos)
            batch.rows.append(req.row)
            batch.seq_lens.append(pos + 1)
        logits = self.runner.forward(batch)
        self._sample_and_advance(list(self.running), logits)

    def _ensure_decode_memory(self) -> None:
        """Every running request needs one new slot. Evict cached prefixes first, then retract the
        requests that arrived last until the rest fit."""
        need = len(self.running)
        if self.allocator.available() < need:
            self.tree.evict(need - self.allocator.available())
        while self.allocator.available() < len(self.running) and len(self.running) > 1:
            victim = max(self.running, key=lambda r: r.arrival)
            self._retract(victim)
            if self.allocator.available() < len(self.running):
                self.tree.evict(len(self.running) - self.allocator.available())
        if self.running and self.allocator.available() < len(self.running):
            req = self.running[0]
            self._finish(req, "abort", None, error=f"KV pool of {self.allocator.num_slots} tokens cannot hold this request")

    def _retract(self, req: Req) -> None:
        logger.info("retracting request %s (%d tokens) to free KV memory", req.rid, req.seq_len)
        self.running.remove(req)
        self._release(req)
        req.status = Status.WAITING
        self.stats.retractions_total += 1
        self.waiting.insert(0, req)

    def _release(self, req: Req) -> None:
        """Gives the request's KV to the radix cache (evictable) and its table row back."""
        if req.row is None:
            return
        self.tree.cache_finished(req.fill_ids[: req.kv_len], req.slots, req.cached_len, req.last_node)
        self.runner.req_to_token.free(req.row)
        req.row, req.slots, req.cached_len, req.last_node = None, [], 0, None

    # ---- sampling and finishing --------------------------------------------------------------

    def _sample_and_advance(self, reqs: list[Req], logits: torch.Tensor) -> None:
        """Samples each request's next token and moves it on. A failure in one request's own work (its
        constraint, its sampling values, its detokenizer) ends that request alone (`_fail`)."""
        masks = self._constraint_masks(reqs)
        if any(r.finished for r in reqs):
            keep = [i for i, r in enumerate(reqs) if not r.finished]
            reqs, masks = [reqs[i] for i in keep], [masks[i] for i in keep]
            logits = logits[torch.tensor(keep, device=logits.device)]
        if not reqs:
            return
        try:
            result = self.sampler.sample(logits, reqs, masks)
            rows: list[tuple[SampleResult, int] | None] = [(result, i) for i in range(len(reqs))]
        except Exception:  # find the request(s) at fault: sample each alone
            logger.warning("sampling a batch of %d failed; sampling its requests one by one", len(reqs))
            rows = [self._sample_alone(req, logits[i : i + 1], mask) for i, (req, mask) in enumerate(zip(reqs, masks))]
        now = time.monotonic()
        for req, row in zip(reqs, rows):
            if row is None:
                continue
            result, i = row
            stage = "constraining"
            try:
                token = result.token_ids[i]
                req.output_ids.append(token)
                self.stats.generated_tokens_total += 1
                if req.first_token_time is None:
                    req.first_token_time = now
                if req.inp.return_logprob:
                    req.output_token_logprobs.append((result.logprobs[i], token, None))
                    req.output_top_logprobs.append(result.top_logprobs[i])
                if req.constraint is not None:
                    req.constraint.advance(token)
                stage = "detokenizing"
                self._check_finish(req, token)
                if req.finished:
                    continue
                if req.constraint is not None:
                    stage = "constraining"
                    self._after_constrained_token(req)
                    if req.finished:
                        continue
                if req.inp.stream and len(req.output_ids) - req.streamed_ids >= self.opts.stream_interval:
                    stage = "detokenizing"
                    self._emit(req, final=False)
            except Exception:
                self._fail(req, stage)

    def _sample_alone(self, req: Req, logits: torch.Tensor, mask: torch.Tensor | None) -> tuple[SampleResult, int] | None:
        try:
            return self.sampler.sample(logits, [req], [mask]), 0
        except Exception:
            self._fail(req, "sampling")
            return None

    # ---- constrained decoding (the TokenConstraint of core.engine.constraint) ---------------------

    def _constraint_masks(self, reqs: list[Req]) -> list[torch.Tensor | None]:
        packed = self.runner.device.type == "cuda"  # bit-packed masks: a small copy, unpacked on the GPU
        masks: list[torch.Tensor | None] = []
        for r in reqs:
            try:
                masks.append(r.constraint.allowed_token_mask(self.sampler.vocab_size, packed)
                             if r.constraint else None)
            except Exception:
                self._fail(r, "constraining")
                masks.append(None)
        return masks

    def _after_constrained_token(self, req: Req) -> None:
        """Finishes the request when its constraint allows nothing but the end; otherwise jumps forward
        over forced text, after which the request takes an extend step to compute the jumped tokens."""
        if req.constraint.is_finished():
            self._finish(req, "stop", None)
        elif self._jump_forward(req) and not req.finished:
            self.running.remove(req)
            req.status = Status.WAITING
            self.waiting.insert(0, req)  # keeps its KV; _plan_extend allocates only for the new tokens

    def _jump_forward(self, req: Req) -> bool:
        """Appends the text the constraint forces next as canonical tokens (re-tokenizing the newest
        token with it when that token has no KV yet). True if tokens were appended."""
        c = req.constraint
        if c is None or self.opts.disable_jump_forward or req.params.disable_jump_forward:
            return False
        p = req.params
        decoded = req.detok.lazy or req.detok.read_offset == len(req.detok.ids)
        max_replace = min(len(req.fill_ids) - req.kv_len, len(req.output_ids)) if decoded else 0
        room = min(p.max_new_tokens - len(req.output_ids), self.context_len - req.seq_len - 1)
        plan = c.jump_forward(req.output_ids, self.tokenizer, max_replace=max_replace, max_new_tokens=room)
        if plan is None:
            return False
        replaced, tokens = plan
        kept = len(req.output_ids) - replaced
        if kept < req.streamed_ids:  # the stream's next output replaces ids it has already sent
            req.replaced_sent += req.streamed_ids - kept
            req.streamed_ids = kept
        del req.output_ids[kept:]
        req.output_ids.extend(tokens)
        matched = req.detok.replace_tail(replaced, tokens)
        if matched is not None:
            self._finish(req, "stop", matched)
        elif c.is_finished():
            self._finish(req, "stop", None)
        elif len(req.output_ids) >= p.max_new_tokens:
            self._finish(req, "length", None)
        return True

    def _check_finish(self, req: Req, token: int) -> None:
        p = req.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            self._finish(req, "stop", token)
            return
        matched = req.detok.add(token, check_stop=len(req.output_ids) >= p.min_new_tokens)
        if matched is not None:
            self._finish(req, "stop", matched)
        elif len(req.output_ids) >= p.max_new_tokens or req.seq_len >= self.context_len:
            self._finish(req, "length", None)

    def _finish(self, req: Req, kind: str, matched: str | int | None, error: str | None = None,
                status_code: int | None = None) -> None:
        """Ends the request, gives its KV to the cache and sends its final output. An `error` goes to the
        client; with a `status_code` (a failure rather than an abort) the server answers with that status."""
        req.finish_type, req.finish_matched = kind, matched
        req.error, req.error_status = error, status_code
        if req.status is Status.WAITING:
            self._waiting_has_finished = True  # removed before the next step: O(1) per abort
        elif req in self.running:
            self.running.remove(req)
        if self.chunked is req:
            self.chunked = None
        if self.live.get(req.rid) is req:
            del self.live[req.rid]
        self._release(req)
        req.status = Status.FINISHED
        self.stats.record_finish(req)
        self._emit(req, final=True)

    def _fail(self, req: Req, stage: str) -> None:
        """Ends one request whose own work raised; the others go on. Its client gets an error naming the
        stage, never the exception's text (that goes to the log)."""
        logger.exception("request %s failed while %s; ending it alone", req.rid, stage)
        if not req.finished:
            self._finish(req, "abort", None, error=f"generation failed while {stage} (a server error; the "
                                                   "server log has the details)", status_code=500)

    def _emit(self, req: Req, final: bool) -> None:
        """Puts the request's next output on the outbox: a stream sends what is new since its last output,
        otherwise only the final output goes, whole."""
        if not req.inp.stream and not final:
            return
        start = req.streamed_ids if req.inp.stream else 0
        ids = req.output_ids[start:]
        if not final and not ids and not req.replaced_sent:
            return
        lp_start = req.streamed_logprobs if req.inp.stream else 0
        out = GenerateOutput(
            rid=req.rid, output_ids=ids, replaced=req.replaced_sent, prompt_tokens=len(req.inp.input_ids),
            completion_tokens=len(req.output_ids), cached_tokens=req.cached_tokens or 0)
        req.streamed_ids = len(req.output_ids)
        req.streamed_logprobs = len(req.output_token_logprobs)
        req.replaced_sent = 0
        if req.inp.return_logprob:
            out.input_token_logprobs = list(req.input_token_logprobs)
            out.input_top_logprobs = list(req.input_top_logprobs)
            out.output_token_logprobs = req.output_token_logprobs[lp_start:]
            out.output_top_logprobs = req.output_top_logprobs[lp_start:]
        if final:
            out.finish = FinishReason(req.finish_type, req.finish_matched, req.error, req.error_status)
            now = time.monotonic()
            if req.first_token_time is not None:
                out.e2e_latency = now - req.created
                out.ttft = req.first_token_time - req.created
            if req.scheduled_time is not None:
                out.queue_time = req.scheduled_time - req.created
        self.outbox.put(out)

    # ---- aborts, flush, stats, invariants ------------------------------------------------------

    def _abort(self, rid: str, why: str) -> None:
        req = self.live.get(rid)
        if req is not None:
            self._finish(req, "abort", None, error=why)

    def _abort_all(self, why: str, status_code: int | None = None) -> None:
        for req in [*self.waiting, *self.running, *([self.chunked] if self.chunked else [])]:
            if not req.finished:
                try:
                    self._finish(req, "abort", None, error=why, status_code=status_code)
                except Exception:  # a broken request must not keep the others from being answered
                    logger.exception("could not finish request %s cleanly", req.rid)
                    self.running = [r for r in self.running if r is not req]
                    self.waiting = [r for r in self.waiting if r is not req]
                    if self.chunked is req:
                        self.chunked = None

    def flush_cache(self) -> bool:
        self._sweep_waiting()
        if self.running or self.waiting or self.chunked:
            return False
        self.tree.reset()
        return True

    def get_stats(self) -> dict[str, Any]:
        self._sweep_waiting()
        cached = self.tree.total_size()
        return self.stats.snapshot(
            kv_slots_total=self.allocator.num_slots,
            kv_slots_free=self.allocator.available(),
            kv_slots_cached=cached,
            kv_slots_cached_evictable=self.tree.evictable_size(),
            running=len(self.running) + (1 if self.chunked else 0),
            waiting=len(self.waiting),
        )

    def check_invariants(self) -> None:
        owned: set[int] = set()
        jumped = [r for r in self.waiting if r.row is not None]  # waiting to compute jump-forward tokens
        for req in [*self.running, *([self.chunked] if self.chunked else []), *jumped]:
            mine = req.slots[req.cached_len :]
            assert not owned.intersection(mine), f"request {req.rid} shares owned slots"
            owned.update(mine)
        self.tree.check_invariants(owned)
