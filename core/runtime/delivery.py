"""The call/reply pump between callers and the scheduler: requests queued with the sink each one's
outputs go to, the scheduler's outbox drained on one thread (outputs to their sinks as output dicts,
call replies to their waiting callers, statistics to the scheduler client), aborts that reach every
sample of an n > 1 request, and the failure of everything in flight when the scheduler stops."""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from radixlm.core.errors import EngineDeadError, EngineShutdownError, InvalidRequestError, QueueFullError
from radixlm.core.runtime.branches import branch_parent
from radixlm.core.runtime.messages import Abort, Call, CallReply, GenerateOutput, GenerateRequest, StatsSnapshot
from radixlm.core.runtime.options import EngineOptions

logger = logging.getLogger("radixlm")

Output = dict[str, Any]
Sink = Callable[[Any], None]  # takes an output dict, or the exception that ends the request


@dataclass(eq=False)
class _Pending:
    """A request in flight: where its outputs go."""

    req: GenerateRequest
    sink: Sink


class Delivery:
    def __init__(self, scheduler: Any, opts: EngineOptions) -> None:
        self.scheduler = scheduler  # a LocalScheduler or SchedulerProcess (core.runtime.scheduler_client)
        self.options = opts
        self._lock = threading.Lock()  # the tables below: callers' threads add, the drain thread removes
        self._pending: dict[str, _Pending] = {}
        self._branches: dict[str, list[str]] = {}  # rid given by the caller -> its n > 1 branch ids
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count(1)
        self._closed = False
        self._drain = threading.Thread(target=self._drain_outbox, name="radixlm-outputs", daemon=True)
        self._drain.start()

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def check_open(self) -> None:
        if self._closed:
            raise EngineShutdownError("the engine has been shut down")
        if not self.scheduler.alive():
            raise EngineDeadError("the engine's scheduler has died")

    def alive(self) -> bool:
        """Whether requests are taken: not closed and the scheduler loop running."""
        return not self._closed and self.scheduler.alive()

    def fail_in_flight(self) -> None:
        """When the scheduler has died: every request in flight fails now (the drain thread does the same
        within a second of noticing, unless it is stuck reading a message the dead process half wrote)."""
        if not self.scheduler.alive():
            self._fail_all(EngineDeadError("the engine's scheduler died before the request finished"))

    def close(self) -> None:
        """Stops the scheduler (which ends what is in flight with an abort output), then the drain thread."""
        if self._closed:
            return
        self._closed = True
        was_alive = self.scheduler.alive()
        self.scheduler.stop()
        if was_alive:  # (a killed scheduler process may hold its outbox's write lock forever: no put then;
            self.scheduler.outbox.put(None)  # the drain thread sees it gone within a second)
        self._drain.join(timeout=30)

    def abort(self, rid: str) -> None:
        """Aborts the request `rid`, or all n branches of the request the caller named `rid`."""
        if self._closed:
            return
        with self._lock:
            rids = [rid, *self._branches.get(rid, ())]
        for r in rids:
            self.scheduler.inbox.put(Abort(r))

    def abort_all(self) -> None:
        """Aborts every request in flight; each ends with finish reason "abort" (SGLang's abort_all)."""
        if self._closed:
            return
        with self._lock:
            rids = list(self._pending)
        for r in rids:
            self.scheduler.inbox.put(Abort(r))

    def wait(self, box: queue.Queue, until: float | None = None) -> Output | None:
        """The next output a sink put on `box` (raising the request's exception); None once time.time()
        is past `until` with nothing there."""
        while True:
            try:
                out = box.get(timeout=1.0 if until is None else min(1.0, max(0.0, until - time.time())))
            except queue.Empty:
                if until is not None and time.time() >= until:
                    return None
                if not self._drain.is_alive():
                    raise EngineShutdownError("the engine stopped before the request finished") from None
                continue
            if isinstance(out, BaseException):
                raise out
            return out

    def call(self, msg: Call) -> Any:
        """Sends a FlushCache, GetStats or CheckInvariants and waits for the scheduler's reply."""
        self.check_open()
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            msg.call_id = next(self._call_ids)
            self._calls[msg.call_id] = future
        self.scheduler.inbox.put(msg)
        reply: CallReply = future.result()
        if reply.error is not None:
            raise reply.error
        return reply.value

    def submit(self, reqs: list[GenerateRequest], sinks: list[Sink]) -> None:
        """Queues the requests; each one's outputs (dicts), or the exception that ends it, go to its sink
        on the drain thread."""
        bound = self.options.max_queued_requests
        rids = [r.rid for r in reqs]
        self.check_open()
        with self._lock:
            if bound is not None and len(self._pending) + len(reqs) > bound + self.options.max_running_requests:
                raise QueueFullError(f"the request queue is full ({bound} waiting); retry later")
            clash = next((r for r in rids if r in self._pending), None)
            if clash is None and len(set(rids)) < len(rids):
                clash = next(r for r in rids if rids.count(r) > 1)
            if clash is not None:
                raise InvalidRequestError(f"request id {clash!r} is already in use by a request in flight", "rid")
            for req, sink in zip(reqs, sinks):
                self._pending[req.rid] = _Pending(req, sink)
            for rid in rids:
                parent = branch_parent(rid)
                if parent is not None:
                    self._branches.setdefault(parent, []).append(rid)
        for req in reqs:
            self.scheduler.inbox.put(req)

    # ---- the scheduler's outbox, drained on one thread ----------------------------------------

    def _drain_outbox(self) -> None:
        outbox = self.scheduler.outbox
        while True:
            try:
                msg = outbox.get(timeout=1.0)
            except queue.Empty:
                if self.scheduler.alive():
                    continue
                break  # the scheduler died: fail what is left (below)
            if msg is None:
                break
            try:
                self._dispatch(msg)
            except Exception:  # one output's failure must not stop the others being delivered
                logger.exception("delivering a scheduler message failed")
        if self._closed:
            self._fail_all(EngineShutdownError("the engine stopped before the request finished"))
        else:
            self._fail_all(EngineDeadError("the engine's scheduler died before the request finished"))

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, GenerateOutput):
            self._deliver(msg)
        elif isinstance(msg, CallReply):
            with self._lock:
                future = self._calls.pop(msg.call_id, None)
            if future is not None:
                future.set_result(msg)
        elif isinstance(msg, StatsSnapshot):
            self.scheduler.observe(msg)

    def _deliver(self, out: GenerateOutput) -> None:
        with self._lock:
            pending = self._pending.get(out.rid)
            if pending is not None and out.finish is not None:
                del self._pending[out.rid]
                self._forget_branch(out.rid)
        if pending is None:
            return
        try:
            pending.sink(output_dict(out, pending.req))
        except Exception:  # the receiver's failure is its own; nobody else's output may depend on it
            logger.exception("request %s: delivering its output failed", out.rid)

    def _forget_branch(self, rid: str) -> None:
        parent = branch_parent(rid)
        branches = self._branches.get(parent) if parent is not None else None
        if branches is not None and rid in branches:
            branches.remove(rid)
            if not branches:
                del self._branches[parent]

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
            calls, self._calls = list(self._calls.values()), {}
            self._branches.clear()
        for p in pending:
            try:
                p.sink(error)
            except Exception:
                logger.exception("request %s: delivering its failure failed", p.req.rid)
        for future in calls:
            future.set_exception(error)


def output_dict(out: GenerateOutput, req: GenerateRequest) -> Output:
    """The output in the shape of SGLang's Engine.generate (what users of radixlm.Engine read)."""
    finish = out.finish
    meta: dict[str, Any] = {
        "id": out.rid,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "cached_tokens": out.cached_tokens,
        "finish_reason": None if finish is None else {"type": finish.type, "matched": finish.matched},
    }
    if finish is not None and finish.status_code is not None:
        meta["finish_reason"]["status_code"] = finish.status_code
    if req.return_logprob:
        meta["input_token_logprobs"] = out.input_token_logprobs
        meta["input_top_logprobs"] = out.input_top_logprobs
        meta["output_token_logprobs"] = out.output_token_logprobs
        meta["output_top_logprobs"] = out.output_top_logprobs
    if out.e2e_latency is not None:
        meta["e2e_latency"] = out.e2e_latency
        meta["ttft"] = out.ttft
    if out.queue_time is not None:
        meta["queue_time"] = out.queue_time
    if finish is not None and finish.error is not None:
        meta["error"] = finish.error
    if out.replaced:
        meta["replaced_ids"] = out.replaced  # a stream chunk whose ids replace that many sent ones
    if out.dp_rank is not None:
        meta["dp_rank"] = out.dp_rank
    if out.spec_verify_ct is not None:
        meta["spec_verify_ct"] = out.spec_verify_ct
        meta["spec_accepted_tokens"] = out.spec_accepted_tokens
        # Tokens per verify step: the accepted draft tokens plus the target's own (SGLang's name).
        meta["spec_accept_length"] = 1.0 + out.spec_accepted_tokens / out.spec_verify_ct if out.spec_verify_ct else 0.0
    return {"text": out.text, "output_ids": out.output_ids, "meta_info": meta}


def merge_chunks(first: Output, then: Output) -> Output:
    """Two consecutive stream chunks of one request as one, as if sent together: texts, new ids and their
    logprobs joined (`then`'s `replaced_ids` taken off `first`'s ids first, the rest carried over),
    everything else `then`'s."""
    meta_a, meta_b = first["meta_info"], then["meta_info"]
    ids, replaced = first["output_ids"], meta_a.get("replaced_ids", 0)
    drop = meta_b.get("replaced_ids", 0)
    if drop:
        kept = max(len(ids) - drop, 0)
        replaced += drop - (len(ids) - kept)
        ids = ids[:kept]
    meta = dict(meta_b)
    for key in ("output_token_logprobs", "output_top_logprobs"):
        if key in meta_b:
            meta[key] = meta_a[key] + meta_b[key]
    meta.pop("replaced_ids", None)
    if replaced:
        meta["replaced_ids"] = replaced
    return {**then, "text": first["text"] + then["text"], "output_ids": ids + then["output_ids"], "meta_info": meta}
