"""Minimizing a DFA given as numpy tables: dead-state removal (reverse reachability), then one pass for a
finite language or Moore partition refinement, for regex_dfa.py's subset constructions and dfa_product.py's
products; and the byte classes of a table (bytes no state tells apart)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

# A trimmed DFA with at most this many moves (states x classes) is first tried as an acyclic one (a finite
# language: a length-bounded product or counted pattern), minimized in one pass in Python; Moore's rounds
# cost as many numpy passes as the longest string (65-130 for a length-bounded product).
MAX_ACYCLIC_MOVES = 65_536
# Live states of a table with at most this many moves are found in Python (numpy's search costs a round a level).
MAX_PYTHON_LIVE_MOVES = 16_384


def live_states(trans: np.ndarray, accepting: np.ndarray) -> np.ndarray:
    """bool [n]: states from which an accepting state is reachable (reverse BFS on the edge list; one numpy
    round a level, or in Python for a small table)."""
    if trans.size <= MAX_PYTHON_LIVE_MOVES:
        return _live_in_python(trans, accepting)
    src, cls = np.nonzero(trans >= 0)
    dst = trans[src, cls]
    order = np.argsort(dst, kind="stable")
    src, dst = src[order], dst[order]
    ptr = np.searchsorted(dst, np.arange(trans.shape[0] + 1))
    live = accepting.copy()
    frontier = np.flatnonzero(live)
    met = np.zeros_like(live)  # (a mask, not np.unique: a level's predecessors deduplicated in one pass)
    while frontier.size:
        counts = ptr[frontier + 1] - ptr[frontier]
        starts = np.repeat(ptr[frontier], counts)
        offsets = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        met[src[starts + offsets]] = True
        met &= ~live
        frontier = np.flatnonzero(met)
        live |= met
        met[frontier] = False
    return live


def _live_in_python(trans: np.ndarray, accepting: np.ndarray) -> np.ndarray:
    preds: list[list[int]] = [[] for _ in range(trans.shape[0])]
    for s, row in enumerate(trans.tolist()):
        for t in row:
            if t >= 0:
                preds[t].append(s)
    return np.array(reaching(preds, accepting.tolist()), dtype=bool).reshape(-1)


def reaching(preds: list[list[int]], targets: list[bool]) -> list[bool]:
    """Per state: whether it is a target or reaches one, given each state's predecessors."""
    live = list(targets)
    stack = [s for s, a in enumerate(live) if a]
    while stack:
        for p in preds[stack.pop()]:
            if not live[p]:
                live[p] = True
                stack.append(p)
    return live


# splitmix64's finalizer: mixes a round's signature hashes so that the next round's (linear) hash of them
# does not compose into one linear function of the first labels (which merges states it should not).
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mixed(h: np.ndarray) -> np.ndarray:
    h ^= h >> np.uint64(30)
    h *= _MIX1
    h ^= h >> np.uint64(27)
    h *= _MIX2
    h ^= h >> np.uint64(31)
    return h


def refine(trans: np.ndarray, accepting: np.ndarray, exact: bool,
           check: Callable[[], None] | None = None) -> np.ndarray:
    """Moore partition refinement: block id per state of the coarsest partition respecting transitions
    (`check`, if given, is called every round: a deadline that may raise).

    A round's signature (own block, successor blocks) is hashed to one uint64, which labels the state's
    block in the next round as it is (no renumbering: one gather and one product a round); blocks are
    numbered once at the end. `exact` compares the rows themselves (the fallback should a hash collision
    ever show up: minimize checks the result)."""
    n, k = trans.shape
    rng = np.random.default_rng(0x5EED)
    weights = rng.integers(1, 2**63, size=k + 1, dtype=np.uint64) | np.uint64(1)
    if exact:
        block = accepting.astype(np.int64)
        num_blocks = len(np.unique(block))
        while True:
            if check is not None:
                check()
            sig = np.concatenate([block[:, None], np.where(trans >= 0, block[np.maximum(trans, 0)], -1) + 1], axis=1)
            block = np.unique(sig, axis=0, return_inverse=True)[1].reshape(-1)
            new_num = int(block.max()) + 1 if n else 0
            if new_num == num_blocks:
                return block
            num_blocks = new_num
    target = np.where(trans >= 0, trans, n)  # a missing move: to an extra state with a label of its own
    label = np.append(accepting.astype(np.uint64), np.uint64(2))
    num_blocks = len(np.unique(accepting))
    with np.errstate(over="ignore"):
        while True:
            if check is not None:
                check()
            label[:n] = _mixed(label[target] @ weights[1:] + label[:n] * weights[0])
            ordered = np.sort(label[:n])
            new_num = int(np.count_nonzero(ordered[1:] != ordered[:-1])) + 1 if n else 0
            if new_num == num_blocks:
                return np.unique(label[:n], return_inverse=True)[1].reshape(-1)
            num_blocks = new_num


def _acyclic_blocks(trans: np.ndarray, accepting: np.ndarray) -> np.ndarray | None:
    """The minimal partition of a trimmed DFA without cycles (block per state), or None if it has one.

    States are met successors first (a depth-first search's post-order), so each state's successors
    already have their blocks: two states are equivalent iff they agree on acceptance and on the block
    each class leads to (Revuz's construction for acyclic automata)."""
    rows, acc = trans.tolist(), accepting.tolist()
    block = [-2] * len(rows)  # -2 not met, -3 on the search's path, else the block
    ids: dict[tuple, int] = {}
    for root in range(len(rows)):
        if block[root] != -2:
            continue
        stack = [root]
        while stack:
            s = stack[-1]
            if block[s] == -2:
                block[s] = -3
                for t in rows[s]:
                    if t >= 0:
                        if block[t] == -3:
                            return None  # a cycle
                        if block[t] == -2:
                            stack.append(t)
                continue
            stack.pop()
            if block[s] == -3:
                sig = (acc[s], *[block[t] if t >= 0 else -1 for t in rows[s]])
                block[s] = ids.setdefault(sig, len(ids))
    return np.array(block, dtype=np.int64)


def minimize(trans: np.ndarray, accepting: np.ndarray, classes: np.ndarray, pattern: str,
             check: Callable[[], None] | None = None, live: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The minimal DFA of (`trans` [n, classes], `accepting`) as (transitions [states, 256] by byte through
    `classes`, accepting), dead states dropped and states numbered breadth first from the start (0);
    ValueError if the start is dead (`pattern` names the language in that error). `live`: live_states'
    answer, where the caller has it already."""
    live = live_states(trans, accepting) if live is None else live
    if not live[0]:
        raise ValueError(f"regex {pattern!r} matches no string")
    keep = np.flatnonzero(live)
    renum = np.full(trans.shape[0], -1, dtype=np.int32)
    renum[keep] = np.arange(len(keep), dtype=np.int32)
    trans = np.where(trans >= 0, renum[np.maximum(trans, 0)], -1)[keep]
    accepting = accepting[keep]

    block = _acyclic_blocks(trans, accepting) if trans.size <= MAX_ACYCLIC_MOVES else None
    if block is None:
        block = refine(trans, accepting, exact=False, check=check)
        rep = _first_of_blocks(block)
        succ_block = np.where(trans >= 0, block[np.maximum(trans, 0)], -1)
        if not (np.array_equal(succ_block, succ_block[rep[block]]) and np.array_equal(accepting, accepting[rep[block]])):
            # A hash collision merged two states (a partition that passes both is the coarsest one: it
            # respects transitions and acceptance, and no round split less than Moore's would).
            block = refine(trans, accepting, exact=True, check=check)
    return _numbered(block, trans, accepting, classes)


def _first_of_blocks(block: np.ndarray) -> np.ndarray:
    """Per block, its first state."""
    rep = np.zeros(int(block.max()) + 1, dtype=np.int64)
    rep[block[::-1]] = np.arange(len(block))[::-1]
    return rep


def _numbered(block: np.ndarray, trans: np.ndarray, accepting: np.ndarray,
              classes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The DFA of the blocks (`block`: per state, of a partition that respects transitions and acceptance),
    numbered breadth first from the start's block, as minimize returns it."""
    rep = _first_of_blocks(block)
    small = np.where(trans >= 0, block[np.maximum(trans, 0)], -1)[rep]  # [num_blocks, K] moves between blocks
    small_accepting = accepting[rep]

    # Renumber in breadth-first order from the start so state ids are deterministic and start is 0.
    rows = small.tolist()  # (Python ints: a loop over numpy scalars costs several times more)
    order, seen = [int(block[0])], {int(block[0])}
    for b in order:
        for t in rows[b]:
            if t >= 0 and t not in seen:
                seen.add(t)
                order.append(t)
    final = np.full(len(rep), -1, dtype=np.int32)
    final[order] = np.arange(len(order), dtype=np.int32)
    small = np.where(small >= 0, final[np.maximum(small, 0)], -1)[order]
    by_byte = np.ascontiguousarray(small[:, classes], dtype=np.int32)
    return by_byte, small_accepting[order].copy()


def column_classes(table: np.ndarray) -> np.ndarray:
    """The class of each byte: bytes whose columns of `table` [n, 256] are equal share one, numbered in byte
    order. Columns are told apart by a random-weighted hash, checked exactly (np.unique over whole columns,
    ~10x slower on wide tables, should two ever collide)."""
    rows = table.astype(np.int64) + 1  # (the columns hashed in place: a transposed copy cost more)
    weights = np.random.default_rng(0x5EED).integers(1, 2**63, size=rows.shape[0], dtype=np.uint64) | np.uint64(1)
    hashed = weights @ rows.view(np.uint64)
    _, first, classes = np.unique(hashed, return_index=True, return_inverse=True)
    if not np.array_equal(rows, rows[:, first[classes.reshape(-1)]]):
        _, first, classes = np.unique(rows.T, axis=0, return_index=True, return_inverse=True)
    return in_byte_order(first, classes.reshape(-1))


def in_byte_order(first: np.ndarray, classes: np.ndarray) -> np.ndarray:
    """Classes (`classes`: per byte; `first`: per class, its first byte) renumbered by their first bytes."""
    order = np.argsort(first)
    return np.argsort(order)[classes]
