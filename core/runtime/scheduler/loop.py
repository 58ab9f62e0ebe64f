"""The scheduler loop: takes messages from its inbox, and each step either prefills (new requests, or
the next chunk of a long prompt) or decodes one token for every running request; new prefills join
the running batch as soon as they finish (continuous batching). When KV memory runs short it evicts
cached prefixes, then retracts running requests, which later resume from where they were with
identical greedy output. It talks to the front end only through messages (core.runtime.messages):
requests, aborts and calls on `inbox`, outputs and call replies on `outbox`.

The decisions are made by units with their own files (policy, prefill planning, memory, finishing,
constraints); this loop applies them to its queues and runs the steps through the Executor.

With overlap scheduling (enable_overlap_schedule) a step may leave its sampled tokens pending on the
device (`self.pending`): the next decode step chains on them (Executor.chain_decode), and so does an
extend step of jump-forward continuations whose riding decodes are the pending step's requests
(Executor.chain_extend); a prefill of new prompts is launched before the pending step is applied.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from typing import Any, Iterator

import torch

from radixlm.core.runtime.messages import (
    Abort, CallReply, CheckInvariants, FlushCache, GenerateRequest, GetStats, InboxMessage, OutboxMessage,
    StatsSnapshot,
)
from radixlm.core.runtime import gc_heap
from radixlm.core.runtime.constraint_compiler import ConstraintCompiler
from radixlm.core.runtime.memory.hicache import HostTier, tier_stats
from radixlm.core.runtime.memory.memory_pool import SlotAllocator
from radixlm.core.runtime.execution.model_runner import ModelRunner
from radixlm.core.runtime.options import EngineOptions
from radixlm.core.runtime.memory.radix_cache import RadixCache
from radixlm.core.runtime.request import Req
from radixlm.core.runtime.execution.sampler import Sampler
from radixlm.core.runtime.deadline import TIMEOUT_MESSAGE
from radixlm.core.runtime.faults import inject_faults
from radixlm.core.runtime.scheduler.deadlines import Deadlines
from radixlm.core.runtime.scheduler.execute import Executor, PendingDecode
from radixlm.core.runtime.scheduler.finish import Finish
from radixlm.core.runtime.scheduler.memory import KVMemory
from radixlm.core.runtime.scheduler.oom import OOMRecovery, is_out_of_memory
from radixlm.core.runtime.scheduler.policy import SchedulePolicy
from radixlm.core.runtime.scheduler.prefill import Extend, PrefillPlanner
from radixlm.core.runtime.scheduler.queues import RequestQueues
from radixlm.core.runtime.stats import EngineStats, TimedRadixCache
from radixlm.core.runtime.speculative.build import build_speculator
from radixlm.core.runtime.tokenizer.detokenizer import IncrementalDetokenizer

logger = logging.getLogger("radixlm")


class Scheduler:
    def __init__(self, runner: ModelRunner, opts: EngineOptions, tokenizer, eos_token_ids: list[int],
                 constraints: ConstraintCompiler | None = None) -> None:
        self.runner = runner
        self.opts = opts
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        # What one request may use in all (the Engine admits nothing longer): the model's context (or the
        # context_length option), or the KV pool when that is smaller.
        self.context_len = min(opts.context_length or runner.cfg.context_len, runner.num_slots)
        self.allocator = SlotAllocator(runner.num_slots)
        self.stats = EngineStats()
        self.host_tier = HostTier.create(opts.hicache_size_gb, runner.kv_pool) if opts.hicache_size_gb > 0 else None
        self.tree = TimedRadixCache(RadixCache(self.allocator, disable=opts.disable_radix_cache, host=self.host_tier,
                                               write_through=opts.hicache_write_policy == "write_through"),
                                    self.stats)
        self.memory = KVMemory(self.allocator, self.tree, runner.req_to_token)
        self.queues = RequestQueues(self.memory, self.stats)
        self.policy = SchedulePolicy(opts.schedule_policy, opts.schedule_fairness_bound, self.tree, opts.random_seed,
                                     opts.schedule_only_under_pressure)
        self.planner = PrefillPlanner(self.memory, self.policy, self.stats, opts.chunked_prefill_size,
                                      opts.max_running_requests, opts.schedule_admission_batch)
        self.generator = torch.Generator(device=runner.device).manual_seed(opts.random_seed)
        self.sampler = Sampler(runner.cfg.vocab_size, eos_token_ids, self.generator)
        self.executor = Executor(runner, self.sampler, self.memory, self.queues, self.stats, opts, tokenizer,
                                 eos_token_ids, self.context_len)
        # Speculative decoding (speculative_algorithm): verify steps where decode steps would run.
        self.speculator = build_speculator(opts, runner, self.executor, self.context_len)
        # Overlap scheduling: the decode step launched but not yet applied (execute.py).
        self.pending: PendingDecode | None = None
        self.deadlines = Deadlines()
        self.oom = OOMRecovery(self.queues, self.memory, self.planner)
        self.faults = inject_faults(runner)  # test-only (RADIXLM_INJECT_FAULTS); None otherwise
        self.inbox: "queue.Queue[InboxMessage]" = queue.Queue()
        self.outbox = queue.Queue()
        # In its own process the loop also puts its statistics on the outbox, at most this often (s).
        self.publish_interval: float | None = None
        self._published_at = 0.0
        # The engine's own when the loop shares its process; else this process's (documents registered here too).
        self.constraints = constraints or ConstraintCompiler(tokenizer, eos_token_ids, opts)
        self.gc_pauses = gc_heap.watch(opts.gc_warning_threshold_ms)
        # Read by other threads without waiting for the loop: when it last got anything done, and the
        # statistics as of then (replaced whole, never mutated).
        self.last_progress = time.monotonic()
        self.snapshot: dict[str, Any] = {}
        self._arrivals = 0
        self._stop = threading.Event()
        # paused(): the loop waits between two iterations while another thread works on the scheduler.
        self._pause_wanted, self._paused, self._resume = threading.Event(), threading.Event(), threading.Event()
        # The grammar tables are part of the heap that lives as long as the engine (gc_heap.py).
        self.constraints.prepare_in_background(self._freeze_heap_while_running if opts.gc_freeze else None)

    @property
    def outbox(self) -> "queue.Queue[OutboxMessage]":
        """Where outputs and call replies go (anything with `put`: a queue, a process queue, a router's)."""
        return self.queues.outbox

    @outbox.setter
    def outbox(self, box: Any) -> None:
        self.queues.outbox = box

    @property
    def running(self) -> list[Req]:
        return self.queues.running

    @property
    def waiting(self) -> list[Req]:
        return self.queues.waiting

    # ---- the loop --------------------------------------------------------------------------

    def run_forever(self) -> None:
        try:
            self._run()
        except BaseException:  # outside any request: the front end notices the loop is gone and fails its callers
            logger.critical("the scheduler loop died", exc_info=True)
            raise

    def _run(self) -> None:
        self._publish()
        while not self._stop.is_set():
            if self.faults is not None:
                self.faults.before_iteration()
            if self._pause_wanted.is_set():
                self.settle()  # the pausing thread sees every sampled token
                self._paused.set()
                self._resume.wait()
                self._resume.clear()
            busy = self.queues.busy()
            if not busy:  # the loop is about to wait for a request
                self.runner.idle()
            self._drain_inbox(block=not busy)
            if self._stop.is_set():
                break
            self._end_overdue()
            try:
                self.step()
                self.oom.step_succeeded()
            except Exception as exc:  # a failure of the batch itself (not of one request's own work)
                self.pending = None
                self.executor.discard_unapplied()
                if is_out_of_memory(exc):
                    self.oom.recover(exc)
                else:
                    logger.exception("scheduler step failed; aborting the requests in flight")
                    self.queues.abort_all("internal server error (the server log has the details)", status_code=500)
            self._publish()
        self.constraints.close()
        self.settle()
        self.queues.abort_all("the engine shut down", status_code=503)
        self._publish()

    def _end_overdue(self) -> None:
        """Ends the requests past their deadline, with their KV as of their last applied token."""
        overdue = self.deadlines.due(time.time()) if len(self.deadlines) else []
        if overdue:
            self.settle()
        for req in overdue:
            if not req.finished:
                self.queues.finish(req, Finish("abort"), error=TIMEOUT_MESSAGE, status_code=408)

    def _publish(self, force: bool = False) -> None:
        self.snapshot = self.get_stats()
        self.last_progress = time.monotonic()
        if self.publish_interval is not None and (force or self.last_progress - self._published_at >= self.publish_interval):
            self._published_at = self.last_progress
            self.outbox.put(StatsSnapshot(self.snapshot, self.last_progress))

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The loop waits (between two iterations, within half a second when idle) until the block ends:
        for benchmarks that time steps or the forward alone, in this process."""
        self._pause_wanted.set()
        self._paused.wait()
        try:
            yield
        finally:
            self._pause_wanted.clear()
            self._paused.clear()
            self._resume.set()

    def stop(self) -> None:
        self._stop.set()
        self.inbox.put(None)

    def step(self) -> None:
        queues = self.queues
        queues.sweep()
        # With a decode step pending (overlap), this plans on the state before its results: requests it
        # finishes still count as running and hold their KV, which only makes planning cautious.
        pending, self.pending = self.pending, None
        # Whether waiting continuations' extend step would chain (they then do not wait to gather); not
        # asked on plain decode steps, where nothing waits: it walks the running requests.
        chains = pending is not None and bool(queues.waiting) and self.executor.chains_extend(pending)
        plan = self.planner.plan(queues.waiting, queues.running, queues.chunked, chains)
        queues.chunked = plan.chunked
        if plan.extends:
            queues.take(plan.taken, plan.passed_over)
            self._extend_step(plan.extends, pending)
            queues.admitting = []
        elif pending is not None:
            self.pending = self.executor.chain_decode(pending)
        elif queues.running and self.speculator is not None:
            self.speculator.step()  # a verify step, or a decode step where no draft pays
        elif queues.running:
            self.pending = self.executor.run_decode(defer=self.opts.enable_overlap_schedule)
        elif queues.waiting:
            self.tree.wait_for_load()  # nothing to run until a prefix comes back from host memory
        if self.opts.debug_check_invariants:
            self.check_invariants()

    def _extend_step(self, extends: list[Extend], pending: PendingDecode | None) -> None:
        """Runs the planned extends; with only continuations planned, the running requests ride along."""
        executor = self.executor
        if self.queues.running and all(e.req.output_ids for e in extends):
            # Only continuations (jump-forward text, resumed requests): a few tokens, so the running
            # requests decode in the same step instead of stalling behind it, with their newest tokens:
            # a pending decode step's still on the device (chained), else applied first.
            rides = None
            if pending is not None and executor.chains_extend(pending):
                rides = self.planner.ride_ahead(pending.reqs)
            if rides is not None:
                self.pending = executor.chain_extend(extends + rides, pending)
                return
            if pending is not None:
                executor.resolve(pending)
                pending = None
            extends = extends + self.planner.ride_along(self.queues.running)
        executor.run_extend(extends, pending)

    def settle(self) -> None:
        """Applies the pending decode step (overlap), so that the queues show every sampled token."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self.executor.resolve(pending)

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
                self.settle()  # an aborted request gives back its KV as of its last applied token
                self.queues.abort(msg.rid, "aborted by request")
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
        # The one detokenizer of the request: it finds stop strings and writes the outputs' text. Decoded
        # once at the end when nothing reads the text earlier (no stream, no stop strings).
        lazy = not (p.stop or inp.stream)
        detok = IncrementalDetokenizer(self.tokenizer, p.skip_special_tokens, p.stop, p.no_stop_trim, lazy=lazy)
        req = Req(inp=inp, detok=detok, arrival=self._arrivals)
        if self.speculator is not None:
            self.speculator.state(req)
        self._arrivals += 1
        self.stats.requests_total += 1
        added = self.queues.add(req)
        if added:
            self.deadlines.add(req)
        if added and inp.constraint is not None:
            try:
                req.constraint = self.constraints.build(inp.constraint)
                self.executor.advance.jump(req)  # text forced from the very start goes in with the prompt
            except ValueError as e:  # the front end validated the spec: only another front end gets here
                self.queues.finish(req, Finish("abort"), error=f"invalid {inp.constraint.kind}: {e}", status_code=400)
            except Exception:
                self.queues.fail(req, "constraining")

    # ---- flush, stats, invariants ----------------------------------------------------------------

    def _freeze_heap_while_running(self) -> None:
        if not self._stop.is_set():  # a stopped engine's heap is left to be collected
            gc_heap.freeze_heap()

    def flush_cache(self) -> bool:
        self.queues.sweep()
        if self.queues.busy():
            return False
        self.tree.reset()
        return True

    def get_stats(self) -> dict[str, Any]:
        self.queues.sweep()
        return self.stats.snapshot(
            spec_algorithm=self.speculator.proposer.name if self.speculator is not None else None,
            kv_slots_total=self.allocator.num_slots,
            kv_slots_free=self.allocator.available(),
            kv_slots_cached=self.tree.total_size(),
            kv_slots_cached_evictable=self.tree.evictable_size(),
            running=len(self.queues.running) + (1 if self.queues.chunked else 0),
            waiting=len(self.queues.waiting),
            **tier_stats(self.host_tier, self.stats.cached_tokens_total),
            gc=self.gc_pauses.snapshot(),  # the process's (data-parallel workers in one process share it)
        )

    def check_invariants(self) -> None:
        self.tree.check_invariants(self.memory.owned_slots(self.queues.holding_kv()))
