"""The scheduler's decision units, each alone, and the whole loop, without a model or a tokenizer.

A stub tokenizer writes one character per token. A fake model runner stores the token written into
each KV slot and answers, for every position, logits whose argmax is `next_token(the tokens that the
request-to-token table's slots hold for positions 0..p)`: a slot written to the wrong place, shared
when it should not be, or reused while still needed changes the output, which the tests compare with
the same function run over plain lists (the oracle).
"""

from __future__ import annotations

import importlib.util
import random
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from radixlm.core.runtime.memory.memory_pool import ReqToTokenPool, SlotAllocator
from radixlm.core.runtime.execution.batch_input import BatchInput
from radixlm.core.runtime.options import EngineOptions
from radixlm.core.runtime.memory.radix_cache import RadixCache
from radixlm.core.runtime.messages import Abort, FinishReason, GenerateOutput, GenerateRequest
from radixlm.core.runtime.request import Req
from radixlm.core.runtime.sampling_params import SamplingParams
from radixlm.core.runtime.scheduler import Scheduler
from radixlm.core.runtime.scheduler.batch import extend_batch
from radixlm.core.runtime.scheduler.constraints import JUMP_GATHER_RATIO, JUMP_GATHER_STEPS, JumpGather, jump_forward
from radixlm.core.runtime.scheduler.finish import Finish, check_finish
from radixlm.core.runtime.scheduler.memory import KVMemory
from radixlm.core.runtime.scheduler.policy import SchedulePolicy
from radixlm.core.runtime.scheduler.prefill import IN_BATCH_SHARED_PREFIX, PrefillPlanner
from radixlm.core.runtime.scheduler.queues import RequestQueues
from radixlm.core.runtime.stats import EngineStats
from radixlm.core.runtime.tokenizer.detokenizer import IncrementalDetokenizer

V = 32
ALPHABET = "abcdefghijklmnopqrstuvwxyz012345"
EOS = V - 1


class StubTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(ALPHABET[i] for i in ids)


def next_token(context: list[int]) -> int:
    h = 0
    for tok in context:
        h = (h * 31 + tok + 1) % 1_000_003
    return h % V


def oracle(prompt: list[int], max_new_tokens: int, stop_token_ids: tuple[int, ...] = (),
           ignore_eos: bool = False) -> list[int]:
    ctx, out = list(prompt), []
    while len(out) < max_new_tokens:
        tok = next_token(ctx)
        out.append(tok)
        if (tok == EOS and not ignore_eos) or tok in stop_token_ids:
            break
        ctx.append(tok)
    return out


class FakeRunner:
    """Stands where ModelRunner does: the same table, a KV pool of token ids, logits from next_token."""

    def __init__(self, num_slots: int, max_running_requests: int, context_len: int = 256) -> None:
        self.cfg = SimpleNamespace(vocab_size=V, context_len=context_len)
        self.num_slots = num_slots
        self.device = torch.device("cpu")
        self.req_to_token = ReqToTokenPool(max_running_requests + 1, context_len + 1, "cpu")
        self.kv = torch.full((num_slots + 1,), -1, dtype=torch.long)  # slots are 1..num_slots
        self.steps: list[BatchInput] = []

    def forward(self, batch: BatchInput) -> torch.Tensor:
        self.steps.append(batch)
        table = self.req_to_token
        table.flush()
        loc = torch.tensor(batch.out_cache_loc, dtype=torch.long)
        if batch.is_decode:  # as the real runner does, it records decode slots itself
            table.table[torch.tensor(batch.rows), torch.tensor(batch.positions)] = loc.to(torch.int32)
        # Overlap scheduling hands a decode step its input as the previous step's tokens on the device.
        ids = batch.input_future if batch.input_future is not None else torch.tensor(batch.input_ids)
        self.kv[loc] = ids.long()
        owner = [k for k, n in enumerate(batch.extend_lens) for _ in range(n)]
        logits = torch.zeros(len(batch.logit_rows), V)
        for j, i in enumerate(batch.logit_rows):
            slots = table.table[batch.rows[owner[i]], : batch.positions[i] + 1].long()
            logits[j, next_token(self.kv[slots].tolist())] = 10.0
        return logits

    def idle(self) -> None:  # the loop is about to wait for a request
        pass


def make_req(prompt: list[int], arrival: int = 0, rid: str | None = None, **params) -> Req:
    sp = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 8, **params})
    inp = GenerateRequest(rid or f"r{arrival}", list(prompt), sp)
    detok = IncrementalDetokenizer(StubTokenizer(), True, sp.stop, False, lazy=not sp.stop)
    return Req(inp=inp, detok=detok, arrival=arrival)


def make_memory(num_slots: int = 64, rows: int = 8, disable: bool = False) -> KVMemory:
    allocator = SlotAllocator(num_slots)
    return KVMemory(allocator, RadixCache(allocator, disable=disable), ReqToTokenPool(rows + 1, 257, "cpu"))


def cache(memory: KVMemory, tokens: list[int]) -> None:
    """Puts `tokens` in the radix tree as a finished request would leave them."""
    slots = memory.allocator.alloc(len(tokens))
    memory.allocator.free(slots[: memory.tree.insert(tokens, slots)])


def make_planner(memory: KVMemory, policy: str = "lpm", chunk: int = -1, max_running: int = 8,
                 fairness: int = 100, only_under_pressure: bool = False, admission_batch: int = 0) -> PrefillPlanner:
    return PrefillPlanner(memory, SchedulePolicy(policy, fairness, memory.tree, 0, only_under_pressure), EngineStats(),
                          chunk, max_running, admission_batch)


# ---- policy -----------------------------------------------------------------------------------


def rids(reqs: list[Req]) -> list[str]:
    return [r.rid for r in reqs]


def test_fcfs_and_lof_orders():
    memory = make_memory()
    reqs = [make_req([1], 2, max_new_tokens=5), make_req([2], 0, max_new_tokens=9), make_req([3], 1, max_new_tokens=9)]
    assert rids(SchedulePolicy("fcfs", 100, memory.tree, 0).order(reqs)) == ["r0", "r1", "r2"]
    # Longest output first, ties by arrival.
    assert rids(SchedulePolicy("lof", 100, memory.tree, 0).order(reqs)) == ["r0", "r1", "r2"]
    reqs[0].inp.sampling_params.max_new_tokens = 50
    assert rids(SchedulePolicy("lof", 100, memory.tree, 0).order(reqs)) == ["r2", "r0", "r1"]


def test_lpm_takes_the_longest_cached_prefix_first():
    memory = make_memory()
    cache(memory, [1, 2, 3, 4, 5, 6])
    cache(memory, [7, 8])
    reqs = [make_req([9, 9, 9], 0), make_req([7, 8, 9], 1), make_req([1, 2, 3, 4, 9], 2), make_req([1, 2, 9], 3)]
    assert rids(SchedulePolicy("lpm", 100, memory.tree, 0).order(reqs)) == ["r2", "r1", "r3", "r0"]


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_lpm_at_a_long_queue_follows_the_tree_as_it_grows_and_shrinks():
    """Hundreds waiting (no fallback to fcfs): the order is the oracle's (longest common prefix with
    any cached sequence, by plain lists), step after step, while the tree gains sequences, is evicted
    and reset; ordering reads the tree without changing it (no split, no LRU refresh)."""
    rng = random.Random(0)
    memory = make_memory(num_slots=4096)
    heads = [[rng.randrange(V) for _ in range(24)] for _ in range(6)]
    reqs = [make_req(heads[i % 6][: rng.randrange(4, 24)] + [rng.randrange(V) for _ in range(6)], i)
            for i in range(300)]
    policy = SchedulePolicy("lpm", 1000, memory.tree, 0)
    cached: list[list[int]] = []

    def check() -> None:
        def key(r: Req) -> tuple[int, int]:
            return (-max((lcp(r.inp.input_ids, c) for c in cached), default=0), r.arrival)

        before = [(n.key, n.last_access) for n in memory.tree.nodes()]
        assert rids(policy.order(reqs)) == rids(sorted(reqs, key=key))
        assert [(n.key, n.last_access) for n in memory.tree.nodes()] == before

    check()
    for head in heads[:3]:  # a prefix of a sequence first, then the whole: the walk goes on from its node
        for part in (head[:10], head):
            cache(memory, part)
            cached.append(part)
            check()
    memory.tree.evict(memory.tree.evictable_size())  # everything detached: matches start again at the root
    cached.clear()
    check()
    cache(memory, heads[4])
    cached.append(heads[4])
    check()
    memory.tree.reset()
    cached.clear()
    check()


def test_dfs_weight_runs_the_heavier_subtree_first_and_keeps_it_together():
    memory = make_memory()
    cache(memory, [1, 1, 1, 1])
    cache(memory, [2, 2, 2, 2])
    light = make_req([1, 1, 1, 1, 5], 0)
    heavy = [make_req([2, 2, 2, 2, 5], 1), make_req([2, 2, 2, 2, 6], 3)]
    fresh = make_req([3, 3], 2)
    order = SchedulePolicy("dfs-weight", 100, memory.tree, 0).order([light, heavy[0], fresh, heavy[1]])
    # The subtree with two waiting requests, back to back, then the lighter one, and the root's own
    # requests (nothing cached) last.
    assert rids(order) == ["r1", "r3", "r0", "r2"]


def test_dfs_weight_groups_matches_that_end_inside_one_edge():
    """A cached sequence is one edge until something splits it: requests whose matches end inside it
    still share its subtree (ordering reads the tree and splits nothing)."""
    memory = make_memory()
    cache(memory, [1] * 6)
    cache(memory, [2] * 6)
    reqs = [make_req([1, 1, 1, 5], 0), make_req([2, 2, 2, 2, 5], 1), make_req([3], 2), make_req([2, 2, 2, 6], 3),
            make_req([1, 1, 1, 1, 7], 4), make_req([2, 2, 9], 5)]
    order = SchedulePolicy("dfs-weight", 100, memory.tree, 0).order(reqs)
    assert rids(order) == ["r1", "r3", "r5", "r0", "r4", "r2"]
    assert [n.key for n in memory.tree.root.children.values()] == [[1] * 6, [2] * 6]


def test_fairness_bound_puts_overdue_requests_first_oldest_first():
    memory = make_memory()
    cache(memory, [1, 2, 3, 4])
    starved = [make_req([9, 9], 5), make_req([8, 8], 4)]
    matched = make_req([1, 2, 3, 4, 5], 0)
    for r in starved:
        r.passed_over = 3
    policy = SchedulePolicy("lpm", 3, memory.tree, 0)
    assert rids(policy.order([matched, *starved])) == ["r4", "r5", "r0"]
    starved[0].passed_over = starved[1].passed_over = 2
    assert rids(policy.order([matched, *starved]))[0] == "r0"


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_cache_aware_orders_reorder_only_when_the_waiting_prompts_outgrow_the_free_slots(policy):
    """One admission at a time: the later arrival matches 6 cached tokens, the earlier nothing. With
    room for every waiting prompt, the gated policy keeps arrival order (nothing cached is evicted
    before its request runs, whatever the order); once the prompts need more slots than are free it
    takes the cached match first; ungated it always does."""
    def first_taken(num_slots: int, gated: bool) -> str:
        memory = make_memory(num_slots=num_slots)
        cache(memory, [1, 2, 3, 4, 5, 6])
        waiting = [make_req([9] * 8, 0), make_req([1, 2, 3, 4, 5, 6, 7, 8], 1)]
        demand = sum(len(r.fill_ids) for r in waiting)
        assert (memory.allocator.available() >= demand) == (num_slots == 64)
        planner = make_planner(memory, policy, max_running=1, only_under_pressure=gated)
        taken = rids(planner.plan(waiting, [], None).taken)[0]
        assert planner.stats.cache_aware_admissions_total == (taken == "r1")
        return taken

    assert first_taken(64, gated=True) == "r0"
    assert first_taken(20, gated=True) == "r1"  # 14 free slots for 16 waiting tokens
    assert first_taken(64, gated=False) == "r1"


def test_random_order_is_a_permutation_fixed_by_the_seed():
    memory = make_memory()
    reqs = [make_req([i + 1], i) for i in range(12)]
    orders = [rids(SchedulePolicy("random", 100, memory.tree, seed).order(reqs)) for seed in (1, 1, 2)]
    assert sorted(orders[0]) == sorted(rids(reqs)) and orders[0] == orders[1] and orders[0] != orders[2]


def test_fairness_bound_lets_a_starved_request_in_after_that_many_rounds():
    """One request runs at a time; every round a new request matching the cache arrives and lpm prefers
    it, until the unrelated request has been passed over `bound` times."""
    memory, bound = make_memory(), 3
    cache(memory, list(range(1, 9)))
    planner = make_planner(memory, max_running=1, fairness=bound)
    queues = RequestQueues(memory, EngineStats())
    queues.add(make_req([30, 30], 0, rid="starved"))
    taken = []
    for round_ in range(1, 7):
        queues.add(make_req(list(range(1, 9)) + [round_], round_))
        plan = planner.plan(queues.waiting, [], None)
        queues.take(plan.taken, plan.passed_over)
        taken.append(plan.taken[0].rid)
        memory.release(plan.taken[0])
    assert taken.index("starved") == bound


def test_unknown_policy_is_refused_by_name():
    with pytest.raises(ValueError, match="schedule_policy"):
        SchedulePolicy("longest", 3, make_memory().tree, 0)


# ---- prefill planning -------------------------------------------------------------------------


def test_token_budget_chunks_a_long_prompt_and_continues_it():
    memory = make_memory()
    planner = make_planner(memory, chunk=8)
    a, b, c = make_req(list(range(1, 6)), 0), make_req(list(range(10, 22)), 1), make_req([5, 5], 2)
    plan = planner.plan([a, b, c], [], None)
    assert [(e.req.rid, e.start, e.length, e.finishes_prompt) for e in plan.extends] == [("r0", 0, 5, True),
                                                                                       ("r1", 0, 3, False)]
    assert plan.taken == [a, b] and plan.chunked is b and plan.passed_over == []  # c waits behind, not overtaken
    plan = planner.plan([c], [a], b)  # the chunk goes on first; c waits while a chunk is unfinished
    assert [(e.req.rid, e.start, e.length) for e in plan.extends] == [("r1", 3, 8)]
    assert plan.chunked is b and plan.taken == [] and plan.passed_over == []
    plan = planner.plan([c], [a], b)
    assert [(e.req.rid, e.start, e.length, e.finishes_prompt) for e in plan.extends] == [("r1", 11, 1, True),
                                                                                       ("r2", 0, 2, True)]
    assert plan.chunked is None


def test_running_limit_and_memory_bound_the_plan():
    memory = make_memory(num_slots=10)
    planner = make_planner(memory, max_running=2, policy="fcfs")
    reqs = [make_req([1, 2, 3], i) for i in range(3)]
    plan = planner.plan(reqs, [make_req([7], 9)], None)  # one running: room for one more
    # Waiting behind an earlier arrival is not being passed over (only a later arrival's overtaking counts).
    assert plan.taken == reqs[:1] and plan.passed_over == []
    big, small = make_req(list(range(20)), 3), make_req([4, 4], 4)
    plan = make_planner(memory, policy="fcfs").plan([big, small], [], None)
    assert plan.extends == [] and plan.taken == []  # big does not fit, and small may not overtake it
    assert memory.allocator.available() == 10 - 3 and big.row is None and big.slots == []


def test_admission_batch_holds_a_long_queue_until_enough_slots_are_free():
    def taken(waiting_count: int, running_count: int, admission_batch: int = 4) -> list[str]:
        memory = make_memory(num_slots=256, rows=8)
        waiting = [make_req([i + 1] * 4, i) for i in range(waiting_count)]
        running = [make_req([50 + i], 10 + i) for i in range(running_count)]
        planner = make_planner(memory, "fcfs", max_running=8, admission_batch=admission_batch)
        return rids(planner.plan(waiting, running, None).taken)

    assert taken(6, 5) == []  # 3 running slots free of the 4 asked for
    assert taken(6, 4) == ["r0", "r1", "r2", "r3"]
    assert taken(2, 5) == ["r0", "r1"]  # all the waiting fit
    assert len(taken(6, 0)) == 6  # nothing running: no reason to wait
    assert len(taken(6, 5, admission_batch=0)) == 3


def test_a_request_sharing_a_prefix_with_one_in_the_batch_waits_then_reuses_it():
    memory = make_memory()
    planner = make_planner(memory, policy="fcfs")
    shared = list(range(1, IN_BATCH_SHARED_PREFIX + 1))
    first, second = make_req(shared + [20, 21], 0), make_req(shared + [22], 1)
    unrelated = make_req([30, 30], 2)
    plan = planner.plan([first, second, unrelated], [], None)
    assert plan.taken == [first, unrelated] and plan.passed_over == [second]
    memory.cache_prefix(first)  # what the loop does once first's prefill is computed
    plan = planner.plan([second], [first, unrelated], None)
    assert plan.taken == [second] and second.cached_tokens == len(shared)
    assert plan.extends[0].start == len(shared) and plan.extends[0].length == 1
    # A shorter overlap does not wait.
    short = make_req(shared[:4] + [9] * 20, 3)
    assert make_planner(make_memory()).plan([make_req(shared[:4] + [8] * 20, 4), short], [], None).passed_over == []


def test_a_request_sharing_the_chunked_prompt_waits_for_its_last_chunk():
    memory = make_memory(num_slots=256)
    planner = make_planner(memory, chunk=48)
    shared = [(5 * i) % 29 + 1 for i in range(80)]
    long, other = make_req(shared + [1, 1], 0), make_req(shared + [2, 2], 1)
    plan = planner.plan([long], [], None)
    assert plan.chunked is long and plan.extends[0].length == 48
    memory.cache_prefix(long)
    plan = planner.plan([other], [], long)  # long's last 34 tokens, and 14 tokens of budget left
    assert [(e.req.rid, e.start, e.length) for e in plan.extends] == [("r0", 48, 34)]
    assert plan.passed_over == [] and plan.chunked is None
    memory.cache_prefix(long)
    plan = planner.plan([other], [long], None)
    assert [(e.req.rid, e.start, e.length) for e in plan.extends] == [("r1", 80, 2)]  # all of the prefix reused


def test_wanted_input_logprobs_limit_the_prefix_match():
    """Positions whose prompt logprobs are wanted must be computed, however much of the prompt is cached."""
    prompt = list(range(1, 13))
    starts = {}
    for start in (None, 0, 5):
        memory = make_memory()
        cache(memory, prompt)
        extra = {} if start is None else {"return_logprob": True, "logprob_start_len": start}
        req = make_req(prompt)
        req.inp = GenerateRequest("r0", prompt, req.params, **extra)
        (ext,) = make_planner(memory).plan([req], [], None).extends
        starts[start] = (ext.start, req.cached_tokens)
    assert starts == {None: (11, 11), 0: (0, 0), 5: (4, 4)}


def test_extend_batch_asks_logits_only_where_they_are_used():
    memory = make_memory()
    planner = make_planner(memory, chunk=6)
    plain, scored = make_req([1, 2, 3], 0), make_req([4, 5, 6, 7], 1)
    scored.inp = GenerateRequest("r1", scored.inp.input_ids, scored.params, return_logprob=True, logprob_start_len=2)
    chunked = make_req([8] * 10, 2)
    plan = planner.plan([plain, scored], [], None)
    plan.extends += planner.plan([chunked], [], None).extends
    batch, use = extend_batch(plan.extends)
    assert batch.extend_lens == [3, 3, 6] and batch.positions[3:6] == [0, 1, 2]
    # plain: its last position; scored (3 of 4 prompt tokens fit): positions 1..2 give the logprobs of
    # tokens 2..3; the unfinished chunk: none.
    assert batch.logit_rows == [2, 4, 5] and use == [(0, 2, 1), (1, 1, 2), (3, 6, 0)]


def test_ride_along_gives_running_requests_one_token_each():
    memory = make_memory()
    planner = make_planner(memory)
    a, b = make_req([1, 2], 0), make_req([3, 4], 1)
    planner.plan([a, b], [], None)
    a.output_ids.append(5)
    b.output_ids.append(6)
    rides = planner.ride_along([a, b])
    assert [(e.req.rid, e.start, e.length, e.rides_along) for e in rides] == [("r0", 2, 1, True), ("r1", 2, 1, True)]


# ---- memory and retraction -------------------------------------------------------------------


def running_with_kv(memory: KVMemory, count: int, prompt_len: int = 4) -> list[Req]:
    planner = make_planner(memory, policy="fcfs")
    reqs = [make_req([i + 1] * prompt_len, i) for i in range(count)]
    assert planner.plan(reqs, [], None).taken == reqs
    return reqs


def test_decode_room_retracts_the_latest_arrivals_until_the_rest_fit():
    memory = make_memory(num_slots=12, disable=True)  # no cache: a release frees its slots at once
    reqs = running_with_kv(memory, 3)
    assert memory.allocator.available() == 0
    retract, fits = memory.make_decode_room([reqs[1], reqs[2], reqs[0]])
    assert retract == [reqs[2]] and fits  # 4 slots freed for the 2 left
    assert reqs[2].row is None and reqs[2].slots == [] and memory.allocator.available() == 4


def test_decode_room_evicts_cached_prefixes_before_retracting():
    memory = make_memory(num_slots=15)
    reqs = running_with_kv(memory, 3)
    cache(memory, [9, 9, 9])
    assert memory.allocator.available() == 0 and memory.tree.evictable_size() == 3
    assert memory.make_decode_room(reqs) == ([], True)
    assert memory.allocator.available() == 3 and memory.tree.evictable_size() == 0


def test_decode_room_reports_a_lone_request_that_cannot_grow():
    memory = make_memory(num_slots=4)
    reqs = running_with_kv(memory, 1)
    assert memory.make_decode_room(reqs) == ([], False)  # the caller ends it: nobody to retract


def test_decode_room_released_kv_goes_to_the_cache_and_is_reused():
    memory = make_memory(num_slots=12)
    reqs = running_with_kv(memory, 3)
    retract, fits = memory.make_decode_room(reqs)
    assert retract == [reqs[2]] and fits
    memory.tree.check_invariants(memory.owned_slots(reqs[:2]))


# ---- finishing --------------------------------------------------------------------------------


def finish_after(req: Req, tokens: list[int], context_len: int = 256) -> Finish | None:
    result = None
    for tok in tokens:
        req.output_ids.append(tok)
        result = check_finish(req, tok, [EOS], context_len)
        if result is not None:
            break
    return result


def test_finish_reasons():
    assert finish_after(make_req([1]), [3, EOS]) == Finish("stop", EOS)
    assert finish_after(make_req([1], ignore_eos=True), [3, EOS]) is None
    assert finish_after(make_req([1], stop_token_ids=[4]), [3, 4, 5]) == Finish("stop", 4)
    req = make_req([1], max_new_tokens=3)
    assert finish_after(req, [2, 2, 2, 2]) == Finish("length") and len(req.output_ids) == 3
    req = make_req([1] * 6, max_new_tokens=100)
    assert finish_after(req, [2] * 10, context_len=8) == Finish("length") and req.seq_len == 8
    req = make_req([1], stop=["cd"])  # tokens 2, 3 read "cd"
    assert finish_after(req, [0, 2, 3, 4]) == Finish("stop", "cd") and req.output_ids == [0, 2, 3]


def test_min_new_tokens_holds_stop_strings_back():
    req = make_req([1], stop=["cd"], min_new_tokens=4)
    assert finish_after(req, [2, 3, 2, 3]) == Finish("stop", "cd") and len(req.output_ids) == 4
    assert req.detok.text == "cd"  # the stop found at the fourth token is the second "cd"


# ---- constraints: jump forward and gathering --------------------------------------------------


class ForcedTokens:
    """A TokenConstraint stub whose jump_forward returns a fixed plan and records what it was asked."""

    def __init__(self, plan: tuple[int, list[int]] | None, finished: bool = False) -> None:
        self.plan, self.finished, self.asked = plan, finished, None

    def jump_forward(self, output_ids, tokenizer, max_replace=1, max_new_tokens=None):
        self.asked = (max_replace, max_new_tokens)
        return self.plan

    def is_finished(self) -> bool:
        return self.finished


def constrained(plan, finished=False, outputs=(), kv_len=None, **params) -> Req:
    req = make_req([1, 2, 3], **params)
    req.constraint = ForcedTokens(plan, finished)
    for tok in outputs:
        req.output_ids.append(tok)
        req.detok.add(tok)
    req.slots = list(range(req.seq_len - 1 if kv_len is None else kv_len))
    return req


def test_jump_forward_replaces_the_tail_and_reports_room():
    req = constrained((1, [5, 6, 7]), outputs=[4, 4], max_new_tokens=10)
    assert jump_forward(req, StubTokenizer(), context_len=256) == (True, None)
    assert req.output_ids == [4, 5, 6, 7] and req.detok.ids == [4, 5, 6, 7]
    # The newest token has no KV yet: it may be re-tokenized; room is what max_new_tokens leaves.
    assert req.constraint.asked == (1, 10 - 2)
    req = constrained(None, outputs=[4], kv_len=4, max_new_tokens=10)  # every token has KV
    assert jump_forward(req, StubTokenizer(), context_len=7) == (False, None) and req.output_ids == [4]
    assert req.constraint.asked == (0, 7 - 4 - 1)  # the context leaves less room than max_new_tokens


def test_jump_forward_finishes_when_the_jump_ends_the_request():
    req = constrained((0, [5, 6]), finished=True, outputs=[4])
    assert jump_forward(req, StubTokenizer(), 256) == (True, Finish("stop"))
    req = constrained((0, [5, 6]), outputs=[4], max_new_tokens=3)
    assert jump_forward(req, StubTokenizer(), 256) == (True, Finish("length"))
    req = constrained((0, [2, 3]), outputs=[4], stop=["cd"])
    assert jump_forward(req, StubTokenizer(), 256) == (True, Finish("stop", "cd"))


def test_jump_continuations_gather_for_a_bounded_number_of_steps():
    gather = JumpGather()
    running = [make_req([1], i) for i in range(8)]
    jumped = make_req([1], 10)
    jumped.row = 0
    waits = [gather.should_wait([jumped], running, False) for _ in range(JUMP_GATHER_STEPS + 2)]
    assert waits == [True] * JUMP_GATHER_STEPS + [False, True]
    assert not JumpGather().should_wait([jumped, make_req([2], 11)], running, False)  # a new request: no waiting
    enough = [jumped] * (len(running) // JUMP_GATHER_RATIO)
    assert not JumpGather().should_wait(enough, running, False)
    assert not JumpGather().should_wait([jumped], [], False)
    assert not JumpGather().should_wait([jumped], running, True)  # a chained extend step: no waiting


# ---- the whole loop ---------------------------------------------------------------------------


def run_scheduler(num_slots: int, prompts: list[list[int]], params: list[dict], rids: list[str] | None = None,
                  on_chunk=None, **opts) -> tuple[Scheduler, list]:
    """Runs the loop on its thread; the final GenerateOutput of each request, in order (requests sharing a
    request id take that id's finals in the order they arrive). `on_chunk(scheduler, i, out)` sees the
    stream chunks."""
    options = EngineOptions.from_kwargs({"device": "cpu", "debug_check_invariants": True, **opts})
    sched = Scheduler(FakeRunner(num_slots, options.max_running_requests), options, StubTokenizer(), [EOS])
    rows = sched.runner.req_to_token.available()
    rids = rids or [f"q{i}" for i in range(len(prompts))]
    finals: list = [None] * len(prompts)
    for rid, prompt, p in zip(rids, prompts, params):
        p = dict(p)
        stream, constraint = p.pop("stream", False), p.pop("constraint", None)
        sp = SamplingParams.from_dict({"temperature": 0, **p})
        sched.inbox.put(GenerateRequest(rid, prompt, sp, stream=stream, constraint=constraint))
    thread = threading.Thread(target=sched.run_forever)
    thread.start()
    try:
        while any(f is None for f in finals):
            out = sched.outbox.get(timeout=60)  # the scheduler did not finish every request: queue.Empty
            if out.finish is None:
                if on_chunk is not None:
                    on_chunk(sched, rids.index(out.rid), out)
                continue
            finals[next(i for i, rid in enumerate(rids) if rid == out.rid and finals[i] is None)] = out
    finally:
        sched.stop()
        thread.join(10)
    sched.check_invariants()
    assert sched.runner.req_to_token.available() == rows  # every request-to-token row back
    return sched, finals


def prompts_with_shared_prefixes(count: int) -> list[list[int]]:
    system = [(7 * i) % 29 + 1 for i in range(20)]
    return [system + [i + 1, (3 * i) % 30] if i % 3 else [i + 2] * (5 + i) for i in range(count)]


def test_loop_outputs_are_what_the_logits_dictate_and_every_slot_comes_back():
    prompts = prompts_with_shared_prefixes(7)
    params = [{"max_new_tokens": 6 + i} for i in range(7)]
    params[2]["stop_token_ids"] = [oracle(prompts[2], 20)[3]]
    sched, finals = run_scheduler(512, prompts, params, chunked_prefill_size=16, max_running_requests=3)
    for out, prompt, p in zip(finals, prompts, params):
        assert out.output_ids == oracle(prompt, p["max_new_tokens"], tuple(p.get("stop_token_ids", ())))
        assert out.finish.type in ("stop", "length")
    assert finals[2].finish == FinishReason("stop", params[2]["stop_token_ids"][0])
    stats = sched.get_stats()
    # The shared prefix is reused: the first request computes it in 16-token chunks, and the others
    # match at least its first chunk.
    assert stats["cached_tokens_total"] >= 16 * 3
    assert stats["kv_slots_free"] + stats["kv_slots_cached"] == 512
    assert stats["running"] == stats["waiting"] == 0
    assert sched.flush_cache() and sched.get_stats()["kv_slots_free"] == 512


def test_loop_retracts_under_memory_pressure_and_outputs_stay_the_same():
    prompts = [[i + 1] * 6 for i in range(4)]
    params = [{"max_new_tokens": 24, "ignore_eos": True}] * 4
    sched, finals = run_scheduler(64, prompts, params, max_running_requests=4)
    assert sched.stats.retractions_total > 0
    for out, prompt in zip(finals, prompts):
        assert out.output_ids == oracle(prompt, 24, ignore_eos=True)
    assert sched.flush_cache() and sched.get_stats()["kv_slots_free"] == 64


def test_loop_an_abort_and_a_reused_request_id_end_alone_and_free_their_kv():
    prompts = [[1] * 6, [2] * 6, [3] * 6]
    params = [{"max_new_tokens": 40, "ignore_eos": True, "stream": True},
              *[{"max_new_tokens": 10, "ignore_eos": True}] * 2]

    def abort_the_stream(sched: Scheduler, i: int, out: GenerateOutput) -> None:
        sched.inbox.put(Abort("a"))

    sched, finals = run_scheduler(256, prompts, params, rids=["a", "b", "b"], on_chunk=abort_the_stream)
    aborted = finals[0]
    assert aborted.finish.type == "abort" and aborted.finish.error == "aborted by request"
    assert aborted.completion_tokens < 40
    served, refused = sorted(finals[1:], key=lambda out: out.finish.type == "abort")  # ids alone can't tell
    assert served.output_ids == oracle(prompts[1], 10, ignore_eos=True)
    assert refused.finish.type == "abort" and refused.finish.status_code == 400
    assert "already in use" in refused.finish.error
    assert sched.flush_cache() and sched.get_stats()["kv_slots_free"] == 256


def test_loop_answers_every_request_when_a_step_fails_and_one_cannot_be_finished_cleanly():
    # A failed step aborts every request in flight; one whose KV release fails too must still get its
    # final output (before, it was dropped from the queues unanswered and its caller waited forever).
    options = EngineOptions.from_kwargs({"device": "cpu"})
    sched = Scheduler(FakeRunner(256, options.max_running_requests), options, StubTokenizer(), [EOS])
    release = sched.queues.memory.release

    def failing_step() -> None:
        raise RuntimeError("injected step failure")

    def release_but_q0(req: Req) -> None:
        if req.rid == "q0":
            raise RuntimeError("injected release failure")
        release(req)

    sched.step = failing_step
    sched.queues.memory.release = release_but_q0
    for i in range(3):
        sched.inbox.put(GenerateRequest(f"q{i}", [1, 2, 3], SamplingParams.from_dict({"max_new_tokens": 4})))
    thread = threading.Thread(target=sched.run_forever)
    thread.start()
    finals: dict[str, GenerateOutput] = {}
    try:
        while len(finals) < 3:
            out = sched.outbox.get(timeout=30)  # queue.Empty: a request was never answered
            if isinstance(out, GenerateOutput) and out.finish is not None:
                finals[out.rid] = out
    finally:
        sched.stop()
        thread.join(10)
    assert sorted(finals) == ["q0", "q1", "q2"]
    assert all(f.finish.type == "abort" and f.finish.status_code == 500 for f in finals.values())
    assert not sched.queues.live and not sched.queues.busy()

@pytest.mark.parametrize("overlap", [False, True], ids=["overlap_off", "overlap_on"])
def test_a_failed_prefill_step_answers_its_requests_and_frees_their_kv(monkeypatch, overlap):
    """The model fails in a prefill step that admits requests while others decode: the requests it was
    admitting (out of the waiting queue, not yet running) are aborted with the rest, and no KV leaks."""
    forward, failed = FakeRunner.forward, []

    def failing(self, batch):
        if not batch.is_decode and self.steps and not failed:
            failed.append(len(batch.rows))
            raise RuntimeError("injected forward failure")
        return forward(self, batch)

    monkeypatch.setattr(FakeRunner, "forward", failing)
    prompts = prompts_with_shared_prefixes(6)
    params = [{"max_new_tokens": 30, "ignore_eos": True}] * 6
    sched, finals = run_scheduler(256, prompts, params, max_running_requests=2, enable_overlap_schedule=overlap)
    aborted = [out for out in finals if out.finish.type == "abort"]
    assert failed and len(aborted) >= failed[0] and all(out.finish.status_code == 500 for out in aborted)
    assert all(out.output_ids == oracle(p, 30, ignore_eos=True) for out, p in zip(finals, prompts) if out not in aborted)
    assert sched.flush_cache() and sched.get_stats()["kv_slots_free"] == 256


def load_bench_scheduler():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_scheduler.py"
    spec = importlib.util.spec_from_file_location("bench_scheduler", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_bench_scheduler_runs_one_step_per_token():
    """benchmarks/bench_scheduler.py (the scheduler's host cost) at a tiny size: one prefill step, then
    one decode step per further token."""
    bench = load_bench_scheduler()
    elapsed, cpu, steps, busy, deferred = bench.run_once(batch=3, prompt_len=5, new_tokens=4, seed=0)
    assert steps == 4 and elapsed > 0 and cpu > 0 and busy == [] and deferred == 0
    # 300 one-token requests, 8 at a time: one step each 8; those leaving 256+ waiting are timed (all
    # but the first, which has no step before it).
    _, _, steps, busy, _ = bench.run_once(batch=300, prompt_len=8, new_tokens=1, seed=0, max_running=8,
                                          shared_prefixes=4)
    assert steps == 38 and len(busy) == (300 - 256) // 8 - 1
