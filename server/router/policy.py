"""The routing policies: cache_aware is core.runtime.distributed.prefix_routing's PrefixRouter (the rule `--dp-size`
uses); round_robin sends each request to the next replica in turn, as a plain load balancer does (the
baseline the benchmark compares against). Both count requests in flight per replica the same way."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

from radixlm.core.runtime.distributed.prefix_routing import PrefixRouter
from radixlm.server.router.args import RouterArgs


class RoundRobin:
    """PrefixRouter's interface, without a tree: the next replica (in the order they joined) after the
    last one chosen, among the candidates."""

    def __init__(self) -> None:
        self.loads: dict[Hashable, int] = {}
        self._next = 0

    def add_worker(self, worker: Hashable, capacity: int) -> None:
        self.loads.setdefault(worker, 0)

    def remove_worker(self, worker: Hashable) -> None:
        self.loads.pop(worker, None)

    def forget_cache(self, worker: Hashable) -> None:
        pass

    def route(self, ids: Sequence[int], among: Iterable[Hashable] | None = None) -> tuple[Hashable, int]:
        allowed = set(self.loads if among is None else among)
        order = [w for w in self.loads if w in allowed]
        if not order:
            raise LookupError("no worker to route to")
        worker = order[self._next % len(order)]
        self._next += 1
        self.loads[worker] += 1
        return worker, 0

    def finish(self, worker: Hashable, seq: Sequence[int] | None = None) -> None:
        if worker in self.loads:
            self.loads[worker] -= 1


def make_policy(args: RouterArgs) -> PrefixRouter | RoundRobin:
    if args.policy == "round_robin":
        return RoundRobin()
    if not 0.0 <= args.cache_threshold <= 1.0:
        raise ValueError(f"--cache-threshold must be in [0, 1] (got {args.cache_threshold})")
    if args.balance_abs_slack < 0 or args.balance_rel_slack < 0:
        raise ValueError("--balance-abs-slack and --balance-rel-slack must be >= 0")
    return PrefixRouter(True, args.balance_abs_slack, args.balance_rel_slack, args.cache_threshold)
