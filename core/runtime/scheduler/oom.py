"""Out of memory in a step (a CUDA `torch.OutOfMemoryError` or the host's `MemoryError`): the step's
requests go back to wait, holding only KV that is known computed (their prefix in the radix cache),
and the running batch is capped at half their number; the cap doubles back after every
RESTORE_AFTER steps that succeed. Retracted requests resume where they were (their prefix is
cached), so their greedy (or seeded) output is the one they would have had. A request whose step
fails alone twice in a row cannot run at all: it ends with HTTP 507 (code out_of_memory)."""

from __future__ import annotations

import logging

import torch

from radixlm.core.runtime.request import Req, Status
from radixlm.core.runtime.scheduler.finish import Finish
from radixlm.core.runtime.scheduler.memory import KVMemory
from radixlm.core.runtime.scheduler.prefill import PrefillPlanner
from radixlm.core.runtime.scheduler.queues import RequestQueues

logger = logging.getLogger("radixlm")

RESTORE_AFTER = 32  # successful steps before a cap set by an out-of-memory step doubles
ALONE_MESSAGE = "out of memory: this request cannot run even alone on this server (a smaller prompt or " \
                "max_new_tokens may fit)"


def is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, (MemoryError, torch.OutOfMemoryError))


class OOMRecovery:
    def __init__(self, queues: RequestQueues, memory: KVMemory, planner: PrefillPlanner) -> None:
        self.queues = queues
        self.memory = memory
        self.planner = planner
        self.max_running = planner.max_running_requests  # the configured cap, restored in steps
        self._alone: Req | None = None  # the request whose step last failed with nobody else in it
        self._good_steps = 0

    def recover(self, exc: BaseException) -> None:
        """After a step ran out of memory (the pending step already dropped): retracts the step's
        requests, or ends the one that failed alone twice."""
        queues = self.queues
        reqs = list(dict.fromkeys([*queues.running, *queues.admitting, *([queues.chunked] if queues.chunked else [])]))
        reqs = [r for r in reqs if not r.finished]
        for req in reqs:  # what the failed step allocated holds no computed KV: never cache it
            extra = req.slots[req.cached_len:]
            del req.slots[req.cached_len:]
            self.memory.allocator.free(extra)
        if len(reqs) == 1 and reqs[0] is self._alone:
            logger.error("request %s ran out of memory alone twice (%s); ending it", reqs[0].rid, exc)
            self._alone = None
            queues.admitting = []
            queues.finish(reqs[0], Finish("abort"), error=ALONE_MESSAGE, status_code=507)
            return
        self._alone = reqs[0] if len(reqs) == 1 else None
        cap = max(1, len(reqs) // 2)
        logger.warning("a step of %d requests ran out of memory (%s); retrying them at most %d at a time",
                       len(reqs), exc, cap)
        for req in reqs:
            self.memory.release(req)
            req.status = Status.WAITING
        queues.running, queues.admitting, queues.chunked = [], [], None
        queues.waiting[:0] = sorted(reqs, key=lambda r: r.arrival)
        queues.stats.retractions_total += len(reqs)
        self.planner.max_running_requests = min(self.planner.max_running_requests, cap)
        self._good_steps = 0

    def step_succeeded(self) -> None:
        self._alone = None
        if self.planner.max_running_requests >= self.max_running:
            return
        self._good_steps += 1
        if self._good_steps >= RESTORE_AFTER:
            self._good_steps = 0
            self.planner.max_running_requests = min(self.max_running, 2 * self.planner.max_running_requests)
