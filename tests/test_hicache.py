"""The radix cache's host tier (core/runtime/memory/hicache.py, radix_cache.py): write-back on eviction, load on a
hit, the host LRU, loads in flight, and the two-tier slot invariant under random operation sequences.

The oracle for the KV itself: every token's KV is a function of the token sequence up to it (what a
model computes), written when a request "computes" it; whatever a match returns must hold exactly that,
however often it went to host memory and back.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixlm.core.runtime.memory.hicache import HostKVPool, HostTier, tier_stats
from radixlm.core.runtime.memory.memory_pool import KVPool, SlotAllocator
from radixlm.core.runtime.memory.radix_cache import RadixCache, TreeNode
from radixlm.core.errors import InvalidRequestError

LAYERS, HEADS, HEAD_DIM = 2, 1, 2


def kv_of(prefix: list[int]) -> float:
    """The 'KV' a model computes for the last token of `prefix` (exact in float32)."""
    h = 7
    for t in prefix:
        h = (h * 31 + t + 1) % 1_000_003
    return float(h)


class Setup:
    def __init__(self, device_slots: int, host_slots: int, write_through: bool = False) -> None:
        self.pool = KVPool(device_slots, LAYERS, HEADS, HEAD_DIM, torch.float32, "cpu")
        self.alloc = SlotAllocator(device_slots)
        self.tier = HostTier(self.pool, HostKVPool(host_slots, self.pool, pin=False))
        self.cache = RadixCache(self.alloc, host=self.tier, write_through=write_through)

    def compute(self, tokens: list[int], slots: list[int], start: int = 0) -> None:
        """Writes the KV of tokens[start:] into slots[start:], as a forward pass would."""
        for i in range(start, len(tokens)):
            v = kv_of(tokens[: i + 1])
            self.pool.kv[0, :, slots[i]] = v
            self.pool.kv[1, :, slots[i]] = -v

    def assert_holds(self, tokens: list[int], slots: list[int]) -> None:
        for i, slot in enumerate(slots):
            v = kv_of(tokens[: i + 1])
            assert torch.all(self.pool.kv[0, :, slot] == v) and torch.all(self.pool.kv[1, :, slot] == -v), (
                f"slot {slot} of position {i} lost its KV")

    def cache_new(self, tokens: list[int]) -> None:
        """A request that matched nothing computes `tokens` and finishes."""
        slots = self.alloc.alloc(len(tokens))
        if slots is None:
            self.cache.evict(len(tokens) - self.alloc.available())
            slots = self.alloc.alloc(len(tokens))
        assert slots is not None
        self.compute(tokens, slots)
        self.cache.cache_finished(tokens, slots, 0, self.cache.root)


class Landing:
    """Stands for a CUDA event: a load stays in flight until the test lands it."""

    def __init__(self) -> None:
        self.landed = False

    def query(self) -> bool:
        return self.landed

    def synchronize(self) -> None:
        self.landed = True


def deferred(tier: HostTier) -> list[Landing]:
    """Makes the tier's loads complete only when landed (returns the list of their landings)."""
    landings: list[Landing] = []
    real_load = tier.load

    def load(host_slots: list[int], dev_slots: list[int]):
        loaded = real_load(host_slots, dev_slots)
        loaded.event = Landing()
        landings.append(loaded.event)
        return loaded

    tier.load = load  # type: ignore[method-assign]
    return landings


def test_eviction_writes_back_and_a_hit_loads_back_the_same_kv():
    s = Setup(device_slots=8, host_slots=16)
    a, b = [1, 2, 3, 4, 5, 6], [9, 8, 7, 6, 5, 4]
    s.cache_new(a)
    s.cache_new(b)  # evicts a (needs 6 slots, 2 free): written back, not dropped
    s.cache.check_invariants(set())
    assert s.cache.match_prefix(a)[0] == []  # not on the device any more
    assert s.tier.stats.hicache_writes_total == 1
    assert s.tier.stats.hicache_bytes_to_host_total == 6 * s.tier.host.bytes_per_token
    assert s.cache.load_prefix(a[:5])  # loads the first 5 tokens (the request computes the last)
    slots, node = s.cache.match_prefix(a[:5])
    assert len(slots) == 5 and node.host_value is not None  # on both tiers now
    s.assert_holds(a, slots)
    st_ = s.tier.stats
    assert st_.hicache_loads_total == 1 and st_.hicache_host_hit_tokens_total == 5
    assert st_.hicache_bytes_to_device_total == 5 * s.tier.host.bytes_per_token
    s.cache.check_invariants(set())
    stats = tier_stats(s.tier, cached_tokens_total=12)
    assert stats["hicache_device_hit_tokens_total"] == 7 and stats["hicache_slots_total"] == 16


def test_a_node_on_both_tiers_is_evicted_without_a_copy_and_host_lru_drops_the_oldest():
    s = Setup(device_slots=6, host_slots=8)
    a, b, c = [1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3]
    s.cache_new(a)
    s.cache_new(b)  # a -> host
    assert s.cache.load_prefix(a)  # a back on the device (b -> host), and still on the host
    writes = s.tier.stats.hicache_writes_total
    s.cache_new(c)  # evicts a again: it has a host copy, so nothing is copied
    assert s.tier.stats.hicache_writes_total == writes
    s.cache.check_invariants(set())
    # The host holds a and b (8 slots, full); c's eviction must drop the least recently used (b).
    s.cache_new([4, 4, 4, 4])
    assert s.cache.root.children.get(2) is None and s.cache.root.children[1].host_value is not None
    s.cache.check_invariants(set())


def test_write_through_copies_on_insert_and_eviction_copies_nothing():
    s = Setup(device_slots=8, host_slots=16, write_through=True)
    a, b = [1, 2, 3, 4, 5, 6], [9, 8, 7, 6, 5, 4]
    s.cache_new(a)
    assert s.tier.stats.hicache_writes_total == 1 and s.cache.root.children[1].host_value is not None
    s.cache_new(b)  # evicts a, which is already on the host
    assert s.tier.stats.hicache_writes_total == 2
    assert s.cache.load_prefix(a)
    s.assert_holds(a, s.cache.match_prefix(a)[0])
    s.cache.check_invariants(set())


def test_without_host_room_eviction_drops_as_before():
    s = Setup(device_slots=4, host_slots=2)
    s.cache_new([1, 2, 3, 4])
    s.cache_new([5, 6, 7, 8])  # 4 tokens do not fit in 2 host slots: dropped
    assert 1 not in s.cache.root.children and s.tier.stats.hicache_writes_total == 0
    s.cache.check_invariants(set())


def test_insert_takes_fresh_device_slots_for_a_host_only_node():
    s = Setup(device_slots=16, host_slots=8)
    a = [1, 2, 3, 4]
    s.cache_new(a)
    s.cache_new([5, 6, 7, 8, 9, 10])
    assert s.cache.evict(1) == 4  # a (least recently used) -> host
    # A request that recomputed a plus one more token (as if it had not loaded): the tree keeps its KV.
    slots = s.alloc.alloc(5)
    s.compute(a + [11], slots)
    present = s.cache.insert(a + [11], slots)
    assert present == 0  # nothing of it was on the device: the tree owns all five slots now
    got, _ = s.cache.match_prefix(a + [11])
    assert got == slots
    s.cache.check_invariants(set())


def test_a_load_in_flight_is_not_matched_until_it_lands():
    s = Setup(device_slots=8, host_slots=8)
    landings = deferred(s.tier)
    a = [1, 2, 3, 4]
    s.cache_new(a)
    s.cache_new([5, 6, 7, 8, 9, 10])  # a -> host
    assert not s.cache.load_prefix(a)  # issued, in flight
    assert not s.cache.load_prefix(a)  # still in flight: not issued twice
    assert len(landings) == 1
    assert s.cache.match_prefix(a)[0] == []
    s.cache.check_invariants(set())
    assert s.cache.evict(8) == 0  # the loading nodes are locked (the other prefix made room for them)
    landings[0].landed = True
    assert s.cache.load_prefix(a)
    slots, _ = s.cache.match_prefix(a)
    s.assert_holds(a, slots)
    s.cache.check_invariants(set())
    assert s.cache.wait_for_load() is False


def test_the_planner_admits_a_request_once_its_prefix_has_landed():
    """The scheduler's hook: a request whose prefix is loading waits in the queue (the others are
    planned meanwhile), and is planned with the whole prefix cached once the load has landed."""
    from test_scheduler_units import make_planner, make_req

    from radixlm.core.runtime.memory.memory_pool import ReqToTokenPool
    from radixlm.core.runtime.scheduler.memory import KVMemory

    s = Setup(device_slots=16, host_slots=16)
    landings = deferred(s.tier)
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    s.cache_new(a)
    assert s.cache.evict(1) == 8  # a -> host
    planner = make_planner(KVMemory(s.alloc, s.cache, ReqToTokenPool(9, 64, "cpu")))
    returning, other = make_req(a + [9], 0), make_req([20, 21, 22], 1)
    plan = planner.plan([returning, other], [], None)
    assert [e.req for e in plan.extends] == [other] and plan.passed_over == [returning]
    assert len(landings) == 1 and returning.row is None
    assert not planner.plan([returning], [other], None).extends  # still in flight
    landings[0].landed = True
    (ext,) = planner.plan([returning], [other], None).extends
    assert ext.req is returning and returning.cached_len == 8 and (ext.start, ext.length) == (8, 1)
    s.assert_holds(a, returning.slots[:8])
    s.cache.check_invariants(set(returning.slots[8:] + other.slots))


def test_reset_waits_for_loads_and_frees_both_tiers():
    s = Setup(device_slots=8, host_slots=8)
    deferred(s.tier)
    s.cache_new([1, 2, 3, 4])
    s.cache_new([5, 6, 7, 8, 9, 10])
    assert not s.cache.load_prefix([1, 2, 3, 4])
    s.cache.reset()
    assert s.alloc.available() == 8 and s.tier.allocator.available() == 8
    s.cache.check_invariants(set())


def test_check_invariants_catches_a_leaked_host_slot():
    s = Setup(device_slots=8, host_slots=8)
    s.tier.allocator.alloc(1)
    with pytest.raises(AssertionError, match="leaked"):
        s.cache.check_invariants(set())


@pytest.mark.parametrize("kwargs, message", [
    ({"hicache_size_gb": -1}, ">= 0"),
    ({"hicache_size_gb": 1, "tp_size": 2}, "tp_size"),
    ({"hicache_size_gb": 1, "disable_radix_cache": True}, "disable_radix_cache"),
    ({"hicache_size_gb": 1, "hicache_write_policy": "sometimes"}, "write_back"),
])
def test_options_are_validated(kwargs, message):
    from radixlm.core.runtime.options import EngineOptions

    with pytest.raises(InvalidRequestError, match=message) as err:
        EngineOptions.from_kwargs({"device": "cpu", **kwargs})
    assert err.value.param in ("hicache_size_gb", "hicache_write_policy")


def test_size_option_is_validated():
    pool = KVPool(4, LAYERS, HEADS, HEAD_DIM, torch.float32, "cpu")
    with pytest.raises(InvalidRequestError, match="holds no token"):
        HostTier.create(1e-12, pool)
    with pytest.raises(InvalidRequestError, match="available memory"):
        HostTier.create(1e9, pool)
    tier = HostTier.create(64 / HostKVPool.slots_for(1, pool), pool)  # 64 tokens' worth of GiB
    assert tier is not None and tier.host.num_slots == 64


# ---- random operation sequences ------------------------------------------------------------

DEVICE_SLOTS, HOST_SLOTS, VOCAB = 24, 20, 3
tokens_st = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10)


@dataclass
class Request:
    tokens: list[int]
    slots: list[int]
    cached_len: int
    last_node: TreeNode


class TieredCacheMachine(RuleBasedStateMachine):
    write_through = False

    def __init__(self) -> None:
        super().__init__()
        self.s = Setup(DEVICE_SLOTS, HOST_SLOTS, self.write_through)
        self.cache = self.s.cache
        self.landings = deferred(self.s.tier)
        self.reqs: dict[int, Request] = {}
        self.next_id = 0

    def alloc_or_evict(self, n: int) -> list[int] | None:
        slots = self.s.alloc.alloc(n)
        if slots is None:
            self.cache.evict(n - self.s.alloc.available())
            slots = self.s.alloc.alloc(n)
        return slots

    def pick(self, data: st.DataObject) -> int:
        return data.draw(st.sampled_from(sorted(self.reqs)), label="request")

    @precondition(lambda self: len(self.reqs) < 6)
    @rule(tokens=tokens_st, wait=st.booleans())
    def start(self, tokens: list[int], wait: bool) -> None:
        """Admission as the scheduler does it: only once the prefix is loaded (or waits for it)."""
        if not self.cache.load_prefix(tokens):
            event("prefix in flight")
            if not wait:
                return
            self.cache.wait_for_load()
            if not self.cache.load_prefix(tokens):
                return
        prefix, node = self.cache.match_prefix(tokens)
        assert all(n.ready for n in _path(node))
        self.s.assert_holds(tokens, prefix)
        self.cache.inc_lock_ref(node)
        own = self.alloc_or_evict(len(tokens) - len(prefix))
        if own is None:
            event("request did not fit")
            self.cache.dec_lock_ref(node)
            return
        slots = prefix + own
        self.s.compute(tokens, slots, start=len(prefix))
        self.reqs[self.next_id] = Request(list(tokens), slots, len(prefix), node)
        self.next_id += 1

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), token=st.integers(0, VOCAB - 1))
    def decode(self, data: st.DataObject, token: int) -> None:
        req = self.reqs[self.pick(data)]
        slot = self.alloc_or_evict(1)
        if slot is not None:
            req.tokens.append(token)
            req.slots += slot
            self.s.compute(req.tokens, req.slots, start=len(req.tokens) - 1)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def chunk(self, data: st.DataObject) -> None:
        req = self.reqs[self.pick(data)]
        k = data.draw(st.integers(req.cached_len, len(req.tokens)), label="chunk end")
        row, node = self.cache.cache_unfinished(req.tokens[:k], req.slots[:k], req.cached_len, req.last_node)
        assert len(row) == k
        self.s.assert_holds(req.tokens, row)
        req.slots, req.cached_len, req.last_node = row + req.slots[k:], k, node

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        req = self.reqs.pop(self.pick(data))
        self.cache.cache_finished(req.tokens, req.slots, req.cached_len, req.last_node)

    @rule(n=st.integers(1, 30))
    def evict(self, n: int) -> None:
        self.cache.evict(n)

    @rule(n=st.integers(1, 30))
    def evict_host(self, n: int) -> None:
        self.cache.evict_host(n)

    @precondition(lambda self: any(not x.landed for x in self.landings))
    @rule(data=st.data())
    def land(self, data: st.DataObject) -> None:
        pending = [x for x in self.landings if not x.landed]
        data.draw(st.sampled_from(pending), label="load").landed = True
        self.cache.poll()

    @rule(key=tokens_st)
    def match(self, key: list[int]) -> None:
        slots, node = self.cache.match_prefix(key)
        self.s.assert_holds(key, slots)

    @invariant()
    def consistent(self) -> None:
        owned = {s for r in self.reqs.values() for s in r.slots[r.cached_len :]}
        self.cache.check_invariants(owned)
        for r in self.reqs.values():
            self.s.assert_holds(r.tokens, r.slots)

    def teardown(self) -> None:
        for req in self.reqs.values():
            self.cache.cache_finished(req.tokens, req.slots, req.cached_len, req.last_node)
        self.cache.reset()
        assert self.s.alloc.available() == DEVICE_SLOTS and self.s.tier.allocator.available() == HOST_SLOTS


def _path(node: TreeNode) -> list[TreeNode]:
    out = []
    while node.parent is not None:
        out.append(node)
        node = node.parent
    return out


class WriteThroughMachine(TieredCacheMachine):
    write_through = True


for machine in (TieredCacheMachine, WriteThroughMachine):
    machine.TestCase.settings = settings(
        max_examples=80, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
test_tiered_cache_stateful = TieredCacheMachine.TestCase
test_tiered_cache_stateful_write_through = WriteThroughMachine.TestCase


# ---- the engine with the tier on and off -----------------------------------------------------


def test_engine_greedy_outputs_are_the_same_with_the_host_tier(llama_ckpt):
    """Returning users whose prefixes (~3x the device pool) spill to host memory and come back: the same
    greedy tokens as with the tier off, with fewer tokens computed."""
    import radixlm

    users = [[(u * 37 + i * 11) % 200 + 3 for i in range(60)] for u in range(8)]  # 8 x 60-token histories
    rounds = [[h + [250 + r] * 4 for h in users] for r in range(2)]
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    results = {}
    for size_gb, policy in ((0.0, "write_back"), (0.001, "write_back"), (0.001, "write_through")):
        with radixlm.Engine(llama_ckpt, max_total_tokens=160, hicache_size_gb=size_gb, hicache_write_policy=policy,
                            debug_check_invariants=True) as engine:
            outs = [o["output_ids"] for r in rounds for o in engine.generate(input_ids=r, sampling_params=params)]
            results[size_gb, policy] = outs, engine.get_stats()
            assert engine.flush_cache()
            after = engine.get_stats()
            assert after["kv_slots_free"] == after["kv_slots_total"]
            assert after["hicache_slots_free"] == after["hicache_slots_total"]
    (off, off_stats), (on, on_stats) = results[0.0, "write_back"], results[0.001, "write_back"]
    through, through_stats = results[0.001, "write_through"]
    assert on == off and through == off
    assert through_stats["hicache_host_hit_tokens_total"] > 0
    assert through_stats["hicache_writes_total"] > on_stats["hicache_writes_total"]  # every new node, evicted or not
    assert off_stats["hicache_host_hit_tokens_total"] == 0 and off_stats["hicache_slots_total"] == 0
    assert on_stats["hicache_host_hit_tokens_total"] > 0 and on_stats["hicache_bytes_to_host_total"] > 0
    assert on_stats["hicache_bytes_to_device_total"] > 0 and on_stats["hicache_loads_total"] > 0
    assert on_stats["prefill_tokens_total"] < off_stats["prefill_tokens_total"]
    assert (on_stats["hicache_device_hit_tokens_total"] + on_stats["hicache_host_hit_tokens_total"]
            == on_stats["cached_tokens_total"])
    # /metrics, read back with prometheus_client's parser
    from prometheus_client.parser import text_string_to_metric_families

    from radixlm.server.metrics import Metrics

    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(Metrics("m").render(on_stats).decode()) for s in f.samples}
    m = ("model_name", "m")
    assert samples["radixlm:cache_hit_tokens_total", (m, ("tier", "host"))] == on_stats["hicache_host_hit_tokens_total"]
    assert samples["radixlm:cache_hit_tokens_total", (m, ("tier", "device"))] == on_stats[
        "hicache_device_hit_tokens_total"]
    assert samples["radixlm:hicache_transfer_bytes_total", (("direction", "to_device"), m)] == on_stats[
        "hicache_bytes_to_device_total"]
    assert samples["radixlm:hicache_load_wait_seconds_total", (m,)] == on_stats["hicache_load_wait_s"]
    assert samples["radixlm:hicache_max_total_num_tokens", (m,)] == on_stats["hicache_slots_total"]
    off_text = Metrics("m").render(off_stats).decode()
    assert "hicache" not in off_text and "cache_hit_tokens" not in off_text
