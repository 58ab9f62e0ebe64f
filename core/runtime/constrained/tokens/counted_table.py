"""The transition table of a long counted string (counted_string.py), computed from the state number.

A string of up to 32,767 characters (a common `maxLength`) has ~460k counted states: as a stored
[states, 256] int32 table that is ~470 MB. The table is periodic: state 1 + i * width + j is "i characters
written, j bytes into the next one", and its moves are the character DFA's move from j, shifted to
position i (or i + 1 where the move ends the character), the closing quote at a character boundary once i
reaches lo, nothing past hi. So a long counted string keeps only the character DFA's moves ([width, 256])
and computes a move, a row or a batch of moves from the state number: `CountedTable` answers the indexing
the parser and the token walks use on a numpy table (`t[q, b]`, `t[q]`, `t[states]`, `t[states, bytes]`).
"""

from __future__ import annotations

import numpy as np

QUOTE = ord('"')


class CountedTable:
    """The [num_states, 256] int32 move table of counted_string_dfa(lo, hi) (-1 = no move), not stored.

    `slot[j, b]`: the slot (bytes into the character) the character DFA's move from slot j on byte b
    reaches inside the character, -1 if none; `ends[j, b]`: whether that move ends the character."""

    def __init__(self, slot: np.ndarray, ends: np.ndarray, lo: int, hi: int | None, num_states: int) -> None:
        self.slot, self.ends = slot.astype(np.int64), ends.astype(bool)
        self.width = slot.shape[0]
        self.lo, self.hi, self.num_states = lo, hi, num_states
        self.cap = lo if hi is None else hi  # positions told apart; unbounded strings loop at lo
        self.final = num_states - 1
        # The scalar path's rows, as tuples: the cyclic collector stops tracking tuples of ints, where it would
        # walk lists of them (256 referents per row) at every full collection, inside whichever mask it lands.
        self._slot_rows = tuple(map(tuple, self.slot.tolist()))
        self._ends_rows = tuple(map(tuple, self.ends.tolist()))

    def __len__(self) -> int:
        return self.num_states

    @property
    def shape(self) -> tuple[int, int]:
        return self.num_states, 256

    def __getitem__(self, index):
        if isinstance(index, tuple):
            states, data = index
            if isinstance(states, (int, np.integer)) and isinstance(data, (int, np.integer)):
                return self.move(int(states), int(data))
            return self.moves(np.asarray(states), np.asarray(data))
        states = np.asarray(index)
        return self.moves(states[..., None], np.arange(256))

    def move(self, state: int, b: int) -> int:
        """The state after byte b from `state`, -1 if none."""
        if state == 0:
            return 1 if b == QUOTE else -1
        if state >= self.final:
            return -1
        i, j = divmod(state - 1, self.width)
        if j == 0 and b == QUOTE:
            return self.final if i >= self.lo else -1
        if self.hi is not None and i >= self.hi:
            return -1
        if self._ends_rows[j][b]:
            return 1 + (i + 1 if self.hi is not None else min(i + 1, self.cap)) * self.width
        to = self._slot_rows[j][b]
        return 1 + i * self.width + to if to >= 0 else -1

    def moves(self, states: np.ndarray, data: np.ndarray) -> np.ndarray:
        """move() over broadcast arrays of states and bytes, as int32."""
        s, b = np.broadcast_arrays(states.astype(np.int64), data.astype(np.int64))
        i, j = np.divmod(np.maximum(s - 1, 0), self.width)
        after = i + 1 if self.hi is not None else np.minimum(i + 1, self.cap)
        to = self.slot[j, b]
        out = np.where(self.ends[j, b], 1 + after * self.width, np.where(to >= 0, 1 + i * self.width + to, -1))
        if self.hi is not None:
            out[i >= self.hi] = -1
        quote = (j == 0) & (b == QUOTE)
        out = np.where(quote, np.where(i >= self.lo, self.final, -1), out)
        out = np.where(s == 0, np.where(b == QUOTE, 1, -1), out)
        out[s >= self.final] = -1
        return out.astype(np.int32)

    def stored(self) -> np.ndarray:
        """The whole table, as self[np.arange(num_states)] gives it, built from one row per slot shifted
        per position (two passes over the table instead of move()'s dozen: ~10x faster)."""
        n, w = self.num_states, self.width
        out = np.full((n, 256), -1, dtype=np.int32)
        out[0, QUOTE] = 1
        full = self.cap if self.hi is not None else self.cap + 1  # positions with all their slots
        rel = np.where(self.ends, w, self.slot).astype(np.int32)  # the target less 1 + i * width
        i = np.arange(full, dtype=np.int32)
        block = np.where((self.ends | (self.slot >= 0))[None], rel[None] + (1 + i * w)[:, None, None], -1)
        if self.hi is None:  # the last position loops: a character ended there stays at position cap
            block[-1][self.ends] -= w
        block[:, 0, QUOTE] = np.where(i >= self.lo, self.final, -1)
        out[1:1 + full * w] = block.reshape(full * w, 256)
        if self.hi is not None:  # position hi: its boundary, where only the closing quote goes on
            out[1 + self.hi * w, QUOTE] = self.final if self.hi >= self.lo else -1
        return out
