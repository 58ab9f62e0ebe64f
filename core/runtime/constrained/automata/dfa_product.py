"""Products of byte DFAs: intersection, difference, and a bounded check that two languages are disjoint.

A product walks the pairs of states a string takes the two DFAs to, breadth first from (start, start), over
the byte classes neither DFA tells apart, and is minimized (dfa_minimize.py)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from radixlm.core.runtime.constrained.automata.dfa_minimize import in_byte_order, live_states, minimize
from radixlm.core.runtime.constrained.automata.regex_dfa import MAX_DFA_STATES, ByteDFA
from radixlm.core.errors import GrammarBudgetError


def dfa_difference(a: ByteDFA, b: ByteDFA, max_states: int = MAX_DFA_STATES,
                   check: Callable[[], None] | None = None) -> ByteDFA | None:
    """The minimal DFA of L(a) minus L(b) (product construction), or None if that language is empty;
    `check` (a deadline that may raise) is called as the construction goes."""
    return _product(a, b, False, max_states, check)


def dfa_intersection(a: ByteDFA, b: ByteDFA, max_states: int = MAX_DFA_STATES,
                     check: Callable[[], None] | None = None) -> ByteDFA | None:
    """The minimal DFA of L(a) and L(b) both, or None if that language is empty (one product)."""
    return _product(a, b, True, max_states, check)


def dfa_disjoint(a: ByteDFA, b: ByteDFA, max_pairs: int = 4096) -> bool:
    """Whether no string is in both L(a) and L(b), shown by walking the pairs of states a string takes
    them to (breadth first) without meeting one both accept; False too once over `max_pairs` pairs (not
    shown). Patterns with different literal starts (`^title_...`, `^name_...`) part after a few pairs,
    where a difference would build and minimize their whole product."""
    seen = {(0, 0)}
    frontier = [(0, 0)]
    while frontier:
        nxt = []
        for x, y in frontier:
            if a.accepting[x] and b.accepting[y]:
                return False
            ra, rb = a.transitions[x], b.transitions[y]
            both = np.flatnonzero((ra >= 0) & (rb >= 0))
            for pair in set(zip(ra[both].tolist(), rb[both].tolist())):
                if pair not in seen:
                    seen.add(pair)
                    nxt.append(pair)
        if len(seen) > max_pairs:
            return False
        frontier = nxt
    return True


def _shared_classes(a: ByteDFA, b: ByteDFA) -> tuple[np.ndarray, np.ndarray]:
    """Bytes that no state of a or b tells apart, as classes numbered in byte order (as regex_to_dfa's, so
    minimal DFAs come out numbered alike): (first byte of each class, class of each byte). From each DFA's
    own classes (kept with it: a product's operands are mostly cached DFAs met again)."""
    ca, cb = a.byte_classes, b.byte_classes
    _, first, classes = np.unique(ca * 256 + cb, return_index=True, return_inverse=True)
    classes = in_byte_order(first, classes.reshape(-1))
    return np.sort(first), classes


# A batch of product states with at most this many moves (states x byte classes) is expanded in Python, one
# dict lookup a move; larger ones as numpy rows. A length-bounded product is ~65-130 breadth-first levels of
# a few states each, where a numpy round's fixed cost (~0.15 ms) was most of the product's time.
PYTHON_BATCH_MOVES = 1024


def _product(a: ByteDFA, b: ByteDFA, both: bool, max_states: int,
             check: Callable[[], None] | None) -> ByteDFA | None:
    """The product of a and b, minimized: strings both accept (`both`), else those a accepts and b does not.

    Built over byte classes (bytes that no state of a or b tells apart), breadth first: each batch of
    states not yet expanded (a level) gets its rows of successor pairs, small batches in Python, large
    ones as numpy rows whose distinct pairs alone are looked up."""
    first, classes = _shared_classes(a, b)
    sink = b.num_states  # for a difference, b's missing transitions go to an extra rejecting sink
    tb = b.transitions[:, first]
    tb = np.vstack([tb if both else np.where(tb >= 0, tb, sink), np.full((1, len(first)), -1 if both else sink)])
    acc_b = np.append(b.accepting, False)
    ta = a.transitions[:, first].astype(np.int64)
    base = sink + 1  # a pair (x, y) as the code x * base + y
    ids: dict[int, int] = {0: 0}
    codes, rows, done = [0], [], 0
    rows_a: dict[int, list[int]] = {}  # (rows as Python ints, converted as the Python batches meet them)
    rows_b: dict[int, list[int]] = {}
    while done < len(codes):
        batch = codes[done:]
        done = len(codes)
        if len(batch) * len(first) <= PYTHON_BATCH_MOVES:
            rows.append(_expand_in_python(batch, base, ta, tb, rows_a, rows_b, ids, codes))
        else:
            rows.append(_expand_in_numpy(batch, base, ta, tb, ids, codes))
        if len(ids) > max_states:
            raise GrammarBudgetError(f"automaton too large: over {max_states} states")
        if check is not None:
            check()
    xa, xb = np.divmod(np.asarray(codes, dtype=np.int64), base)
    accepting = a.accepting[xa] & (acc_b[xb] == both)
    trans = np.concatenate(rows)
    live = live_states(trans, accepting)
    if not live[0]:
        return None  # the language is empty
    return ByteDFA(*minimize(trans, accepting, classes, "product", check, live))


def _expand_in_python(batch: list[int], base: int, ta: np.ndarray, tb: np.ndarray, rows_a: dict, rows_b: dict,
                      ids: dict[int, int], codes: list[int]) -> np.ndarray:
    """The product rows of the pairs `batch` (codes), numbering new pairs in `ids` and appending them to `codes`."""
    out = []
    for code in batch:
        x, y = divmod(code, base)
        ra = rows_a.get(x)
        if ra is None:
            ra = rows_a[x] = ta[x].tolist()
        rb = rows_b.get(y)
        if rb is None:
            rb = rows_b[y] = tb[y].tolist()
        row = []
        for u, v in zip(ra, rb):
            if u < 0 or v < 0:
                row.append(-1)
                continue
            pair = u * base + v
            j = ids.get(pair)
            if j is None:
                j = ids[pair] = len(codes)
                codes.append(pair)
            row.append(j)
        out.append(row)
    return np.array(out, dtype=np.int32).reshape(len(batch), ta.shape[1])


def _expand_in_numpy(batch: list[int], base: int, ta: np.ndarray, tb: np.ndarray, ids: dict[int, int],
                     codes: list[int]) -> np.ndarray:
    """_expand_in_python's rows as numpy rows: only their distinct successor pairs are looked up."""
    xa, xb = np.divmod(np.asarray(batch, dtype=np.int64), base)
    na, nb = ta[xa], tb[xb]
    succ = np.where((na >= 0) & (nb >= 0), na * base + nb, -1)
    targets, inverse = np.unique(succ, return_inverse=True)
    mapped = []
    for code in targets.tolist():
        j = ids.get(code, -1) if code >= 0 else -1
        if j < 0 <= code:
            j = ids[code] = len(codes)
            codes.append(code)
        mapped.append(j)
    return np.asarray(mapped, dtype=np.int32)[inverse.reshape(succ.shape)]
