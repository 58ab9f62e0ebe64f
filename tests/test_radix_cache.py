"""Radix KV cache: unit tests, and a stateful test that drives random request lifecycles against an
independent model (a dict from every cached token prefix to the slot of its last token)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixlm.core.runtime.memory.memory_pool import SlotAllocator
from radixlm.core.runtime.memory.radix_cache import RadixCache, TreeNode


def path_key(node: TreeNode) -> list[int]:
    """The token sequence spelled from the root down to `node`."""
    parts = []
    while node.parent is not None:
        parts.append(node.key)
        node = node.parent
    return [t for part in reversed(parts) for t in part]


def tree_contents(cache: RadixCache) -> dict[tuple[int, ...], int]:
    """Every cached prefix -> slot of its last token, read from the tree without touching it."""
    out: dict[tuple[int, ...], int] = {}
    stack = [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            p = prefix
            for tok, slot in zip(child.key, child.value):
                p = p + (tok,)
                out[p] = slot
            stack.append((child, p))
    return out


def unlocked_leaves(cache: RadixCache) -> list[TreeNode]:
    out, stack = [], [cache.root]
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if node is not cache.root and not node.children and node.lock_ref == 0:
            out.append(node)
    return out


def new_cache(num_slots: int = 32, disable: bool = False) -> tuple[SlotAllocator, RadixCache]:
    alloc = SlotAllocator(num_slots)
    return alloc, RadixCache(alloc, disable=disable)


def insert_fresh(alloc: SlotAllocator, cache: RadixCache, key: list[int]) -> list[int]:
    """Allocate slots for `key` and cache it as a finished request would (freeing the slots of any
    part already cached); returns the tree's slots for `key`."""
    slots = alloc.alloc(len(key))
    assert slots is not None
    present = cache.insert(key, slots)
    alloc.free(slots[:present])
    contents = tree_contents(cache)
    return [contents[tuple(key[: i + 1])] for i in range(len(key))]


# ---- match / insert / split ----------------------------------------------------------------


def test_empty_cache_and_empty_key():
    alloc, cache = new_cache()
    assert cache.match_prefix([1, 2, 3]) == ([], cache.root)
    assert cache.match_prefix([]) == ([], cache.root)
    assert cache.insert([], []) == 0
    insert_fresh(alloc, cache, [1, 2])
    assert cache.match_prefix([]) == ([], cache.root)
    assert cache.total_size() == 2
    cache.check_invariants(set())


def test_match_splits_node_so_returned_node_covers_exactly_the_prefix():
    alloc, cache = new_cache()
    slots = insert_fresh(alloc, cache, [1, 2, 3, 4])
    matched, node = cache.match_prefix([1, 2, 9])
    assert matched == slots[:2]
    assert node.key == [1, 2] and node.value == slots[:2]
    assert path_key(node) == [1, 2]
    (lower,) = node.children.values()
    assert lower.key == [3, 4] and lower.value == slots[2:] and lower.parent is node
    # Longer than what is cached: the whole cached sequence, ending at the leaf.
    matched, leaf = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert matched == slots and leaf is lower
    assert cache.total_size() == 4
    cache.check_invariants(set())


def test_insert_returns_already_present_length_and_keeps_tree_slots():
    alloc, cache = new_cache()
    first = insert_fresh(alloc, cache, [1, 2, 3])
    second = alloc.alloc(4)
    assert cache.insert([1, 2, 4, 5], second) == 2
    # The tree kept its own slots for [1, 2]; the caller still owns second[:2].
    alloc.free(second[:2])
    assert cache.match_prefix([1, 2, 4, 5])[0] == first[:2] + second[2:]
    assert cache.match_prefix([1, 2, 3])[0] == first
    dup = alloc.alloc(3)
    assert cache.insert([1, 2, 3], dup) == 3
    alloc.free(dup)
    # A key ending inside an edge splits it and counts the whole key as present.
    dup = alloc.alloc(1)
    assert cache.insert([1], dup) == 1
    alloc.free(dup)
    assert tree_contents(cache) == {
        (1,): first[0], (1, 2): first[1], (1, 2, 3): first[2],
        (1, 2, 4): second[2], (1, 2, 4, 5): second[3],
    }
    assert cache.total_size() == cache.evictable_size() == 5
    cache.check_invariants(set())


def test_insert_rejects_mismatched_lengths():
    _, cache = new_cache()
    with pytest.raises(ValueError):
        cache.insert([1, 2], [5])


# ---- eviction ------------------------------------------------------------------------------


def test_eviction_is_lru_among_leaves():
    alloc, cache = new_cache()
    a = insert_fresh(alloc, cache, [0, 0])
    b = insert_fresh(alloc, cache, [1, 1])
    c = insert_fresh(alloc, cache, [2, 2])
    cache.match_prefix([0, 0])  # a becomes the most recently used
    assert cache.evict(2) == 2
    assert set(b) <= alloc.free_set() and not (set(a) | set(c)) & alloc.free_set()
    assert cache.evict(1) == 2  # whole nodes go: c, the next oldest
    assert set(tree_contents(cache)) == {(0,), (0, 0)}
    assert cache.evict(100) == 2
    assert cache.evict(5) == 0
    assert alloc.available() == 32 and cache.total_size() == 0
    cache.check_invariants(set())


def test_insert_counts_as_use_for_lru():
    alloc, cache = new_cache()
    a = insert_fresh(alloc, cache, [0, 0])
    b = insert_fresh(alloc, cache, [1, 1])
    insert_fresh(alloc, cache, [0, 0])  # a finished request re-caches a: it is now the newest
    assert cache.evict(1) == 2
    assert set(b) <= alloc.free_set() and tree_contents(cache) == {(0,): a[0], (0, 0): a[1]}


def test_parent_becomes_leaf_when_its_last_child_is_evicted():
    alloc, cache = new_cache()
    insert_fresh(alloc, cache, [0, 1])
    insert_fresh(alloc, cache, [0, 2])  # splits [0, 1] into [0] -> {[1], [2]}
    insert_fresh(alloc, cache, [1])
    assert cache.evict(1) == 1  # leaf [0]->[1] is the oldest
    assert set(tree_contents(cache)) == {(0,), (0, 2), (1,)}
    # [0]->[2] goes, then its parent [0] (older than [1]) is a leaf and goes next.
    assert cache.evict(2) == 2
    assert set(tree_contents(cache)) == {(1,)}
    cache.check_invariants(set())


def test_locked_nodes_are_never_evicted():
    alloc, cache = new_cache()
    a = insert_fresh(alloc, cache, [0, 0, 0])
    insert_fresh(alloc, cache, [0, 1])
    insert_fresh(alloc, cache, [2])
    _, node = cache.match_prefix([0, 0, 0])
    cache.inc_lock_ref(node)
    assert cache.evict(100) == 2  # [0]->[1] and [2]; [0] is locked through [0,0,0]
    assert tree_contents(cache) == {(0,): a[0], (0, 0): a[1], (0, 0, 0): a[2]}
    assert cache.evictable_size() == 0 and cache.protected_size() == 3
    cache.dec_lock_ref(node)
    assert cache.evict(100) == 3
    assert alloc.available() == 32
    cache.check_invariants(set())


def test_sizes_after_lock_and_unlock():
    alloc, cache = new_cache()
    insert_fresh(alloc, cache, [1, 2, 3, 4])
    insert_fresh(alloc, cache, [1, 2, 5])
    assert (cache.evictable_size(), cache.protected_size()) == (5, 0)
    _, deep = cache.match_prefix([1, 2, 3, 4])
    _, shallow = cache.match_prefix([1, 2])
    cache.inc_lock_ref(deep)
    assert (cache.evictable_size(), cache.protected_size()) == (1, 4)
    cache.inc_lock_ref(shallow)
    assert (cache.evictable_size(), cache.protected_size()) == (1, 4)
    assert shallow.lock_ref == 2 and deep.lock_ref == 1
    cache.check_invariants(set())
    cache.dec_lock_ref(deep)
    assert (cache.evictable_size(), cache.protected_size()) == (3, 2)
    cache.dec_lock_ref(shallow)
    assert (cache.evictable_size(), cache.protected_size()) == (5, 0)
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(shallow)
    cache.check_invariants(set())


def test_split_of_a_locked_node_keeps_locks_consistent():
    alloc, cache = new_cache()
    insert_fresh(alloc, cache, [1, 2, 3, 4])
    _, node = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(node)
    _, upper = cache.match_prefix([1, 2])  # splits the locked node
    assert upper.lock_ref == 1 and node.lock_ref == 1 and node.parent is upper
    assert upper.last_access <= node.last_access
    assert cache.protected_size() == 4
    cache.check_invariants(set())
    cache.dec_lock_ref(node)  # the lock taken before the split releases the whole path
    assert upper.lock_ref == 0 and cache.evictable_size() == 4
    cache.check_invariants(set())


# ---- request lifecycle ---------------------------------------------------------------------


def test_cache_finished_frees_duplicates_and_nothing_leaks():
    alloc, cache = new_cache(16)
    # Two requests with the same prompt start before either is cached: both allocate it all.
    reqs = []
    for _ in range(2):
        prefix, node = cache.match_prefix([5, 6, 7])
        assert prefix == [] and node is cache.root
        cache.inc_lock_ref(node)
        reqs.append((alloc.alloc(3), node))
    (a_slots, a_node), (b_slots, b_node) = reqs
    cache.check_invariants(set(a_slots) | set(b_slots))
    cache.cache_finished([5, 6, 7], a_slots, 0, a_node)
    cache.cache_finished([5, 6, 7], b_slots, 0, b_node)  # all duplicates: freed
    assert tree_contents(cache) == dict(zip([(5,), (5, 6), (5, 6, 7)], a_slots))
    assert alloc.available() == 13
    cache.check_invariants(set())

    # A request reusing two cached tokens, extended by decoding.
    prefix, node = cache.match_prefix([5, 6, 8])
    assert prefix == a_slots[:2]
    cache.inc_lock_ref(node)
    own = alloc.alloc(3)
    assert cache.protected_size() == 2
    cache.check_invariants(set(own))
    cache.cache_finished([5, 6, 8, 9, 9], prefix + own, 2, node)
    assert cache.protected_size() == 0 and cache.total_size() == 6
    assert alloc.available() == 10
    cache.check_invariants(set())
    cache.reset()
    assert alloc.available() == 16 and cache.total_size() == 0
    assert cache.match_prefix([5, 6]) == ([], cache.root)
    cache.check_invariants(set())


def test_cache_unfinished_moves_the_lock_and_swaps_in_tree_slots():
    alloc, cache = new_cache(16)
    tokens = [1, 2, 3, 4, 5, 6]
    slots = alloc.alloc(6)
    # First chunk of a chunked prefill: nothing cached yet, so its own slots are kept.
    row, node = cache.cache_unfinished(tokens[:3], slots[:3], 0, cache.root)
    assert row == slots[:3] and path_key(node) == [1, 2, 3] and node.lock_ref == 1
    assert cache.protected_size() == 3
    cache.check_invariants(set(slots[3:]))

    # Meanwhile another request caches [1, 2, 3, 4, 5]: it reuses [1, 2, 3] and adds two slots.
    other_prefix, other_node = cache.match_prefix([1, 2, 3, 4, 5])
    cache.inc_lock_ref(other_node)
    other_own = alloc.alloc(2)
    cache.cache_finished([1, 2, 3, 4, 5], other_prefix + other_own, 3, other_node)
    cache.check_invariants(set(slots[3:]))

    # Second chunk: slots[3:5] are now duplicates, freed; the tree's slots replace them.
    row, new_node = cache.cache_unfinished(tokens, row + slots[3:], 3, node)
    assert row == slots[:3] + other_own + slots[5:]
    assert path_key(new_node) == tokens and new_node.lock_ref == 1 and node.lock_ref == 1
    assert set(slots[3:5]) <= alloc.free_set()
    assert cache.protected_size() == 6 and cache.evictable_size() == 0
    cache.check_invariants(set())

    cache.cache_finished(tokens, row, 6, new_node)
    assert cache.protected_size() == 0 and cache.total_size() == 6
    cache.reset()
    assert alloc.available() == 16


def test_reset_while_locked_raises():
    alloc, cache = new_cache()
    insert_fresh(alloc, cache, [1, 2])
    _, node = cache.match_prefix([1, 2])
    cache.inc_lock_ref(node)
    with pytest.raises(RuntimeError):
        cache.reset()
    assert cache.total_size() == 2  # nothing was dropped
    cache.check_invariants(set())
    cache.dec_lock_ref(node)
    cache.reset()
    assert alloc.available() == 32


def test_disable_mode_caches_nothing():
    alloc, cache = new_cache(8, disable=True)
    slots = alloc.alloc(3)
    assert cache.insert([1, 2, 3], slots) == 0
    assert alloc.available() == 5  # insert frees nothing: the caller does
    assert cache.match_prefix([1, 2, 3]) == ([], cache.root)
    assert (cache.evictable_size(), cache.protected_size(), cache.total_size()) == (0, 0, 0)
    assert cache.evict(10) == 0
    cache.check_invariants(set(slots))
    assert cache.cache_unfinished([1, 2, 3], slots, 0, cache.root) == (slots, cache.root)
    cache.check_invariants(set(slots))
    cache.cache_finished([1, 2, 3], slots, 0, cache.root)
    assert alloc.available() == 8
    cache.check_invariants(set())
    cache.reset()
    assert alloc.available() == 8


def test_check_invariants_catches_broken_states():
    alloc, cache = new_cache(8)
    slots = insert_fresh(alloc, cache, [1, 2])
    cache.check_invariants(set())
    with pytest.raises(AssertionError, match="both"):
        cache.check_invariants({slots[0]})
    leaked = alloc.alloc(1)
    with pytest.raises(AssertionError, match=rf"\[{leaked[0]}\].*leaked"):
        cache.check_invariants(set())
    alloc.free(leaked)
    alloc.free(leaked)
    with pytest.raises(AssertionError, match="repeats"):
        cache.check_invariants(set())
    alloc.alloc(1)
    cache.check_invariants(set())
    cache._evictable_size += 1
    with pytest.raises(AssertionError, match="evictable_size"):
        cache.check_invariants(set())
    cache._evictable_size -= 1
    _, node = cache.match_prefix([1, 2])
    node.lock_ref += 1
    with pytest.raises(AssertionError, match="lock_ref"):
        cache.check_invariants(set())


def test_evict_scales_to_many_leaves():
    # Ten thousand single-token leaves under distinct first tokens, evicted all at once.
    n = 10_000
    alloc, cache = new_cache(n)
    for tok in range(n):
        assert cache.insert([tok], alloc.alloc(1)) == 0
    assert cache.evict(n) == n
    assert alloc.available() == n


def test_docs_example_runs():
    doc = Path(__file__).resolve().parent.parent / "docs" / "radix_cache.md"
    (code,) = re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)
    exec(compile(code, str(doc), "exec"), {})


# ---- stateful: random request lifecycles against a dict model ------------------------------

NUM_SLOTS = 32
VOCAB = 3
tokens_st = st.lists(st.integers(0, VOCAB - 1), max_size=12)


@dataclass
class Request:
    tokens: list[int]
    slots: list[int]  # slots[:cached_len] come from the tree; the rest the request owns
    cached_len: int
    last_node: TreeNode


class RadixCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.alloc = SlotAllocator(NUM_SLOTS)
        self.cache = RadixCache(self.alloc)
        self.model: dict[tuple[int, ...], int] = {}
        self.reqs: dict[int, Request] = {}
        self.next_id = 0

    # The model: longest cached prefix, and insertion that reports the already-present length.
    def model_match(self, key: list[int]) -> list[int]:
        out = []
        while len(out) < len(key) and tuple(key[: len(out) + 1]) in self.model:
            out.append(self.model[tuple(key[: len(out) + 1])])
        return out

    def model_insert(self, key: list[int], value: list[int]) -> int:
        present = len(self.model_match(key))
        for i in range(present, len(key)):
            self.model[tuple(key[: i + 1])] = value[i]
        return present

    def check_match(self, key: list[int]) -> tuple[list[int], TreeNode]:
        slots, node = self.cache.match_prefix(key)
        assert slots == self.model_match(key)
        assert path_key(node) == key[: len(slots)]
        return slots, node

    def evict(self, n: int) -> None:
        before = self.alloc.free_set()
        evictable = self.cache.evictable_size()
        leaves = unlocked_leaves(self.cache)
        freed = self.cache.evict(n)
        newly_free = self.alloc.free_set() - before
        assert freed == len(newly_free)
        assert freed >= n or freed == evictable, "stopped early with evictable tokens left"
        # LRU: every leaf that went was used no later than every leaf that stayed.
        kept = {id(leaf) for leaf in unlocked_leaves(self.cache)}
        gone_times = [leaf.last_access for leaf in leaves if id(leaf) not in kept]
        kept_times = [leaf.last_access for leaf in leaves if id(leaf) in kept]
        if gone_times and kept_times:
            assert max(gone_times) <= min(kept_times)
        self.model = {p: s for p, s in self.model.items() if s not in newly_free}

    def alloc_or_evict(self, n: int) -> list[int] | None:
        slots = self.alloc.alloc(n)
        if slots is None:
            event("allocation needed eviction")
            self.evict(n - self.alloc.available())
            slots = self.alloc.alloc(n)
        return slots

    def pick(self, data: st.DataObject) -> int:
        return data.draw(st.sampled_from(sorted(self.reqs)), label="request")

    @precondition(lambda self: len(self.reqs) < 8)
    @rule(tokens=tokens_st)
    def start(self, tokens: list[int]) -> None:
        prefix, node = self.check_match(tokens)
        self.cache.inc_lock_ref(node)
        own = self.alloc_or_evict(len(tokens) - len(prefix))
        if own is None:  # does not fit even after evicting: the scheduler would not admit it
            event("request did not fit")
            self.cache.dec_lock_ref(node)
            return
        self.reqs[self.next_id] = Request(tokens, prefix + own, len(prefix), node)
        self.next_id += 1

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), token=st.integers(0, VOCAB - 1))
    def decode(self, data: st.DataObject, token: int) -> None:
        req = self.reqs[self.pick(data)]
        slot = self.alloc_or_evict(1)
        if slot is not None:
            req.tokens.append(token)
            req.slots += slot

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def chunk(self, data: st.DataObject) -> None:
        req = self.reqs[self.pick(data)]
        k = data.draw(st.integers(req.cached_len, len(req.tokens)), label="chunk end")
        present = self.model_insert(req.tokens[:k], req.slots[:k])
        duplicates = req.slots[req.cached_len : present]
        event(f"chunk freed duplicates: {bool(duplicates)}")
        row, node = self.cache.cache_unfinished(
            req.tokens[:k], req.slots[:k], req.cached_len, req.last_node
        )
        assert row == self.model_match(req.tokens[:k]) and len(row) == k
        assert path_key(node) == req.tokens[:k]
        assert set(duplicates) <= self.alloc.free_set()
        req.slots = row + req.slots[k:]
        req.cached_len = k
        req.last_node = node

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        req = self.reqs.pop(self.pick(data))
        present = self.model_insert(req.tokens, req.slots)
        event(f"finish freed duplicates: {present > req.cached_len}")
        self.cache.cache_finished(req.tokens, req.slots, req.cached_len, req.last_node)
        assert set(req.slots[req.cached_len : present]) <= self.alloc.free_set()

    @rule(n=st.integers(1, 40))
    def evict_some(self, n: int) -> None:
        self.evict(n)

    @rule(key=tokens_st)
    def match(self, key: list[int]) -> None:
        self.check_match(key)

    @invariant()
    def consistent(self) -> None:
        owned = {s for r in self.reqs.values() for s in r.slots[r.cached_len :]}
        self.cache.check_invariants(owned)
        assert tree_contents(self.cache) == self.model
        cached = set(self.model.values())
        free = self.alloc.free_set()
        assert len(cached) + len(free) + len(owned) == NUM_SLOTS
        assert cached | free | owned == set(range(1, NUM_SLOTS + 1))
        locked = set()
        for r in self.reqs.values():
            assert path_key(r.last_node) == r.tokens[: r.cached_len]
            locked |= {tuple(r.tokens[:i]) for i in range(1, r.cached_len + 1)}
        assert self.cache.protected_size() == len(locked)
        assert self.cache.total_size() == len(self.model)

    def teardown(self) -> None:
        for req in self.reqs.values():
            self.cache.cache_finished(req.tokens, req.slots, req.cached_len, req.last_node)
        self.reqs.clear()
        self.cache.check_invariants(set())
        assert self.cache.protected_size() == 0
        self.cache.reset()
        assert self.alloc.available() == NUM_SLOTS


RadixCacheMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_radix_cache_stateful = RadixCacheMachine.TestCase
