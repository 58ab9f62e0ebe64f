"""Data parallelism: `dp_size` engine workers behind one front end, routed by what each has cached.

Every worker is a full scheduler with its own model replica, KV pool and radix cache, on its own thread
(and on CUDA its own GPU). The router sits where a single scheduler would: the Engine front end puts
requests on its inbox, and it forwards each to a worker's inbox (paper appendix A.3). Which worker gets a
request is core.runtime.distributed.prefix_routing's rule (the meta radix tree and the load bound), the one the HTTP
router over `radixlm serve` replicas uses as well; here the workers are numbered 0..dp_size-1.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from typing import Any

from radixlm.core.runtime.execution.model_runner import ModelRunner
from radixlm.core.runtime.options import EngineOptions
from radixlm.core.runtime.messages import (
    Abort, CallReply, CheckInvariants, FlushCache, GenerateOutput, GenerateRequest, GetStats,
)
from radixlm.core.runtime.distributed.prefix_routing import PrefixRouter
from radixlm.core.runtime.scheduler import Scheduler
from radixlm.core.runtime.distributed.tp_worker import device_scope, rank_device, start_tensor_parallel
from radixlm.core.runtime.models.config import ModelConfig


def build_scheduler(model_path: str, cfg: ModelConfig, opts: EngineOptions, tokenizer: Any,
                    eos_token_ids: list[int]) -> tuple[Any, int]:
    """What the Engine puts behind its inbox when tp_size or dp_size > 1, and the KV pool size (tokens)
    one request can count on."""
    if opts.dp_size == 1:
        sched = start_tensor_parallel(model_path, cfg, opts, tokenizer, eos_token_ids)
        return sched, sched.allocator.num_slots
    workers = []
    for i in range(opts.dp_size):
        w_opts = dataclasses.replace(opts, device=rank_device(opts.device, i), random_seed=opts.random_seed + i)
        with device_scope(w_opts.device):
            workers.append(Scheduler(ModelRunner(model_path, cfg, w_opts), w_opts, tokenizer, eos_token_ids))
    router = DataParallelRouter(workers, cache_aware=not opts.disable_radix_cache)
    return router, min(w.allocator.num_slots for w in workers)


# ---- the router ----------------------------------------------------------------------------------


def _serve(worker: Scheduler) -> None:
    with device_scope(worker.runner.device):
        worker.run_forever()


class _WorkerOutbox:
    """A worker's outbox: its outputs go on to the router's outbox (tagged with the worker), its call
    replies to the router, which is waiting for them."""

    def __init__(self, router: "DataParallelRouter", worker: int) -> None:
        self.router, self.worker = router, worker
        self.replies: "queue.Queue[CallReply]" = queue.Queue()

    def put(self, msg: Any) -> None:
        if isinstance(msg, GenerateOutput):
            msg.dp_rank = self.worker
            self.router._track(msg, self.worker)
            self.router.outbox.put(msg)
        elif isinstance(msg, CallReply):
            self.replies.put(msg)


class DataParallelRouter:
    """Stands where one scheduler would behind the Engine: an inbox, an outbox, run_forever, stop, and
    the calls (flush_cache, get_stats, check_invariants), answered for all workers."""

    def __init__(self, workers: list[Scheduler], cache_aware: bool = True, abs_slack: int = 4,
                 rel_slack: float = 0.25) -> None:
        self.workers = workers
        self.inbox: "queue.Queue[Any]" = queue.Queue()
        self.outbox: "queue.Queue[Any]" = queue.Queue()
        self._worker_outboxes = [_WorkerOutbox(self, i) for i in range(len(workers))]
        for w, box in zip(workers, self._worker_outboxes):
            w.outbox = box
        self._sent: dict[str, list[int]] = {}  # rid -> output ids so far (streams send only the new ones)
        self.policy = PrefixRouter(cache_aware, abs_slack, rel_slack)
        for i, w in enumerate(workers):
            self.policy.add_worker(i, w.allocator.num_slots)
        self._owner: dict[str, int] = {}  # rid -> worker, while in flight
        self._lock = threading.Lock()  # tree, loads and owners: the router thread routes, workers finish
        self._threads = [threading.Thread(target=_serve, args=(w,), name=f"radixlm-dp{i}", daemon=True)
                         for i, w in enumerate(workers)]
        for t in self._threads:
            t.start()

    def run_forever(self) -> None:
        while True:
            msg = self.inbox.get()
            if msg is None:
                break
            if isinstance(msg, GenerateRequest):
                self._route(msg)
            elif isinstance(msg, Abort):
                with self._lock:
                    worker = self._owner.get(msg.rid)
                if worker is not None:
                    self.workers[worker].inbox.put(msg)
            elif isinstance(msg, (FlushCache, GetStats, CheckInvariants)):
                reply = CallReply(msg.call_id)
                try:
                    reply.value = {FlushCache: self.flush_cache, GetStats: self.get_stats,
                                   CheckInvariants: self.check_invariants}[type(msg)]()
                except Exception as exc:
                    reply.error = exc
                self.outbox.put(reply)
        for w in self.workers:
            w.stop()
        for t in self._threads:
            t.join(timeout=30)

    def stop(self) -> None:
        self.inbox.put(None)

    def _route(self, inp: GenerateRequest) -> None:
        with self._lock:
            worker, _ = self.policy.route(inp.input_ids)
            self._owner[inp.rid] = worker
            self._sent[inp.rid] = list(inp.input_ids)
        self.workers[worker].inbox.put(inp)

    def _track(self, out: GenerateOutput, worker: int) -> None:
        """On a worker's thread: on a request's final output, releases the load and records prompt +
        output in the meta tree (the worker caches them when the request finishes)."""
        with self._lock:
            seq = self._sent.get(out.rid)
            if seq is None:
                return
            del seq[len(seq) - out.replaced:]
            seq.extend(out.output_ids)
            if out.finish is not None:
                self._owner.pop(out.rid, None)
                del self._sent[out.rid]
                self.policy.finish(worker, seq)

    # ---- calls (they run on the router thread, so nothing is routed meanwhile) ----

    @property
    def loads(self) -> list[int]:
        """Requests in flight per worker, as the router counts them."""
        return list(self.policy.loads.values())

    def _call(self, worker: int, call: Any) -> Any:
        self.workers[worker].inbox.put(call)
        reply = self._worker_outboxes[worker].replies.get()
        if reply.error is not None:
            raise reply.error
        return reply.value

    def flush_cache(self) -> bool:
        with self._lock:
            if any(self.loads):
                return False
        flushed = all([self._call(w, FlushCache()) for w in range(len(self.workers))])
        if flushed:
            with self._lock:
                self.policy.tree.reset()
        return flushed

    def get_stats(self) -> dict[str, Any]:
        """Counters and gauges summed over workers, the hit rate recomputed; per-worker stats under
        "dp_workers" and the router's loads under "dp_in_flight"."""
        return self._combine([self._call(w, GetStats()) for w in range(len(self.workers))])

    @property
    def snapshot(self) -> dict[str, Any]:
        """The workers' published statistics, combined (as Scheduler.snapshot: read without waiting)."""
        per_worker = [w.snapshot for w in self.workers]
        return self._combine(per_worker) if all(per_worker) else {}

    @property
    def last_progress(self) -> float:
        """When the slowest worker's loop last got anything done."""
        return min(w.last_progress for w in self.workers)

    def _combine(self, per_worker: list[dict[str, Any]]) -> dict[str, Any]:
        total: dict[str, Any] = {}
        for key, value in per_worker[0].items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                total[key] = sum(s[key] for s in per_worker)
        prompt = total["prompt_tokens_total"]
        total["cache_hit_rate"] = total["cached_tokens_total"] / prompt if prompt else 0.0
        total["uptime_s"] = max(s["uptime_s"] for s in per_worker)
        with self._lock:
            total["dp_in_flight"] = self.loads
        total["dp_workers"] = per_worker
        return total

    def check_invariants(self) -> None:
        for w in range(len(self.workers)):
            self._call(w, CheckInvariants())
