"""Calls from the output thread onto an event loop, batched: every call posted before the loop gets to
them runs in one callback, for one wake-up of the loop (call_soon_threadsafe: a handle and a write to its
self-pipe) rather than one per call. With 200 streams, a step's 200 outputs then cost a busy loop one
callback and the output thread one write, not 200 of each."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Callable

logger = logging.getLogger("radixlm")


class LoopMailbox:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._calls: list[tuple[Callable[[Any], None], Any]] = []

    def post(self, fn: Callable[[Any], None], arg: Any) -> None:
        """Runs fn(arg) on the loop, after the calls posted before it (any thread)."""
        with self._lock:
            self._calls.append((fn, arg))
            if len(self._calls) > 1:
                return  # a wake-up is already on its way: it runs this call too
        self.loop.call_soon_threadsafe(self._run)

    def _run(self) -> None:
        with self._lock:
            calls, self._calls = self._calls, []
        for fn, arg in calls:
            try:
                fn(arg)
            except Exception:  # one receiver's failure is its own: the others still get theirs
                logger.exception("a call posted to the event loop failed")
