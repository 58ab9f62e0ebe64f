"""The prefix compare every radix tree over token ids walks with (the KV cache's, the scheduler's
priority tree, the router's meta tree); a module of its own so that the router, which holds no KV,
imports it without the KV pool (and torch).
"""

from __future__ import annotations


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
