"""Prefill planning: which requests compute which tokens in the next extend step.

The planner takes the chunked request first, then waiting requests in policy order, within the
token budget (chunked prefill), the running-request limit and KV memory; it gives each planned
request its KV slots and table row and returns the plan. The loop applies the plan to its queues.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from radixlm.core.runtime.request import Req, Status
from radixlm.core.runtime.scheduler.constraints import JumpGather
from radixlm.core.runtime.scheduler.memory import KVMemory
from radixlm.core.runtime.scheduler.policy import SchedulePolicy
from radixlm.core.runtime.stats import EngineStats

# A waiting request whose new tokens share at least this many leading tokens with a request already
# in this prefill batch waits one step, so it reuses that prefix from the cache instead of recomputing
# it alongside (what makes a batch of prompts with a shared prefix compute the prefix once).
IN_BATCH_SHARED_PREFIX = 16


@dataclass
class Extend:
    req: Req
    start: int  # first position computed in this step
    length: int  # new tokens in this step
    finishes_prompt: bool  # the chunk reaches the end of fill_ids: sample the next token after it
    rides_along: bool = False  # a running request decoding its next token inside this extend step
    # Riding on a pending decode step (overlap): the input is the request's token that step sampled, still
    # on the device, at position seq_len (one past its applied tokens).
    ahead: bool = False


@dataclass
class PrefillPlan:
    extends: list[Extend] = field(default_factory=list)
    taken: list[Req] = field(default_factory=list)  # waiting requests planned: they leave the queue
    passed_over: list[Req] = field(default_factory=list)  # waiting requests a later arrival overtook
    chunked: Req | None = None  # the request whose prompt goes on in a later step


class PrefillPlanner:
    def __init__(self, memory: KVMemory, policy: SchedulePolicy, stats: EngineStats, chunked_prefill_size: int,
                 max_running_requests: int, admission_batch: int = 0) -> None:
        self.memory = memory
        self.policy = policy
        self.stats = stats
        self.chunk_budget = chunked_prefill_size if chunked_prefill_size > 0 else 1 << 62
        self.max_running_requests = max_running_requests
        self.admission_batch = admission_batch
        self.jumps = JumpGather()

    def plan(self, waiting: list[Req], running: list[Req], chunked: Req | None, chains: bool = False) -> PrefillPlan:
        """The next extend step's extends; `chains`: continuations' extend step would chain on a pending
        decode step (overlap), so they do not wait to gather."""
        budget = self.chunk_budget
        plan = PrefillPlan()
        if chunked is not None:
            ext = self.plan_extend(chunked, budget)
            if ext is None:
                plan.chunked = chunked
                return plan
            plan.extends.append(ext)
            budget -= ext.length
            if not ext.finishes_prompt:
                plan.chunked = chunked
        if not waiting or budget <= 0 or plan.chunked is not None:
            return plan
        if not plan.extends and self.jumps.should_wait(waiting, running, chains):
            return plan
        slots_left = self.max_running_requests - len(running) - len(plan.extends)
        if slots_left <= 0 or self.memory.rows_available() == 0:
            return plan  # nothing can be admitted: ordering the queue (O(waiting) for lpm) would buy nothing
        if running and not plan.extends and slots_left < min(self.admission_batch, len(waiting)):
            return plan  # a long queue waits for a larger admission: fewer, larger prefill steps
        # The chunked request's last chunk counts too: a request sharing its prompt waits a step and
        # then reuses all of it, instead of recomputing the part that this last chunk computes.
        in_batch = [e.req.fill_ids for e in plan.extends]
        order = self.policy.order(waiting, self.memory.allocator.available())
        self.stats.cache_aware_admissions_total += self.policy.reordered
        # Jump-forward continuations first: they hold their KV while they wait and need only their jumped
        # tokens; behind a request that cannot fit until that KV is freed, they would wait forever.
        if any(r.row is not None for r in order):
            order = [r for r in order if r.row is not None] + [r for r in order if r.row is None]
        for req in order:
            if slots_left <= 0 or budget <= 0 or self.memory.rows_available() == 0:
                break
            if self._shares_with_batch(req, in_batch):
                continue
            if req.row is None and not self.memory.tree.load_prefix(self.cacheable(req)):
                continue  # its cached prefix is still coming back from host memory: admitted once it lands
            ext = self.plan_extend(req, budget)
            if ext is None:
                break  # out of memory: later requests must not overtake this one
            plan.taken.append(req)
            plan.extends.append(ext)
            in_batch.append(req.fill_ids)
            budget -= ext.length
            slots_left -= 1
            if not ext.finishes_prompt:
                plan.chunked = req
                break
        if plan.taken:
            # Passed over: overtaken by a later arrival. Waiting behind earlier ones (as fcfs would make
            # it) does not count, or under memory pressure every request would soon be overdue and
            # the fairness bound would turn the cache-aware order into arrival order.
            taken, latest = {id(r) for r in plan.taken}, max(r.arrival for r in plan.taken)
            plan.passed_over = [r for r in waiting if id(r) not in taken and r.arrival < latest]
        return plan

    def ride_along(self, running: list[Req]) -> list[Extend]:
        """Running requests as one-token extends, for as many as memory allows now."""
        rides = []
        for req in running:
            ext = self.plan_extend(req, 1)
            if ext is None:
                break
            ext.rides_along = True
            rides.append(ext)
        return rides

    def ride_ahead(self, pending: list[Req]) -> list[Extend] | None:
        """The requests of a pending decode step (overlap) as one-token extends of their pending tokens,
        in that step's order; None (nothing held) when memory does not allow them all now."""
        slots = self.memory.alloc(len(pending))
        if slots is None:
            return None
        rides = []
        for req, slot in zip(pending, slots):
            start = req.seq_len
            self.memory.table.write(req.row, start, [slot])
            req.slots.append(slot)
            rides.append(Extend(req, start, 1, finishes_prompt=True, rides_along=True, ahead=True))
        return rides

    def _shares_with_batch(self, req: Req, in_batch: list[list[int]]) -> bool:
        tree = self.memory.tree
        if tree.disable or not in_batch:
            return False
        ids = req.fill_ids
        # Shares >= IN_BATCH_SHARED_PREFIX tokens past its cached prefix with a request in the batch:
        # a slice comparison (in C) instead of walking every pair token by token.
        need = len(tree.match_prefix(ids)[0]) + IN_BATCH_SHARED_PREFIX
        head = ids[:need]
        return len(head) == need and any(other[:need] == head for other in in_batch)

    @staticmethod
    def cacheable(req: Req) -> list[int]:
        """The part of a request's tokens that may come from the cache. The last token is always
        computed (its logits give the next token); input logprobs need the logits of every position
        from the first wanted one."""
        limit = len(req.fill_ids) - 1
        start = req.input_logprob_start()
        if start is not None:
            limit = min(limit, max(start - 1, 0))
        return req.fill_ids[:limit]

    def plan_extend(self, req: Req, budget: int) -> Extend | None:
        """Matches the request's prefix, allocates KV for its next chunk, and fills its table row.
        Returns None (with nothing held) when memory does not allow it now."""
        fill, memory, tree = req.fill_ids, self.memory, self.memory.tree
        if req.row is None:
            slots, node = tree.match_prefix(self.cacheable(req))
            tree.inc_lock_ref(node)
            length = min(len(fill) - len(slots), budget)
            new = memory.alloc(length)
            if new is None:
                tree.dec_lock_ref(node)
                return None
            req.row = memory.table.alloc()
            req.slots, req.cached_len, req.last_node = list(slots), len(slots), node
            if req.cached_tokens is None:  # first scheduled
                # Of the prompt: a constrained request may start with forced tokens (a jump forward
                # before its first step) that the match covers too, but they are output, not prompt.
                req.cached_tokens = min(len(slots), len(req.inp.input_ids))
                req.scheduled_time = time.monotonic()
                self.stats.cached_tokens_total += req.cached_tokens
                self.stats.prompt_tokens_total += len(req.inp.input_ids)
            memory.table.write(req.row, 0, slots)
        else:
            length = min(len(fill) - req.kv_len, budget)
            new = memory.alloc(length)
            if new is None:
                return None
        start = req.kv_len
        memory.table.write(req.row, start, new)
        req.slots.extend(new)
        req.status = Status.RUNNING
        return Extend(req, start, length, finishes_prompt=start + length == len(fill))
