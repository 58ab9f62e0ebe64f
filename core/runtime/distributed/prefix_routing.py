"""Cache-aware routing over workers that each keep their own prefix cache (paper appendix A.3): the meta
radix tree and the load-bounded balancing rule. One implementation serves the in-process data-parallel
router (core.runtime.distributed.dp_router, workers are indices) and the HTTP router over `radixlm serve` replicas
(server/router, workers are URLs); workers may come and go at run time.

Routing. The meta radix tree holds the token sequences sent to each worker, each node marked with the
workers holding it and when each last used it, so one walk gives every worker's matched prefix length.
A worker's share of the tree is bounded by its KV pool, oldest leaves dropped first, mirroring the LRU
eviction of its real cache. It is an estimate: the router never asks the workers.

Balancing rule. Let load(w) be the requests routed to worker w and not yet finished, and m = min over the
candidate workers of load. A request goes to the worker with the longest matched prefix among those with

    load(w) <= m + slack(m),   slack(m) = abs_slack + floor(rel_slack * m)   (defaults 4 and 0.25),

ties broken by lower load, then by the order the workers were added. A match shorter than
cache_threshold * len(prompt) counts as none (default 0: every match counts): otherwise a short prefix
every prompt shares (a common header, a system prompt) piles unrelated requests onto one worker up to the
slack, where they recompute their real prefixes. Bound: no request is ever routed to
a worker more than slack(m) requests busier than the least busy one; while requests only arrive (a
burst), the spread max(load) - min(load) stays <= slack(m) + 1 at all times. Without cache awareness
every match is empty and the rule is plain least-loaded routing.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Iterable, Sequence

from radixlm.core.runtime.memory.token_prefix import shared_len

Worker = Hashable


class _Node:
    __slots__ = ("key", "children", "parent", "workers")

    def __init__(self, key: Sequence[int], parent: "_Node | None") -> None:
        self.key = key
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.workers: dict[Worker, int] = {}  # worker -> tick of its last use of this node


class MetaRadixTree:
    """Which token prefixes each worker holds. A worker that holds a node holds all of its ancestors, so
    the deepest node on a path marked with w gives w's matched length."""

    def __init__(self, capacity: dict[Worker, int] | None = None) -> None:
        self.capacity: dict[Worker, int] = {}  # tokens per worker
        self.sizes: dict[Worker, int] = {}  # tokens held per worker
        self.reset()
        for worker, tokens in (capacity or {}).items():
            self.add_worker(worker, tokens)

    def reset(self) -> None:
        """Forgets what every worker holds (their caches were flushed)."""
        self.root = _Node([], None)
        self.sizes = dict.fromkeys(self.capacity, 0)
        self._tick = itertools.count(1)

    def add_worker(self, worker: Worker, capacity: int) -> None:
        self.capacity[worker] = capacity
        self.sizes.setdefault(worker, 0)

    def remove_worker(self, worker: Worker) -> None:
        """Forgets the worker and everything it held."""
        for node in self._nodes():
            if node.workers.pop(worker, None) is not None and not node.workers:
                del node.parent.children[node.key[0]]  # its subtree was the worker's alone too
        self.capacity.pop(worker, None)
        self.sizes.pop(worker, None)

    def match(self, ids: Sequence[int]) -> dict[Worker, int]:
        """Matched prefix length of `ids` on every worker."""
        matched = dict.fromkeys(self.capacity, 0)
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

    def insert(self, ids: Sequence[int], worker: Worker) -> None:
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

    def _evict(self, worker: Worker) -> None:
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
    def _is_leaf_of(node: _Node, worker: Worker) -> bool:
        return worker in node.workers and not any(worker in c.workers for c in node.children.values())

    def _nodes(self) -> list[_Node]:
        """Every node, each before its descendants."""
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out


def choose_worker(matched: dict[Worker, int], loads: dict[Worker, int], abs_slack: int = 4,
                  rel_slack: float = 0.25) -> Worker:
    """The balancing rule (module docstring) over the workers in `loads`, in their order: the longest
    match among the workers within the load slack."""
    floor = min(loads.values())
    limit = floor + abs_slack + int(rel_slack * floor)
    order = {w: i for i, w in enumerate(loads)}
    eligible = [w for w, load in loads.items() if load <= limit]
    return max(eligible, key=lambda w: (matched.get(w, 0), -loads[w], -order[w]))


class PrefixRouter:
    """The routing state: the meta tree and the load of each worker. Not thread-safe: callers that route
    from several threads hold a lock around it."""

    def __init__(self, cache_aware: bool = True, abs_slack: int = 4, rel_slack: float = 0.25,
                 cache_threshold: float = 0.0) -> None:
        self.cache_aware = cache_aware
        self.abs_slack, self.rel_slack = abs_slack, rel_slack
        self.cache_threshold = cache_threshold
        self.tree = MetaRadixTree()
        self.loads: dict[Worker, int] = {}

    def add_worker(self, worker: Worker, capacity: int) -> None:
        self.tree.add_worker(worker, capacity)
        self.loads.setdefault(worker, 0)

    def remove_worker(self, worker: Worker) -> None:
        """Forgets the worker: its load and what it held (requests it still runs finish uncounted)."""
        self.tree.remove_worker(worker)
        self.loads.pop(worker, None)

    def forget_cache(self, worker: Worker) -> None:
        """The worker's cache is gone (it restarted, or was flushed): keep its load, drop what it held."""
        capacity = self.tree.capacity.get(worker)
        if capacity is not None:
            self.tree.remove_worker(worker)
            self.tree.add_worker(worker, capacity)

    def route(self, ids: Sequence[int], among: Iterable[Worker] | None = None) -> tuple[Worker, int]:
        """Picks a worker for a request with prompt `ids` (from `among`, default all), counts it on that
        worker and records the prompt there. Returns the worker and its matched prefix length."""
        candidates = {w: self.loads[w] for w in (self.loads if among is None else among) if w in self.loads}
        if not candidates:
            raise LookupError("no worker to route to")
        matched = self.tree.match(ids) if self.cache_aware else {}
        counted = {w: m for w, m in matched.items() if m >= self.cache_threshold * len(ids)}
        worker = choose_worker(counted, candidates, self.abs_slack, self.rel_slack)
        self.loads[worker] += 1
        if self.cache_aware and ids:
            self.tree.insert(ids, worker)
        return worker, matched.get(worker, 0)

    def finish(self, worker: Worker, seq: Sequence[int] | None = None) -> None:
        """A request routed to `worker` ended; `seq` (prompt + output) is what its cache now holds."""
        if worker not in self.loads:  # removed meanwhile
            return
        self.loads[worker] -= 1
        if self.cache_aware and seq:
            self.tree.insert(seq, worker)
