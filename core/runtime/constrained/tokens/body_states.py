"""Wide terminal states read off another state's token classes, where the two read alike but for a few
tokens (terminal_tokens._classify; a walk of the whole vocabulary from a wide state is ~1-10 ms).

Paths apart. A key terminal that excludes the listed names (`additionalProperties`, `patternProperties`)
is, past its opening quote, a JSON string body except along those names: after `"f` of a key excluding
`"foo"`, the byte `o` leads to a state of its own and `o"` to none, while every other byte leads where the
body's does. Walked together from both states, the two automata part on a few paths only, and wherever
they meet again (the same state: terminal DFAs are minimal) every token below reads alike. So a token's
classes differ from the body's only if it runs along such a path to where this state dies: those tokens
are taken out of the body's classes (terminal_tokens._patched, which keeps the result per body and paths:
the state after a whole name dies on `"` alone, whatever the name), instead of walking every token that
starts with each excluded name's letters (~1 ms a state). Tokens that start with some bytes are one range
of the sorted vocabulary (literal_tokens.py), so no trie is walked.

Bytes apart. A pattern key before its pattern has matched (`f.*o`: after `"x`, or `"f`) never meets its
string body again, yet reads like it: alive on the same bytes, accepting after the same ones, except on
`"`, which closes the key only once the pattern has matched. Run together from the two states, the pairs
of states they reach are few, and the bytes on which some pair stops agreeing are few: a token without
any of them reads alike from both, so only the tokens containing one are read again from this state
(terminal_tokens._reread), a few thousand at most, in one numpy pass per byte position.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from radixlm.core.runtime.constrained.tokens.literal_tokens import starting_with
from radixlm.core.runtime.constrained.tokens.narrow_walk import state_row
from radixlm.core.runtime.constrained.automata.regex_dfa import ByteDFA
from radixlm.core.runtime.constrained.tokens.vocab import TokenVocab, byte_matrix

MAX_PATHS = 128  # byte strings looked up where the two part, at most; past it the general walk does
MAX_DYING = 2048  # tokens taken out of the body's classes, at most (clearing each costs; a name's `"` has 424)


def body_of(key: str, dfa: ByteDFA, state: int) -> int | None:
    """The state most of `state`'s bytes lead to, when that is another state most of whose own bytes lead
    back to itself (a string body's character loop); else None."""
    body = _most_common(state_row(key, dfa, state)[1])
    if body is None or body == state or _most_common(state_row(key, dfa, body)[1]) != body:
        return None
    return body


def paths_apart(key: str, dfa: ByteDFA, state: int, body: int, vocab: TokenVocab) -> tuple[bytes, ...] | None:
    """The byte strings on which `state` dies where `body` reads on, having parted from it (both alive,
    neither accepting) on every byte before; only those some token starts with, sorted. The tokens that
    start with them are the ones whose classes from `state` differ from those from `body` (there they are
    neither inside nor exits). None where the two part otherwise (`state` reads on where the body dies, or
    either accepts before they meet: its exits would differ), on too many bytes or for too many tokens (a
    UTF-8 continuation state parts from the body on every ASCII byte)."""
    data = vocab.sorted_tokens[0]
    accepting = dfa.accepting
    dying: list[bytes] = []
    paths = [(b"", state, body)]  # bytes read, and the two states after them: apart, both alive, not accepting
    looked_up = tokens = 0
    while paths:
        read, a, b = paths.pop()
        differing = _differing(key, dfa, a, b)
        looked_up += len(differing)
        if looked_up > MAX_PATHS:  # not a body but for a few names (a pattern's states, a counted string's)
            return None
        for byte, to_a, to_b in differing:
            path = read + bytes((byte,))
            lo, hi = starting_with(data, path)
            if lo == hi:  # no token runs this way
                continue
            if to_a < 0:
                dying.append(path)
                tokens += hi - lo
                if tokens > MAX_DYING:
                    return None
            elif to_b < 0 or accepting[to_a] or accepting[to_b]:
                return None
            else:  # tokens that end here stay inside from both; the ones going on are looked at below
                paths.append((path, to_a, to_b))
    return tuple(sorted(dying))


def tokens_starting(vocab: TokenVocab, paths: tuple[bytes, ...]) -> np.ndarray:
    """Ids (int64) of the tokens that start with one of `paths` (none a prefix of another)."""
    data, ids, _ = vocab.sorted_tokens
    return np.concatenate([ids[slice(*starting_with(data, p))] for p in paths]).astype(np.int64)


def _most_common(targets: list[int]) -> int | None:
    return Counter(targets).most_common(1)[0][0] if targets else None


_differing_cache: dict[tuple[str, int, int], list[tuple[int, int, int]]] = {}
DIFFERING = 1 << 14


def _differing(key: str, dfa: ByteDFA, a: int, b: int) -> list[tuple[int, int, int]]:
    """(byte, a's target, b's target) for the bytes on which states a and b move apart (-1: no move);
    cached: a name's later states are met again from the walks of the states before them."""
    found = _differing_cache.get((key, a, b))
    if found is None:
        row_a, row_b = dfa.transitions[a], dfa.transitions[b]
        differ = np.flatnonzero(row_a != row_b)
        found = list(zip(differ.tolist(), row_a[differ].tolist(), row_b[differ].tolist()))
        if len(_differing_cache) >= DIFFERING:
            _differing_cache.clear()
        _differing_cache[key, a, b] = found
    return found


MAX_PAIRS = 64  # pairs of states followed by bytes_apart, at most
MAX_REREAD = 4096  # tokens read again from the state, at most
LOOPS = 4  # other states tried as the one to read like, at most


_loops: dict[str, list[int]] = {}
LOOPS_KEPT = 1 << 12


def loops(key: str, dfa: ByteDFA, state: int) -> list[int]:
    """States other than `state` most of whose bytes lead back to themselves (string bodies: a pattern
    key's state once its pattern has matched), at most LOOPS; the terminal's are found once."""
    found = _loops.get(key)
    if found is None:
        found = []
        trans = dfa.transitions  # only states with a byte back to themselves can be one (most of a large DFA's)
        candidates = np.flatnonzero((trans == np.arange(len(trans))[:, None]).any(axis=1)).tolist() \
            if isinstance(trans, np.ndarray) else range(dfa.num_states)
        for q in candidates:
            if _most_common(state_row(key, dfa, q)[1]) == q:
                found.append(q)
                if len(found) > LOOPS:
                    break
        if len(_loops) >= LOOPS_KEPT:
            _loops.clear()
        _loops[key] = found
    return [q for q in found if q != state][:LOOPS]


def bytes_apart(dfa: ByteDFA, state: int, other: int) -> np.ndarray | None:
    """bool [256]: the bytes on which the automaton run from `state` and from `other` together may stop
    agreeing (one alive and not the other, or both alive and one accepting); None past MAX_PAIRS pairs of
    states. A token none of whose bytes is one of these is read alike from both: alive through the same
    bytes, accepting after the same ones, so it has the same classes (inside, or exits with the same
    suffixes). Before a pattern key's pattern matches, its state reads like the string body's except on
    `"`, which the body may close on and it may not."""
    trans, accepting = dfa.transitions, dfa.accepting
    bad = np.zeros(256, dtype=bool)
    seen = {(state, other)}
    pairs = [(state, other)]
    while pairs:  # breadth first, a level of pairs at once
        rows_a, rows_b = trans[[a for a, _ in pairs]], trans[[b for _, b in pairs]]
        alive_a, alive_b = rows_a >= 0, rows_b >= 0
        both = alive_a & alive_b
        bad |= ((alive_a != alive_b) | both & (accepting[rows_a] != accepting[rows_b])).any(axis=0)
        # Where they go on agreeing, to states of their own. Bytes already apart are not followed: every
        # token containing one is read again anyway.
        on = both & ~bad & (rows_a != rows_b)
        pairs = list(set(zip(rows_a[on].tolist(), rows_b[on].tolist())) - seen)
        seen.update(pairs)
        if len(seen) > MAX_PAIRS:
            return None
    return bad


_with: dict[tuple[str, bytes], tuple[np.ndarray, np.ndarray, np.ndarray] | None] = {}
WITH_KEPT = 256


def tokens_with(vocab: TokenVocab, found: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The tokens containing one of the bytes `found` (bool [256]): their ids (int64, sorted), and their
    bytes as one matrix with their lengths (vocab.byte_matrix); None past MAX_REREAD. Cached per set of
    bytes: most states read again have the same (`"`)."""
    key = (vocab.fingerprint, np.packbits(found).tobytes())
    if key in _with:
        return _with[key]
    ids, ptr = vocab.tokens_by_byte
    groups = [ids[ptr[b]:ptr[b + 1]] for b in np.flatnonzero(found).tolist()]
    if sum(map(len, groups)) > MAX_REREAD:
        tokens = None
    else:
        marked = np.zeros(vocab.size, dtype=bool)  # cheaper than sorting them together
        for group in groups:
            marked[group] = True
        chosen = np.flatnonzero(marked)
        tokens = (chosen, *byte_matrix([vocab.token_bytes[i] for i in chosen.tolist()]))
    if len(_with) >= WITH_KEPT:
        _with.clear()
    _with[key] = tokens
    return tokens


def read_from(dfa: ByteDFA, state: int, tokens: tuple[np.ndarray, np.ndarray, np.ndarray]
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The classes from `state` of `tokens` (tokens_with's), as the trie walk gives them: (ids alive through
    their last byte; the others' exits, as token ids and where their suffix starts: after each of their
    first j >= 1 bytes, short of the last, at which the automaton is alive and accepting)."""
    ids, mat, lens = tokens
    rows, cur = np.arange(len(ids)), np.full(len(ids), state, dtype=np.int64)
    ended, exit_rows, exit_starts = [], [np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=np.int64)]
    for j in range(mat.shape[1] + 1):
        more = lens[rows] > j
        ended.append(rows[~more])  # read through their last byte, alive
        rows, cur = rows[more], cur[more]
        if j:
            at = rows[dfa.accepting[cur]]
            exit_rows.append(at)
            exit_starts.append(np.full(len(at), j, dtype=np.int64))
        if not len(rows):
            break
        cur = dfa.transitions[cur, mat[rows, j]].astype(np.int64)
        rows, cur = rows[cur >= 0], cur[cur >= 0]
    inside = np.zeros(len(ids), dtype=bool)
    inside[np.concatenate(ended)] = True
    exit_rows, exit_starts = np.concatenate(exit_rows), np.concatenate(exit_starts)
    uncertain = ~inside[exit_rows]
    return ids[inside], ids[exit_rows[uncertain]], exit_starts[uncertain]
