"""Python's cyclic garbage collector in a serving process: the heap alive once the engine has started
moved out of its generations, and every collection's pause counted (and logged past a threshold).

A full collection traverses every tracked object, and a started engine holds ~200k of them (torch's and
transformers' modules, the tokenizer, the vocabulary's grammar tables) that live as long as it does: a
full collection then costs ~80-100 ms of CPU, the whole process (the scheduler loop included) paused, every
request's next token with it; overlap scheduling cannot hide that. They run whenever enough objects
outlive the young generations (requests live for seconds). Frozen (gc.freeze), the startup heap is
skipped by every collection: reference counting still frees it, only cycles among it wait for the engine's
shutdown (gc.unfreeze). vLLM freezes its engine's startup heap the same way.
"""

from __future__ import annotations

import gc
import logging
import sys
import threading
import time
from typing import Any

logger = logging.getLogger("radixlm")

GENERATIONS = 3


_frozen = 0  # objects in the permanent generation when last counted (gc.get_freeze_count walks them all)


def freeze_heap() -> None:
    """Collects what is garbage now, then moves every object still alive to the permanent generation."""
    global _frozen
    gc.collect()
    gc.freeze()
    _frozen = gc.get_freeze_count()


def unfreeze_heap() -> None:
    """Back into the oldest generation: a dropped engine's cycles become collectable again."""
    global _frozen
    gc.unfreeze()
    _frozen = 0


class GCPauses:
    """The process's collections per generation: how many, their seconds (wall: the time every thread
    stood still), the longest. One per process (`watch`), fed by a gc callback."""

    def __init__(self) -> None:
        self.collections = [0] * GENERATIONS
        self.seconds = [0.0] * GENERATIONS
        self.longest_s = 0.0
        self.warn_above_s = 0.0  # 0: no warnings
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        took = time.perf_counter() - self._started
        generation = info["generation"]
        self.collections[generation] += 1
        self.seconds[generation] += took
        self.longest_s = max(self.longest_s, took)
        if 0 < self.warn_above_s < took and not sys.is_finalizing():
            logger.warning("a garbage collection (generation %d, %d objects collected) paused the process for "
                           "%.0f ms (gc_warning_threshold_ms)", generation, info["collected"], took * 1e3)

    def snapshot(self) -> dict[str, Any]:
        """Per generation (lists of 3): collections and their seconds; the longest; the objects frozen as of the
        last freeze (counting them now would walk them all, and the loop publishes stats every iteration)."""
        return {"collections_total": list(self.collections), "pause_seconds_total": list(self.seconds),
                "longest_pause_s": self.longest_s, "frozen_objects": _frozen}


_pauses: GCPauses | None = None
_lock = threading.Lock()


def watch(warn_above_ms: float) -> GCPauses:
    """The process's GCPauses, its callback installed on first use; warnings past `warn_above_ms` (0: none)."""
    global _pauses
    with _lock:
        if _pauses is None:
            _pauses = GCPauses()
            gc.callbacks.append(_pauses)
        _pauses.warn_above_s = warn_above_ms / 1e3
        return _pauses
