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
"""

from __future__ import annotations

import heapq
import itertools

from radixlm.core.engine.memory_pool import SlotAllocator


class TreeNode:
    """One edge of the tree: `key` tokens whose KV lives in `value` slots (same length).

    `lock_ref` counts the locks placed on this node or any node below it; `own_locks` counts only
    those placed on this node itself, so that lock_ref == own_locks + sum of children's lock_ref.
    """

    def __init__(
        self, key: list[int], value: list[int], parent: TreeNode | None, last_access: int
    ) -> None:
        self.children: dict[int, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.own_locks = 0
        self.last_access = last_access

    def __repr__(self) -> str:
        return (
            f"TreeNode(key={self.key}, value={self.value}, lock_ref={self.lock_ref}, "
            f"last_access={self.last_access})"
        )


def shared_len(edge: list[int], key: list[int], pos: int = 0) -> int:
    """How many leading tokens of `edge` equal key[pos:]. Slices only as long as the edge, so a
    walk copies O(len(key)) in all; the whole-edge compare runs in C, the common case."""
    if key[pos : pos + len(edge)] == edge:
        return len(edge)
    n = min(len(edge), len(key) - pos)
    i = 0
    while i < n and edge[i] == key[pos + i]:
        i += 1
    return i


class RadixCache:
    """The tree plus its bookkeeping of evictable and locked token counts.

    With `disable=True` nothing is ever cached: matches are empty, inserts keep nothing, and
    finishing a request frees all of its slots. The scheduler runs the same code either way.
    """

    def __init__(self, allocator: SlotAllocator, disable: bool = False) -> None:
        self.allocator = allocator
        self.disable = disable
        self._clock = itertools.count()
        self.root = TreeNode([], [], None, next(self._clock))
        self._evictable_size = 0
        self._protected_size = 0

    # ---- whole-tree operations -------------------------------------------------------------

    def reset(self) -> None:
        """Drop every cached sequence and return its slots to the allocator."""
        slots: list[int] = []
        for node in self._nodes():
            if node.lock_ref > 0:
                raise RuntimeError(f"reset() while a request still holds {node!r}")
            slots.extend(node.value)
        self.allocator.free(slots)
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
        """Slots of the longest cached prefix of `key`, and the node that ends exactly there."""
        if self.disable:
            return [], self.root
        node = self.root
        self._touch(node)
        slots: list[int] = []
        pos = 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
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
        """Cache `key` -> `value`. Returns how many leading tokens were already cached; the tree
        keeps its own slots for those and takes ownership of value[returned:]."""
        if len(key) != len(value):
            raise ValueError(f"insert: {len(key)} tokens but {len(value)} slots")
        if self.disable:
            return 0
        node = self.root
        self._touch(node)
        pos = 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                leaf = TreeNode(key[pos:], value[pos:], node, next(self._clock))
                node.children[key[pos]] = leaf
                self._evictable_size += len(leaf.key)
                break
            shared = shared_len(child.key, key, pos)
            self._touch(child)
            if shared < len(child.key):
                child = self._split(child, shared)
            node = child
            pos += shared
        return pos

    def _split(self, child: TreeNode, at: int) -> TreeNode:
        """Cut `child`'s edge after `at` tokens; returns the new upper node. The `child` object
        stays the lower part, so locks and references that callers hold on it stay valid; the new
        node inherits the lock count (every lock below passes through it) and the access time."""
        parent = child.parent
        assert parent is not None and 0 < at < len(child.key)
        upper = TreeNode(child.key[:at], child.value[:at], parent, child.last_access)
        upper.lock_ref = child.lock_ref
        upper.children[child.key[at]] = child
        parent.children[child.key[0]] = upper
        child.parent = upper
        child.key = child.key[at:]
        child.value = child.value[at:]
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
        """Free least-recently-used unlocked leaves until `num_tokens` tokens are freed or nothing
        more is evictable. Returns the number of tokens freed."""
        if self.disable or num_tokens <= 0:
            return 0
        # id() breaks ties between equal access times without ever comparing nodes.
        heap = [
            (n.last_access, id(n), n)
            for n in self._nodes()
            if not n.children and n.lock_ref == 0 and n is not self.root
        ]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            self.allocator.free(leaf.value)
            freed += len(leaf.value)
            self._evictable_size -= len(leaf.key)
            del parent.children[leaf.key[0]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

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

    def _nodes(self) -> list[TreeNode]:
        """Every node, root first, parents before children."""
        out = [self.root]
        i = 0
        while i < len(out):
            out.extend(out[i].children.values())
            i += 1
        return out

    def check_invariants(self, owned: set[int]) -> None:
        """Assert the slot-state invariant and the tree's internal consistency.

        `owned` is every slot that running requests hold beyond their cached prefixes."""
        num_slots = self.allocator.num_slots
        where: dict[int, str] = {}

        def claim(slot: int, place: str) -> None:
            assert 1 <= slot <= num_slots, f"slot {slot} ({place}) outside 1..{num_slots}"
            assert slot not in where, f"slot {slot} is both {where[slot]} and {place}"
            where[slot] = place

        free = self.allocator.free_set()
        assert len(free) == self.allocator.available(), "the allocator's free list repeats a slot"
        for slot in free:
            claim(slot, "free")
        for slot in owned:
            claim(slot, "owned by a running request")

        evictable = protected = 0
        root = self.root
        assert root.parent is None and not root.key and not root.value, "root must be empty"
        assert root.lock_ref == 0 and root.own_locks == 0, "root is never locked"
        assert not (self.disable and root.children), "disabled cache holds nodes"
        for node in self._nodes():
            child_locks = 0
            for first, child in node.children.items():
                assert child.parent is node, f"{child!r} does not point back to its parent"
                assert child.key and child.key[0] == first, f"{child!r} filed under token {first}"
                assert len(child.key) == len(child.value), f"{child!r} key/value lengths differ"
                child_locks += child.lock_ref
            if node is root:  # locks stop below the root
                continue
            assert node.own_locks >= 0, f"{node!r} has negative own_locks"
            assert node.lock_ref == node.own_locks + child_locks, (
                f"{node!r}: lock_ref {node.lock_ref} != own {node.own_locks} + children {child_locks}"
            )
            state = "cached-locked" if node.lock_ref > 0 else "cached-evictable"
            for slot in node.value:
                claim(slot, f"{state} in {node!r}")
            if node.lock_ref > 0:
                protected += len(node.key)
            else:
                evictable += len(node.key)

        missing = sorted(set(range(1, num_slots + 1)) - where.keys())
        assert not missing, f"slots {missing} are neither free, cached nor owned (leaked)"
        assert evictable == self._evictable_size, (
            f"evictable_size {self._evictable_size} but unlocked nodes hold {evictable} tokens"
        )
        assert protected == self._protected_size, (
            f"protected_size {self._protected_size} but locked nodes hold {protected} tokens"
        )

    def pretty(self) -> str:
        """The tree, one node a line, indented by depth."""
        lines = [f"root (evictable={self._evictable_size}, protected={self._protected_size})"]

        def walk(node: TreeNode, depth: int) -> None:
            for first in sorted(node.children):
                child = node.children[first]
                lines.append(
                    f"{'  ' * depth}{child.key} -> {child.value} "
                    f"lock={child.lock_ref} t={child.last_access}"
                )
                walk(child, depth + 1)

        walk(self.root, 1)
        return "\n".join(lines)
