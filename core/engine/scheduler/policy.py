"""Orders the waiting queue. Decides only; the scheduler acts on the order.

Policies: `lpm` (longest cached prefix first, the paper's cache-aware order), `dfs-weight` (the
paper's depth-first order over the radix tree, weighting subtrees by their waiting requests), `fcfs`,
`lof` (longest output first) and `random`. On top of any policy a fairness bound: a request passed
over `fairness_bound` times goes ahead of everything else, oldest first, so none waits forever.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # only annotations: options.py imports POLICIES without loading torch
    from radixlm.core.engine.request import Req

POLICIES = ("lpm", "dfs-weight", "fcfs", "lof", "random")
# Matching every waiting request against the tree each step costs O(queue x prompt); past this queue
# length cache-aware policies fall back to fcfs, as SGLang does.
CACHE_AWARE_QUEUE_LIMIT = 128


class SchedulePolicy:
    def __init__(self, policy: str, fairness_bound: int, tree_cache: Any, seed: int) -> None:
        if policy not in POLICIES:
            raise ValueError(f"schedule_policy must be one of {POLICIES} (got {policy!r})")
        self.policy = policy
        self.fairness_bound = fairness_bound
        self.tree_cache = tree_cache
        self.rng = random.Random(seed)

    def order(self, waiting: list[Req]) -> list[Req]:
        overdue = sorted((r for r in waiting if r.passed_over >= self.fairness_bound), key=lambda r: r.arrival)
        rest = [r for r in waiting if r.passed_over < self.fairness_bound]
        return overdue + self._order(rest)

    def _order(self, reqs: list[Req]) -> list[Req]:
        policy = self.policy
        cache_aware = policy in ("lpm", "dfs-weight")
        if cache_aware and (self.tree_cache.disable or len(reqs) > CACHE_AWARE_QUEUE_LIMIT):
            policy = "fcfs"
        if policy == "fcfs":
            return sorted(reqs, key=lambda r: r.arrival)
        if policy == "lof":
            return sorted(reqs, key=lambda r: (-r.params.max_new_tokens, r.arrival))
        if policy == "random":
            shuffled = list(reqs)
            self.rng.shuffle(shuffled)
            return shuffled
        matches = {id(r): self.tree_cache.match_prefix(r.fill_ids) for r in reqs}
        if policy == "lpm":
            return sorted(reqs, key=lambda r: (-len(matches[id(r)][0]), r.arrival))
        return self._dfs_weight(reqs, {id(r): matches[id(r)][1] for r in reqs})

    def _dfs_weight(self, reqs: list[Req], last_nodes: dict[int, Any]) -> list[Req]:
        """Visits the tree depth first, heavier subtrees (more waiting requests under them) first, and
        emits each node's requests when reached: requests sharing a subtree run back to back."""
        at_node: dict[int, list[Req]] = {}
        weight: dict[int, int] = {}
        for r in sorted(reqs, key=lambda r: r.arrival):
            node = last_nodes[id(r)]
            at_node.setdefault(id(node), []).append(r)
            while node is not None:
                weight[id(node)] = weight.get(id(node), 0) + 1
                node = node.parent
        ordered: list[Req] = []
        stack = [self.tree_cache.root]
        while stack:
            node = stack.pop()
            ordered.extend(at_node.get(id(node), []))
            children = [c for c in node.children.values() if weight.get(id(c), 0) > 0]
            children.sort(key=lambda c: weight[id(c)])  # heaviest popped first
            stack.extend(children)
        return ordered
