"""Data parallelism: `dp_size` engine workers behind one front end, routed by what each has cached.

Every worker is a full scheduler with its own model replica, KV pool and radix cache, on its own thread
(and on CUDA its own GPU). The router sits where a single scheduler would: the Engine front end puts
requests on its inbox, and it forwards each to a worker's inbox (paper appendix A.3).

Routing. The router keeps a *meta radix tree*: the token sequences it has sent to each worker (prompts
when routed, prompt + output when finished), each node marked with the workers holding it and when
each last used it, so one walk gives every worker's matched prefix length. A worker's share of the tree
is bounded by its KV pool, oldest leaves dropped first, mirroring the LRU eviction of its real cache.
It is an estimate: the router never asks the workers.

Balancing rule. Let load(w) be the requests routed to worker w and not yet finished, and m = min over
workers of load. A request goes to the worker with the longest matched prefix among those with

    load(w) <= m + slack(m),   slack(m) = abs_slack + floor(rel_slack * m)   (defaults 4 and 0.25),

ties broken by lower load, then lower index. Bound: no request is ever routed to a worker more than
slack(m) requests busier than the least busy one; while requests only arrive (a burst), the spread
max(load) - min(load) stays <= slack(m) + 1 at all times. With the radix cache disabled every match is
empty and the rule is plain least-loaded routing.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import queue
import threading
from typing import Any

from radixlm.core.runtime.execution.model_runner import ModelRunner
from radixlm.core.runtime.options import EngineOptions
from radixlm.core.runtime.memory.radix_cache import shared_len
from radixlm.core.runtime.messages import (
    Abort, CallReply, CheckInvariants, FlushCache, GenerateOutput, GenerateRequest, GetStats,
)
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


# ---- the meta radix tree -----------------------------------------------------------------------


class _Node:
    __slots__ = ("key", "children", "parent", "workers")

    def __init__(self, key: list[int], parent: "_Node | None") -> None:
        self.key = key
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.workers: dict[int, int] = {}  # worker -> tick of its last use of this node


class MetaRadixTree:
    """Which token prefixes each of `num_workers` workers holds. A worker that holds a node holds all of
    its ancestors, so the deepest node on a path marked with w gives w's matched length."""

    def __init__(self, num_workers: int, capacity: list[int]) -> None:
        self.num_workers = num_workers
        self.capacity = capacity  # tokens per worker
        self.reset()

    def reset(self) -> None:
        self.root = _Node([], None)
        self.sizes = [0] * self.num_workers  # tokens held per worker
        self._tick = itertools.count(1)

    def match(self, ids: list[int]) -> list[int]:
        """Matched prefix length of `ids` on every worker."""
        matched = [0] * self.num_workers
        node, pos = self.root, 0
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                break
            shared = shared_len(child.key, ids, pos)
            for w in child.workers:
                matched[w] = pos + shared
            if shared < len(child.key):
                break
            node, pos = child, pos + shared
        return matched

    def insert(self, ids: list[int], worker: int) -> None:
        """Records that `worker` holds `ids` (used now), then trims its share to its capacity."""
        tick = next(self._tick)
        node, pos = self.root, 0
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                child = _Node(ids[pos:], node)
                node.children[ids[pos]] = child
            shared = shared_len(child.key, ids, pos)
            if shared < len(child.key):
                child = self._split(child, shared)
            if worker not in child.workers:
                self.sizes[worker] += len(child.key)
            child.workers[worker] = tick
            node, pos = child, pos + len(child.key)
        if self.sizes[worker] > self.capacity[worker]:
            self._evict(worker)

    def _split(self, node: _Node, at: int) -> _Node:
        """Cuts node's edge after `at` tokens; returns the new upper node (same holders)."""
        upper = _Node(node.key[:at], node.parent)
        upper.workers = dict(node.workers)
        node.parent.children[upper.key[0]] = upper
        node.key = node.key[at:]
        node.parent = upper
        upper.children[node.key[0]] = node
        return upper

    def _evict(self, worker: int) -> None:
        """Drops the worker's least recently used leaves until it holds at most 7/8 of its capacity (the
        slack saves a whole-tree walk per insert once a worker's cache is full)."""
        target = self.capacity[worker] * 7 // 8
        heap = [(n.workers[worker], id(n), n) for n in self._nodes() if self._is_leaf_of(n, worker)]
        heapq.heapify(heap)
        while heap and self.sizes[worker] > target:
            _, _, node = heapq.heappop(heap)
            del node.workers[worker]
            self.sizes[worker] -= len(node.key)
            parent = node.parent
            if not node.workers:  # no holder left (nor below it): the node goes
                del parent.children[node.key[0]]
            if parent is not self.root and self._is_leaf_of(parent, worker):
                heapq.heappush(heap, (parent.workers[worker], id(parent), parent))

    @staticmethod
    def _is_leaf_of(node: _Node, worker: int) -> bool:
        return worker in node.workers and not any(worker in c.workers for c in node.children.values())

    def _nodes(self) -> list[_Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out


def choose_worker(matched: list[int], loads: list[int], abs_slack: int = 4, rel_slack: float = 0.25) -> int:
    """The balancing rule (module docstring): longest match among workers within the load slack."""
    floor = min(loads)
    limit = floor + abs_slack + int(rel_slack * floor)
    eligible = [w for w in range(len(loads)) if loads[w] <= limit]
    return max(eligible, key=lambda w: (matched[w], -loads[w], -w))


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
        self.cache_aware = cache_aware
        self.abs_slack, self.rel_slack = abs_slack, rel_slack
        self.inbox: "queue.Queue[Any]" = queue.Queue()
        self.outbox: "queue.Queue[Any]" = queue.Queue()
        self._worker_outboxes = [_WorkerOutbox(self, i) for i in range(len(workers))]
        for w, box in zip(workers, self._worker_outboxes):
            w.outbox = box
        self._sent: dict[str, list[int]] = {}  # rid -> output ids so far (streams send only the new ones)
        self.tree = MetaRadixTree(len(workers), [w.allocator.num_slots for w in workers])
        self.loads = [0] * len(workers)
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
            matched = self.tree.match(inp.input_ids) if self.cache_aware else [0] * len(self.workers)
            worker = choose_worker(matched, self.loads, self.abs_slack, self.rel_slack)
            self.loads[worker] += 1
            self._owner[inp.rid] = worker
            self._sent[inp.rid] = list(inp.input_ids)
            if self.cache_aware:
                self.tree.insert(inp.input_ids, worker)
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
                self.loads[worker] -= 1
                self._owner.pop(out.rid, None)
                del self._sent[out.rid]
                if self.cache_aware:
                    self.tree.insert(seq, worker)

    # ---- calls (they run on the router thread, so nothing is routed meanwhile) ----

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
                self.tree.reset()
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
            total["dp_in_flight"] = list(self.loads)
        total["dp_workers"] = per_worker
        return total

    def check_invariants(self) -> None:
        for w in range(len(self.workers)):
            self._call(w, CheckInvariants())
