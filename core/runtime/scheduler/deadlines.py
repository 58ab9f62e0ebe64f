"""Requests' deadlines, in the order they fall due: the loop ends each request still in flight at its
deadline (finish reason abort, HTTP 408, its KV given back) before the next step."""

from __future__ import annotations

import heapq
import itertools

from radixlm.core.runtime.request import Req


class Deadlines:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Req]] = []
        self._order = itertools.count()  # ties: arrival order (Req does not compare)
        self._prune_at = 1024  # finished requests are dropped when the heap grows past this

    def add(self, req: Req) -> None:
        if req.inp.deadline is None:
            return
        heapq.heappush(self._heap, (req.inp.deadline, next(self._order), req))
        if len(self._heap) > self._prune_at:  # amortized O(1): requests that finished early go
            self._heap = [e for e in self._heap if not e[2].finished]
            heapq.heapify(self._heap)
            self._prune_at = max(1024, 2 * len(self._heap))

    def due(self, now: float) -> list[Req]:
        """The requests whose deadline has passed and that have not finished (finished ones are dropped)."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            req = heapq.heappop(self._heap)[2]
            if not req.finished:
                out.append(req)
        return out

    def __len__(self) -> int:
        return len(self._heap)
