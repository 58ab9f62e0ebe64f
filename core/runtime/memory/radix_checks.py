"""Debugging the radix cache: the slot-state invariant checked over the whole tree (every KV slot is
exactly one of free, cached-evictable, cached-locked, owned by a running request; every host slot free
or held by one node) with the tree's own consistency, and the tree printed."""

from __future__ import annotations

from typing import Any


def check_tree(tree: Any, owned: set[int]) -> None:
    """Asserts the slot-state invariant and the tree's internal consistency of `tree` (a RadixCache).
    `owned` is every slot that running requests hold beyond their cached prefixes."""
    num_slots = tree.allocator.num_slots
    where: dict[int, str] = {}

    def claim(slot: int, place: str) -> None:
        assert 1 <= slot <= num_slots, f"slot {slot} ({place}) outside 1..{num_slots}"
        assert slot not in where, f"slot {slot} is both {where[slot]} and {place}"
        where[slot] = place

    free = tree.allocator.free_set()
    assert len(free) == tree.allocator.available(), "the allocator's free list repeats a slot"
    for slot in free:
        claim(slot, "free")
    for slot in owned:
        claim(slot, "owned by a running request")
    host_where: dict[int, Any] = {}
    if tree.host is not None:
        host_free = tree.host.allocator.free_set()
        assert len(host_free) == tree.host.allocator.available(), "the host free list repeats a slot"
        host_where = dict.fromkeys(host_free, tree.root)  # the root stands for "free"
    loads = {id(load) for load in tree.loads_in_flight()}

    evictable = protected = 0
    root = tree.root
    assert root.parent is None and not root.key and not root.value, "root must be empty"
    assert root.lock_ref == 0 and root.own_locks == 0, "root is never locked"
    assert not (tree.disable and root.children), "disabled cache holds nodes"
    for node in tree.nodes():
        child_locks = 0
        for first, child in node.children.items():
            assert child.parent is node, f"{child!r} does not point back to its parent"
            assert child.key and child.key[0] == first, f"{child!r} filed under token {first}"
            for slots in (child.value, child.host_value):
                assert slots is None or len(slots) == len(child.key), f"{child!r} key/slot lengths differ"
            assert child.value is None or node.value is not None, f"{child!r} on the device, its parent not"
            child_locks += child.lock_ref
        if node is root:  # locks stop below the root
            continue
        assert node.own_locks >= 0, f"{node!r} has negative own_locks"
        assert node.lock_ref == node.own_locks + child_locks, (
            f"{node!r}: lock_ref {node.lock_ref} != own {node.own_locks} + children {child_locks}"
        )
        if node.host_value is not None:
            assert tree.host is not None, f"{node!r} holds host slots without a host tier"
            for slot in node.host_value:
                assert 1 <= slot <= tree.host.allocator.num_slots, f"host slot {slot} of {node!r} out of range"
                other = host_where.get(slot)
                assert other is None, f"host slot {slot} is in {node!r} and {'free' if other is root else other}"
                host_where[slot] = node
        if node.loading is not None:
            assert id(node.loading) in loads, f"{node!r} is loading, but no load is in flight"
            assert node.host_value is not None and node.lock_ref > 0, f"{node!r} loads unlocked or from nothing"
        if node.value is None:
            assert node.host_value is not None, f"{node!r} holds its KV nowhere"
            assert node.lock_ref == 0, f"{node!r} is locked but not on the device"
            continue
        state = "cached-locked" if node.lock_ref > 0 else "cached-evictable"
        for slot in node.value:
            claim(slot, f"{state} in {node!r}")
        if node.lock_ref > 0:
            protected += len(node.key)
        else:
            evictable += len(node.key)

    missing = sorted(set(range(1, num_slots + 1)) - where.keys())
    assert not missing, f"slots {missing} are neither free, cached nor owned (leaked)"
    if tree.host is not None:
        lost = sorted(set(range(1, tree.host.allocator.num_slots + 1)) - host_where.keys())
        assert not lost, f"host slots {lost} are neither free nor held by a node (leaked)"
    assert evictable == tree.evictable_size(), (
        f"evictable_size {tree.evictable_size()} but unlocked nodes hold {evictable} tokens"
    )
    assert protected == tree.protected_size(), (
        f"protected_size {tree.protected_size()} but locked nodes hold {protected} tokens"
    )


def tree_text(tree: Any) -> str:
    """The tree, one node a line, indented by depth."""
    lines = [f"root (evictable={tree.evictable_size()}, protected={tree.protected_size()})"]

    def walk(node: Any, depth: int) -> None:
        for first in sorted(node.children):
            child = node.children[first]
            host = "" if child.host_value is None else f" host={child.host_value}"
            lines.append(
                f"{'  ' * depth}{child.key} -> {child.value}{host} "
                f"lock={child.lock_ref} t={child.last_access}{' loading' if child.loading else ''}"
            )
            walk(child, depth + 1)

    walk(tree.root, 1)
    return "\n".join(lines)
