"""Where each request is (waiting, running, midway through a chunked prefill) and how it moves:
admitted, put back to wait (retracted, or after a jump forward), finished.

Finishing a request takes it out of every queue, gives its KV to the radix cache and sends its final
output; nothing else ends a request.
"""

from __future__ import annotations

import logging
import queue
from typing import Any

from radixlm.core.runtime.request import Req, Status
from radixlm.core.runtime.scheduler.finish import Finish
from radixlm.core.runtime.scheduler.memory import KVMemory
from radixlm.core.runtime.scheduler.output import emit
from radixlm.core.runtime.stats import EngineStats

logger = logging.getLogger("radixlm")


class RequestQueues:
    def __init__(self, memory: KVMemory, stats: EngineStats) -> None:
        self.memory = memory
        self.stats = stats
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked: Req | None = None  # a request midway through a chunked prefill
        # The requests the current prefill step took from `waiting` (KV allocated, not yet running): in
        # flight, so that a step that fails before they run still answers them and frees their KV.
        self.admitting: list[Req] = []
        self.live: dict[str, Req] = {}  # rid -> request not finished: aborts find theirs in O(1)
        self._waiting_has_finished = False  # finished requests left in `waiting`, dropped in one pass
        self.outbox: Any = queue.Queue()  # where outputs go (core.runtime.messages.GenerateOutput)

    def busy(self) -> bool:
        return bool(self.waiting or self.running or self.chunked)

    def in_flight(self) -> list[Req]:
        """Every request not finished, including any finished-but-not-yet-swept waiting ones."""
        return [*self.waiting, *self.running, *([self.chunked] if self.chunked else []), *self.admitting]

    def holding_kv(self) -> list[Req]:
        """The requests that own KV slots: running, chunked, and waiting ones with jumped tokens to compute."""
        jumped = [r for r in self.waiting if r.row is not None]
        return [*self.running, *([self.chunked] if self.chunked else []), *jumped]

    def sweep(self) -> None:
        if self._waiting_has_finished:
            self.waiting = [r for r in self.waiting if not r.finished]
            self._waiting_has_finished = False

    def add(self, req: Req) -> bool:
        """Queues a new request; False (the request finished with an error) when its id is taken."""
        self.waiting.append(req)
        if req.rid in self.live:  # the Engine refuses these; a front end that does not must not hijack one
            self.finish(req, Finish("abort"), error=f"request id {req.rid!r} is already in use", status_code=400)
            return False
        self.live[req.rid] = req
        return True

    def take(self, taken: list[Req], passed_over: list[Req]) -> None:
        """Moves the requests a prefill plan took out of the waiting queue; the others were passed over."""
        for req in passed_over:
            req.passed_over += 1
        ids = {id(r) for r in taken}
        self.waiting = [r for r in self.waiting if id(r) not in ids]
        self.admitting = taken

    def requeue(self, req: Req, retracted: bool) -> None:
        """A running request waits again, first in line: retracted (its KV released), or keeping its KV
        to compute tokens a jump forward appended (the planner allocates only for the new ones)."""
        self.running.remove(req)
        req.status = Status.WAITING
        if retracted:
            self.stats.retractions_total += 1
        self.waiting.insert(0, req)

    def finish(self, req: Req, finish: Finish, error: str | None = None, status_code: int | None = None) -> None:
        """Ends the request, gives its KV to the cache and sends its final output. An `error` goes to the
        client; with a `status_code` (a failure rather than an abort) the server answers with that status."""
        req.finish_type, req.finish_matched = finish.kind, finish.matched
        req.error, req.error_status = error, status_code
        if req.status is Status.WAITING:
            self._waiting_has_finished = True  # removed before the next step: O(1) per abort
        elif req in self.running:
            self.running.remove(req)
        if self.chunked is req:
            self.chunked = None
        if self.live.get(req.rid) is req:
            del self.live[req.rid]
        self.memory.release(req)
        req.status = Status.FINISHED
        self.stats.record_finish(req)
        emit(req, self.outbox, final=True)

    def fail(self, req: Req, stage: str) -> None:
        """Ends one request whose own work raised (call it in the `except` block); the others go on. Its
        client gets an error naming the stage, never the exception's text (that goes to the log)."""
        logger.exception("request %s failed while %s; ending it alone", req.rid, stage)
        if not req.finished:
            self.finish(req, Finish("abort"), error=f"generation failed while {stage} (a server error; the "
                                                    "server log has the details)", status_code=500)

    def abort(self, rid: str, why: str) -> None:
        req = self.live.get(rid)
        if req is not None:
            self.finish(req, Finish("abort"), error=why)

    def abort_all(self, why: str, status_code: int | None = None) -> None:
        for req in self.in_flight():
            if not req.finished:
                try:
                    self.finish(req, Finish("abort"), error=why, status_code=status_code)
                except Exception:  # a broken request must not keep the others from being answered
                    # finish() took it out of the queues before the KV release that raised.
                    logger.exception("could not finish request %s cleanly; its KV is left as it is", req.rid)
                    req.status = Status.FINISHED
                    try:  # its caller waits for a final output: without one it would wait forever
                        emit(req, self.outbox, final=True)
                    except Exception:
                        logger.exception("could not answer request %s", req.rid)
