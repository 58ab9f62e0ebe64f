"""The compressed FSM (SGLang paper, §4 and appendix B.1): chains of singular transitions as one edge.

A state is singular when it does not accept and exactly one byte leaves it. A chain of singular states
spells a string the output must contain next, whatever the model prefers; jump-forward appends that
string in one extend step instead of decoding it token by token. Here each state's compressed edge is
(forced bytes, the state at the chain's end), computed once per state on first use.
"""

from __future__ import annotations

import numpy as np

from radixlm.core.constrained.regex_dfa import ByteDFA


class CompressedFSM:
    def __init__(self, dfa: ByteDFA) -> None:
        has_edge = dfa.transitions >= 0
        singular = (has_edge.sum(axis=1) == 1) & ~dfa.accepting
        only_byte = np.argmax(has_edge, axis=1)
        # Per state: the forced next byte, or -1; and where it leads.
        self._byte = np.where(singular, only_byte, -1).tolist()
        self._next = dfa.transitions[np.arange(dfa.num_states), only_byte].tolist()
        self._edges: dict[int, tuple[bytes, int]] = {}
        self._texts: dict[int, str | None] = {}

    def edge(self, state: int) -> tuple[bytes, int]:
        """(forced bytes from `state`, the state after them); (b"", state) when the next byte is free."""
        found = self._edges.get(state)
        if found is not None:
            return found
        path, s = [], state
        while self._byte[s] >= 0:  # a singular chain always ends: its states reach an accepting one
            path.append(s)
            s = self._next[s]
        end, suffix = s, b""
        for p in reversed(path):  # every state on the chain gets its own (shorter) edge too
            suffix = bytes([self._byte[p]]) + suffix
            self._edges[p] = (suffix, end)
        self._edges.setdefault(state, (b"", state))
        return self._edges[state]

    def forced_text(self, state: int) -> str | None:
        """The forced string from `state`, cut to whole UTF-8 characters; None if there is none."""
        if state in self._texts:
            return self._texts[state]
        text = self._texts[state] = whole_characters(self.edge(state)[0])
        return text


def whole_characters(data: bytes) -> str | None:
    """`data` cut to whole UTF-8 characters (a forced edge may end inside one), or None if nothing is left."""
    for cut in range(len(data), max(len(data) - 4, 0), -1):
        try:
            return data[:cut].decode() or None
        except UnicodeDecodeError:
            continue
    return None
