"""KV memory as the scheduler uses it: slots from the allocator (evicting cached prefixes when short),
request-to-token rows, giving a request's KV to the radix cache, and choosing whom to retract when a
decode step does not fit."""

from __future__ import annotations

import logging
from typing import Any, Callable

from radixlm.core.runtime.memory.memory_pool import SlotAllocator
from radixlm.core.runtime.request import Req

logger = logging.getLogger("radixlm")


class KVMemory:
    def __init__(self, allocator: SlotAllocator, tree: Any, table: Any) -> None:
        """`tree` is a RadixCache (or its timed view), `table` the runner's request-to-token table."""
        self.allocator = allocator
        self.tree = tree
        self.table = table
        # Called with each request that gives its KV back (finished or retracted): the draft model's KV
        # of that request goes too (core.runtime.speculative).
        self.release_hooks: list[Callable[[Req], None]] = []

    def alloc(self, n: int) -> list[int] | None:
        """`n` free slots, evicting cached prefixes if needed; None (nothing taken) when even that fails."""
        slots = self.allocator.alloc(n)
        if slots is None:
            self.tree.evict(n - self.allocator.available())
            slots = self.allocator.alloc(n)
        return slots

    def rows_available(self) -> int:
        return self.table.available()

    def cache_prefix(self, req: Req) -> None:
        """Caches what the request has computed so far, so its next chunk and other requests reuse it
        while it is still running."""
        if self.tree.disable:
            return
        slots, node = self.tree.cache_unfinished(req.fill_ids[: req.kv_len], req.slots, req.cached_len, req.last_node)
        req.slots, req.cached_len, req.last_node = list(slots), len(slots), node
        self.table.write(req.row, 0, slots)

    def release(self, req: Req) -> None:
        """Gives the request's KV to the radix cache (evictable) and its table row back."""
        for hook in self.release_hooks:
            hook(req)
        if req.row is None:
            return
        self.tree.cache_finished(req.fill_ids[: req.kv_len], req.slots, req.cached_len, req.last_node)
        self.table.free(req.row)
        req.row, req.slots, req.cached_len, req.last_node = None, [], 0, None

    def make_decode_room(self, running: list[Req]) -> tuple[list[Req], bool]:
        """Every running request needs one new slot. Evicts cached prefixes first, then releases the KV
        of the requests that arrived last until the rest fit. Returns the released requests (to retract,
        in the order released) and whether the rest fit now."""
        keep = list(running)
        retract: list[Req] = []
        if self.allocator.available() < len(keep):
            self.tree.evict(len(keep) - self.allocator.available())
        while self.allocator.available() < len(keep) and len(keep) > 1:
            victim = max(keep, key=lambda r: r.arrival)
            logger.info("retracting request %s (%d tokens) to free KV memory", victim.rid, victim.seq_len)
            keep.remove(victim)
            self.release(victim)
            retract.append(victim)
            if self.allocator.available() < len(keep):
                self.tree.evict(len(keep) - self.allocator.available())
        return retract, self.allocator.available() >= len(keep)

    def owned_slots(self, reqs: list[Req]) -> set[int]:
        """The slots the requests hold outside the tree; asserts that no two hold the same one."""
        owned: set[int] = set()
        for req in reqs:
            mine = req.slots[req.cached_len :]
            assert not owned.intersection(mine), f"request {req.rid} shares owned slots"
            owned.update(mine)
        return owned
