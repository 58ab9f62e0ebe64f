"""Paths from a parser state to acceptance, searched over `index.byte_successors` and
`index.is_accepting` alone, so for either engine's index: the shortest (breadth first), a quick one
(depth first, closing bytes first), and whether any is left (a constraint's reach check)."""

from __future__ import annotations


def shortest_bytes_to_accept(index, state: int, max_states: int = 100_000) -> bytes | None:
    """Breadth first from `state` over `index.byte_successors` to an accepting state: the bytes of the
    shortest path, or None if none is found within `max_states` states. For either engine's index."""
    return _search(index, state, max_states)[0]


# Closing bytes first, opening ones last: a depth-first search in this order ends values quickly.
_COMPLETION_ORDER = [*b'"}]0,:', *(b for b in range(256) if b not in b'"}]0,:[{'), *b"[{"]


def bytes_to_accept(index, state: int, max_states: int = 100_000) -> bytes | None:
    """Depth first from `state`, closing bytes first: the bytes of a path to an accepting state (not
    the shortest), or None if none is found within `max_states` states. Where a breadth-first search
    drowns (a required key far ahead, behind values of any shape), this one walks straight there."""
    path, seen = bytearray(), {state}
    stack = [(state, iter(_COMPLETION_ORDER))]
    while stack:
        current, moves = stack[-1]
        if index.is_accepting(current):
            return bytes(path)
        successors = index.byte_successors(current)
        for byte in moves:
            nxt = successors[byte]
            if nxt >= 0 and nxt not in seen:
                if len(seen) >= max_states:
                    return None
                seen.add(nxt)
                path.append(byte)
                stack.append((nxt, iter(_COMPLETION_ORDER)))
                break
        else:
            stack.pop()
            if path:
                path.pop()
    return None


def can_finish(index, state: int, max_states: int) -> bool:
    """False only when the search ran out of states to visit without reaching an accepting one."""
    path, exhausted = _search(index, state, max_states)
    return path is not None or not exhausted


def _search(index, state: int, max_states: int) -> tuple[bytes | None, bool]:
    """(shortest path to acceptance or None, whether every reachable state was visited)."""
    if index.is_accepting(state):
        return b"", False
    back: dict[int, tuple[int, int] | None] = {state: None}
    frontier = [state]
    while frontier:
        if len(back) >= max_states:
            return None, False
        nxt = []
        for s in frontier:
            for byte, t in enumerate(index.byte_successors(s)):
                if t < 0 or t in back:
                    continue
                back[t] = (s, byte)
                if index.is_accepting(t):
                    path = bytearray()
                    while back[t] is not None:
                        t, b = back[t]
                        path.append(b)
                    return bytes(reversed(path)), False
                nxt.append(t)
        frontier = nxt
    return None, True
