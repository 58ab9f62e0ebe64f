"""Orders the waiting queue. Decides only; the scheduler acts on the order.

Policies: `lpm` (longest cached prefix first, the paper's cache-aware order), `dfs-weight` (the
paper's depth-first order over the radix tree, weighting subtrees by their waiting requests), `fcfs`,
`lof` (longest output first) and `random`. On top of any policy a fairness bound: a request passed
over `fairness_bound` times goes ahead of everything else, oldest first, so none waits forever.

The cache-aware orders need each waiting request's cached prefix every step. `PrefixMemo` keeps
where each request's prompt last matched (a tree node and its depth) and only walks on from there:
a node stays valid while it is in the tree (a split keeps the lower part's object, and eviction
detaches it), so a step costs O(tree depth) per waiting request rather than O(prompt), and reading
the tree leaves it untouched (no LRU refresh, no split), unlike match_prefix. So the cache-aware
orders hold at any queue length, where they matter most (SGLang falls back to fcfs past 128
waiting; so did this scheduler, which turned lpm off exactly under the pressure it is for). A prefix
held in the host tier (hicache) counts as cached: loading it back costs less than computing it.

Reordering pays only under memory pressure: while the free KV slots hold every waiting prompt,
nothing cached is evicted before its request runs, so every order gets the same hits and lpm only
changes who goes first (on the H200 paper workloads: the same hit rates, lpm/fcfs medians
0.85-1.10x). With `free_slots` given, the cache-aware orders therefore keep arrival order until the
waiting prompts outgrow the free slots.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

from radixlm.core.runtime.options import POLICIES
from radixlm.core.runtime.memory.token_prefix import shared_len

if TYPE_CHECKING:
    from radixlm.core.runtime.request import Req


class PrefixMemo:
    """Each waiting request's cached prefix length, walked on incrementally from the last match."""

    def __init__(self, tree_cache: Any) -> None:
        self.tree = tree_cache
        # id(req) -> (req, deepest fully matched node, its depth, match length, end node, the end edge's
        # length); the request itself is kept so that an id reused by a later request cannot pick up
        # another prompt's match
        self._at: dict[int, tuple[Any, Any, int, int, Any, int]] = {}

    def lengths(self, reqs: list[Req]) -> dict[int, tuple[int, Any]]:
        """id(req) -> (cached prefix length, the node whose subtree holds the match's end: the edge it
        ends inside, else the last node it covers), for every request; forgets requests no longer asked
        about."""
        out, at = {}, {}
        root = self.tree.root
        for r in reqs:
            ids, node, depth = r.inp.input_ids, root, 0
            memo = self._at.get(id(r))
            if r.output_ids:  # retracted or jump-forward requests: their outputs may change, matched whole
                ids = r.fill_ids
            elif memo is not None and memo[0] is r and self._attached(memo[1]):
                _, node, depth, length, end, end_len = memo  # the prompt never changes: go on from there
                if end is not node and node.children.get(ids[depth]) is end and len(end.key) == end_len:
                    # It ended inside an edge that is still there, unsplit: the same tokens, the same match.
                    at[id(r)], out[id(r)] = memo, (length, end)
                    continue
            node, depth, length, end = self._walk(ids, node, depth)
            at[id(r)] = (r, node, depth, length, end, len(end.key))
            out[id(r)] = (length, end)
        self._at = at
        return out

    def _attached(self, node: Any) -> bool:
        """Still in the tree: neither evicted nor under a root that reset() dropped."""
        while node.parent is not None:
            if node.parent.children.get(node.key[0]) is not node:
                return False  # evicted
            node = node.parent
        return node is self.tree.root

    @staticmethod
    def _walk(ids: list[int], node: Any, pos: int) -> tuple[Any, int, int, Any]:
        """From `node` at depth `pos`: (the last node wholly matched, its depth, the match's length,
        the node whose edge the match ends inside or the last node)."""
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                break
            shared = shared_len(child.key, ids, pos)
            if shared < len(child.key):
                return node, pos, pos + shared, child  # ends inside that edge
            node, pos = child, pos + shared
        return node, pos, pos, node


class SchedulePolicy:
    def __init__(self, policy: str, fairness_bound: int, tree_cache: Any, seed: int,
                 only_under_pressure: bool = False) -> None:
        if policy not in POLICIES:
            raise ValueError(f"schedule_policy must be one of {POLICIES} (got {policy!r})")
        self.policy = policy
        self.fairness_bound = fairness_bound
        self.tree_cache = tree_cache
        self.rng = random.Random(seed)
        self.memo = PrefixMemo(tree_cache)
        self.only_under_pressure = only_under_pressure
        self.reordered = False  # whether the last order() applied the cache-aware order

    def order(self, waiting: list[Req], free_slots: int | None = None) -> list[Req]:
        """The queue in the order to admit. `free_slots`: the KV slots free now, for the pressure gate."""
        overdue = sorted((r for r in waiting if r.passed_over >= self.fairness_bound), key=lambda r: r.arrival)
        rest = [r for r in waiting if r.passed_over < self.fairness_bound]
        return overdue + self._order(rest, free_slots)

    def reorders(self, waiting: list[Req], free_slots: int | None) -> bool:
        """Whether the cache-aware order is worth applying now (see the module's docstring)."""
        if self.policy not in ("lpm", "dfs-weight") or self.tree_cache.disable:
            return False
        if not self.only_under_pressure or free_slots is None:
            return True
        return sum(len(r.fill_ids) for r in waiting) > free_slots

    def _order(self, reqs: list[Req], free_slots: int | None) -> list[Req]:
        policy = self.policy
        if policy in ("lpm", "dfs-weight") and not self.reorders(reqs, free_slots):
            policy = "fcfs"
        self.reordered = policy in ("lpm", "dfs-weight")
        if policy == "fcfs":
            return sorted(reqs, key=lambda r: r.arrival)
        if policy == "lof":
            return sorted(reqs, key=lambda r: (-r.params.max_new_tokens, r.arrival))
        if policy == "random":
            shuffled = list(reqs)
            self.rng.shuffle(shuffled)
            return shuffled
        matches = self.memo.lengths(reqs)
        if policy == "lpm":
            return sorted(reqs, key=lambda r: (-matches[id(r)][0], r.arrival))
        return self._dfs_weight(reqs, {id(r): matches[id(r)][1] for r in reqs})

    def _dfs_weight(self, reqs: list[Req], last_nodes: dict[int, Any]) -> list[Req]:
        """Visits the tree depth first, heavier subtrees (more waiting requests under them) first, and
        emits each node's requests after its subtrees: requests sharing a subtree run back to back,
        deeper matches first, and requests with nothing cached (the root's) come last."""
        at_node: dict[int, list[Req]] = {}
        weight: dict[int, int] = {}
        kids: dict[int, list[Any]] = {}  # only the children with waiting requests below: O(queue x depth)
        for r in sorted(reqs, key=lambda r: r.arrival):
            node = last_nodes[id(r)]
            at_node.setdefault(id(node), []).append(r)
            while node is not None:
                if id(node) not in weight and node.parent is not None:
                    kids.setdefault(id(node.parent), []).append(node)
                weight[id(node)] = weight.get(id(node), 0) + 1
                node = node.parent
        ordered: list[Req] = []
        stack: list[tuple[Any, bool]] = [(self.tree_cache.root, False)]
        while stack:
            node, visited = stack.pop()
            if visited:
                ordered.extend(at_node.get(id(node), []))
                continue
            stack.append((node, True))  # its own requests once its subtrees are done
            # Heaviest popped first; among equals, the subtree whose first request arrived first.
            children = sorted(reversed(kids.get(id(node), [])), key=lambda c: weight[id(c)])
            stack.extend((c, False) for c in children)
        return ordered
