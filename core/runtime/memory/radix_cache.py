"""RadixAttention's KV cache: a radix tree from token-id sequences to the KV slots that hold them.

Every edge of the tree carries a run of tokens (`key`) and the KV slots computed for them (`value`),
so a path from the root spells a token sequence whose KV is already in the pool. Requests reuse the
longest cached prefix of their prompt instead of recomputing it.

Slot ownership, which `check_invariants` verifies: every slot 1..N is exactly one of
  free            in the allocator,
  cached-evictable in a node with lock_ref == 0,
  cached-locked   in a node with lock_ref > 0 (some running request's prefix passes through it),
  owned           by a running request (its positions past the prefix it got from the tree).
A running request holds one lock on the node where its cached prefix ends; `inc_lock_ref` counts it
on that node and every ancestor, so a locked path can never be evicted from under a request.

Eviction frees least-recently-used unlocked leaves, one whole node at a time; a parent whose last
child goes becomes a leaf and a candidate in turn.

With a host tier (hicache.py) a node's KV lives on the device (`value`), in host memory
(`host_value`), or both. Device eviction writes a leaf's KV back to the host instead of dropping it
(the host's own LRU makes room by dropping host copies); `match_prefix` stops where the device part
ends, and `load_prefix` loads the host-only part back into fresh device slots, after which the same
prefix matches in full. Device-resident nodes form a subtree at the root (a node is on the device only
if its parent is), so a prefix is always device part, then host part. While a load is in flight its
nodes hold device slots but are `loading` (locked, and not matched); every host slot is free or held
by exactly one node.
"""

from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING, Callable

from radixlm.core.runtime.memory.memory_pool import SlotAllocator
from radixlm.core.runtime.memory.radix_checks import check_tree, tree_text
from radixlm.core.runtime.memory.token_prefix import shared_len

if TYPE_CHECKING:
    from radixlm.core.runtime.memory.hicache import HostTier, Transfer


class TreeNode:
    """One edge of the tree: `key` tokens whose KV lives in `value` device slots and/or `host_value`
    host slots (each None or as long as `key`).

    `lock_ref` counts the locks placed on this node or any node below it; `own_locks` counts only
    those placed on this node itself, so that lock_ref == own_locks + sum of children's lock_ref.
    """

    def __init__(
        self, key: list[int], value: list[int] | None, parent: TreeNode | None, last_access: int
    ) -> None:
        self.children: dict[int, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value  # None: the KV is in host memory only
        self.host_value: list[int] | None = None
        self.loading: Transfer | None = None  # the load filling `value` from `host_value`, while in flight
        self.lock_ref = 0
        self.own_locks = 0
        self.last_access = last_access

    def __repr__(self) -> str:
        host = "" if self.host_value is None else f", host_value={self.host_value}"
        return (
            f"TreeNode(key={self.key}, value={self.value}{host}, lock_ref={self.lock_ref}, "
            f"last_access={self.last_access}{', loading' if self.loading else ''})"
        )

    @property
    def ready(self) -> bool:
        """Its KV is in device slots a request may read now."""
        return self.value is not None and self.loading is None


class RadixCache:
    """The tree plus its bookkeeping of evictable and locked token counts.

    With `disable=True` nothing is ever cached: matches are empty, inserts keep nothing, and
    finishing a request frees all of its slots. The scheduler runs the same code either way.
    With `host`, evicted KV moves to host memory and comes back on a hit (the module docstring); with
    `write_through` too, every newly cached node is copied to the host at once, so that evicting it
    later copies nothing.
    """

    def __init__(self, allocator: SlotAllocator, disable: bool = False, host: HostTier | None = None,
                 write_through: bool = False) -> None:
        self.allocator = allocator
        self.disable = disable
        self.host = None if disable else host
        self.write_through = write_through and self.host is not None
        self._clock = itertools.count()
        self.root = TreeNode([], [], None, next(self._clock))
        self._evictable_size = 0
        self._protected_size = 0
        self._loads: list[tuple[Transfer, TreeNode]] = []  # loads in flight and the deepest node each fills

    # ---- whole-tree operations -------------------------------------------------------------

    def reset(self) -> None:
        """Drop every cached sequence and return its slots to the allocators."""
        while self.wait_for_load():
            pass
        slots: list[int] = []
        host_slots: list[int] = []
        for node in self.nodes():
            if node.lock_ref > 0:
                raise RuntimeError(f"reset() while a request still holds {node!r}")
            slots.extend(node.value or ())
            host_slots.extend(node.host_value or ())
        self.allocator.free(slots)
        if self.host is not None:
            self.host.synchronize()  # no write-back may land in a slot handed out again
            self.host.allocator.free(host_slots)
        self.root = TreeNode([], [], None, next(self._clock))
        self._evictable_size = 0
        self._protected_size = 0

    def evictable_size(self) -> int:
        return self._evictable_size

    def protected_size(self) -> int:
        return self._protected_size

    def total_size(self) -> int:
        return self._evictable_size + self._protected_size

    # ---- lookup and insertion --------------------------------------------------------------

    def match_prefix(self, key: list[int]) -> tuple[list[int], TreeNode]:
        """Slots of the longest prefix of `key` cached on the device, and the node that ends exactly
        there (host-only or loading nodes end the match: `load_prefix` brings them back)."""
        if self.disable:
            return [], self.root
        node = self.root
        self._touch(node)
        slots: list[int] = []
        pos = 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None or not child.ready:
                break
            shared = shared_len(child.key, key, pos)
            self._touch(child)
            if shared < len(child.key):
                # The match ends inside this edge: split it so the returned node covers the prefix.
                node = self._split(child, shared)
                slots.extend(node.value)
                break
            slots.extend(child.value)
            node = child
            pos += shared
        return slots, node

    def insert(self, key: list[int], value: list[int]) -> int:
        """Cache `key` -> `value`. Returns how many leading tokens were already cached on the device;
        the tree keeps its own slots for those and takes ownership of value[returned:] (including
        the tokens it held in host memory only, whose device copy it now takes from `value`)."""
        if len(key) != len(value):
            raise ValueError(f"insert: {len(key)} tokens but {len(value)} slots")
        if self.disable:
            return 0
        node = self.root
        self._touch(node)
        pos = 0
        present: int | None = None
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                leaf = TreeNode(key[pos:], value[pos:], node, next(self._clock))
                node.children[key[pos]] = leaf
                self._evictable_size += len(leaf.key)
                if self.write_through:
                    leaf.host_value = self._copy_to_host(leaf.value)
                break
            if child.loading is not None:  # rare: the same tokens are landing from the host; let them
                child.loading.wait()
                self.poll()
            shared = shared_len(child.key, key, pos)
            self._touch(child)
            if shared < len(child.key):
                child = self._split(child, shared)
            if child.value is None:
                if present is None:
                    present = pos
                child.value = value[pos : pos + shared]
                self._evictable_size += shared
            node = child
            pos += shared
        return pos if present is None else present

    def _split(self, child: TreeNode, at: int) -> TreeNode:
        """Cut `child`'s edge after `at` tokens; returns the new upper node. The `child` object
        stays the lower part, so locks and references that callers hold on it stay valid; the new
        node inherits the lock count (every lock below passes through it) and the access time."""
        parent = child.parent
        assert parent is not None and 0 < at < len(child.key)
        upper = TreeNode(child.key[:at], _head(child.value, at), parent, child.last_access)
        upper.host_value = _head(child.host_value, at)
        upper.loading = child.loading
        upper.lock_ref = child.lock_ref
        upper.children[child.key[at]] = child
        parent.children[child.key[0]] = upper
        child.parent = upper
        child.key = child.key[at:]
        child.value = _tail(child.value, at)
        child.host_value = _tail(child.host_value, at)
        return upper

    def _touch(self, node: TreeNode) -> None:
        node.last_access = next(self._clock)

    # ---- locking and eviction --------------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Pin `node` and its ancestors (a running request's cached prefix)."""
        if node is self.root:
            return
        node.own_locks += 1
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable_size -= len(node.key)
                self._protected_size += len(node.key)
            node.lock_ref += 1
            assert node.parent is not None
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one `inc_lock_ref(node)`."""
        if node is self.root:
            return
        if node.own_locks == 0:
            raise RuntimeError(f"dec_lock_ref on {node!r}, which holds no lock of its own")
        node.own_locks -= 1
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected_size -= len(node.key)
                self._evictable_size += len(node.key)
            assert node.parent is not None
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Free the device slots of least-recently-used unlocked device leaves until `num_tokens`
        tokens are freed or nothing more is evictable; with a host tier their KV moves to host memory
        (when it has room) instead of being dropped. Returns the number of tokens freed."""
        if self.disable or num_tokens <= 0:
            return 0
        heap = self._lru_heap(self._device_leaf)
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            assert leaf.value is not None
            if self.host is not None and leaf.host_value is None:
                leaf.host_value = self._copy_to_host(leaf.value)
            self.allocator.free(leaf.value)
            freed += len(leaf.value)
            self._evictable_size -= len(leaf.key)
            leaf.value = None
            parent = leaf.parent
            assert parent is not None
            if leaf.host_value is None:
                self._delete(leaf)
            if self._device_leaf(parent):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def _device_leaf(self, node: TreeNode) -> bool:
        """On the device, unlocked, and no child on the device: what device eviction may take."""
        return (node is not self.root and node.value is not None and node.lock_ref == 0
                and all(c.value is None for c in node.children.values()))

    def _lru_heap(self, candidate: Callable[[TreeNode], bool]) -> list[tuple[int, int, TreeNode]]:
        # id() breaks ties between equal access times without ever comparing nodes.
        heap = [(n.last_access, id(n), n) for n in self.nodes() if candidate(n)]
        heapq.heapify(heap)
        return heap

    def _delete(self, node: TreeNode) -> None:
        """Takes a node whose device slots are gone out of the tree, with its host-only subtree."""
        assert node.parent is not None
        del node.parent.children[node.key[0]]
        stack = [node]
        while stack:
            n = stack.pop()
            assert n.value is None and n.lock_ref == 0, f"deleting {n!r}, which holds device slots"
            stack.extend(n.children.values())
            if n.host_value is not None:
                assert self.host is not None
                self.host.allocator.free(n.host_value)

    # ---- the host tier ---------------------------------------------------------------------

    def _copy_to_host(self, slots: list[int]) -> list[int] | None:
        """Host slots now receiving a copy of device `slots`, or None when the host has no room."""
        assert self.host is not None
        allocator = self.host.allocator
        host_slots = allocator.alloc(len(slots))
        if host_slots is None:
            self.evict_host(len(slots) - allocator.available())
            host_slots = allocator.alloc(len(slots))
        if host_slots is not None:
            self.host.write(slots, host_slots)
        return host_slots

    def evict_host(self, num_tokens: int) -> int:
        """Free host slots, least recently used first: host-only leaves leave the tree, nodes also on
        the device only lose their host copy. Locked and loading nodes are kept. Returns tokens freed."""
        if self.host is None or num_tokens <= 0:
            return 0
        heap = self._lru_heap(self._host_evictable)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            assert node.host_value is not None
            self.host.allocator.free(node.host_value)
            freed += len(node.host_value)
            node.host_value = None
            if node.value is None:
                parent = node.parent
                assert parent is not None
                del parent.children[node.key[0]]
                if parent.value is None and self._host_evictable(parent):  # (one on both tiers is in already)
                    heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def _host_evictable(self, node: TreeNode) -> bool:
        return (node is not self.root and node.host_value is not None and node.loading is None
                and node.lock_ref == 0 and (node.value is not None or not node.children))

    def load_prefix(self, key: list[int]) -> bool:
        """Whether `key`'s cached prefix is ready on the device. If its path runs into nodes held in
        host memory only, starts loading them into fresh device slots (evicting as needed) and
        returns whether that load has landed already (always, on the CPU). False while a load on the
        path is in flight. True also when there is no room to load: the caller computes the rest."""
        if self.host is None:
            return True
        self.poll()
        node, pos = self.root, 0
        chain: list[TreeNode] = []
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            if child.loading is not None:
                return False
            shared = shared_len(child.key, key, pos)
            if child.value is None:
                if shared < len(child.key):
                    child = self._split(child, shared)
                chain.append(child)
            elif shared < len(child.key):
                break
            node = child
            pos += shared
        if not chain:
            return True
        tokens = sum(len(n.key) for n in chain)
        anchor = chain[0].parent
        assert anchor is not None
        for n in chain:  # the chain must survive the evictions that make device room for it
            n.loading = _RESERVED
        self.inc_lock_ref(anchor)
        slots = self.allocator.alloc(tokens)
        if slots is None:
            self.evict(tokens - self.allocator.available())
            slots = self.allocator.alloc(tokens)
        self.dec_lock_ref(anchor)
        if slots is None:
            for n in chain:
                n.loading = None
            return True
        load = self.host.load([s for n in chain for s in n.host_value or ()], slots)
        offset = 0
        for n in chain:
            self._touch(n)
            n.value, n.loading = slots[offset : offset + len(n.key)], load
            offset += len(n.key)
        self._evictable_size += tokens
        self.inc_lock_ref(chain[-1])  # the load holds its nodes until it lands
        self._loads.append((load, chain[-1]))
        self.poll()
        return chain[-1].loading is None

    def poll(self) -> None:
        """Completes the loads that have landed: their nodes become matchable and unlocked."""
        if not self._loads:
            return
        pending = []
        for load, last in self._loads:
            if not load.done():
                pending.append((load, last))
                continue
            assert self.host is not None
            self.host.finished(load)
            node: TreeNode | None = last
            while node is not None and node.loading is load:
                node.loading = None
                node = node.parent
            self.dec_lock_ref(last)
        self._loads = pending

    def wait_for_load(self) -> bool:
        """Blocks until the oldest load in flight lands (when there is nothing else to do). False if
        none is in flight."""
        if not self._loads:
            return False
        self._loads[0][0].wait()
        self.poll()
        return True

    # ---- request lifecycle -----------------------------------------------------------------

    def cache_finished(
        self, token_ids: list[int], slots: list[int], cached_len: int, last_node: TreeNode
    ) -> None:
        """A request finished or was retracted: cache its sequence and release everything it holds.

        `slots[:cached_len]` came from the tree (locked through `last_node`); the rest the request
        allocated. Slots for tokens that another request cached in the meantime are duplicates and
        go back to the allocator; the tree takes the others."""
        if self.disable:
            self.allocator.free(slots)
            return
        present = self._insert_own(token_ids, slots, cached_len)
        self.allocator.free(slots[cached_len:present])
        self.dec_lock_ref(last_node)

    def cache_unfinished(
        self, token_ids: list[int], slots: list[int], cached_len: int, last_node: TreeNode
    ) -> tuple[list[int], TreeNode]:
        """Chunked prefill: cache what the request has computed so far while it keeps running.

        Returns the slots that now back `token_ids` (the tree's, which replace any duplicates the
        request held) and the node they end at, which is now locked in place of `last_node`."""
        if self.disable:
            return slots, self.root
        present = self._insert_own(token_ids, slots, cached_len)
        self.allocator.free(slots[cached_len:present])
        new_slots, new_node = self.match_prefix(token_ids)
        assert len(new_slots) == len(token_ids), "a sequence just inserted must match in full"
        self.inc_lock_ref(new_node)
        self.dec_lock_ref(last_node)
        return new_slots, new_node

    def _insert_own(self, token_ids: list[int], slots: list[int], cached_len: int) -> int:
        if not 0 <= cached_len <= len(token_ids):
            raise ValueError(f"cached_len {cached_len} outside 0..{len(token_ids)}")
        present = self.insert(token_ids, slots)
        # The locked prefix cannot have been evicted, so it must be found again.
        assert present >= cached_len, f"locked prefix of {cached_len} tokens found only {present}"
        return present

    # ---- debugging -------------------------------------------------------------------------

    def nodes(self) -> list[TreeNode]:
        """Every node, root first, parents before children."""
        out = [self.root]
        i = 0
        while i < len(out):
            out.extend(out[i].children.values())
            i += 1
        return out

    def loads_in_flight(self) -> list[Transfer]:
        return [load for load, _ in self._loads]

    def check_invariants(self, owned: set[int]) -> None:
        """Assert the slot-state invariant and the tree's internal consistency (radix_checks.py).

        `owned` is every slot that running requests hold beyond their cached prefixes."""
        check_tree(self, owned)

    def pretty(self) -> str:
        """The tree, one node a line, indented by depth."""
        return tree_text(self)


# Marks host-only nodes a load is about to fill, so that making device room for it cannot drop them.
_RESERVED: Transfer = object()  # type: ignore[assignment]


def _head(slots: list[int] | None, at: int) -> list[int] | None:
    return None if slots is None else slots[:at]


def _tail(slots: list[int] | None, at: int) -> list[int] | None:
    return None if slots is None else slots[at:]
