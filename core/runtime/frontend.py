"""The request front end: a caller's generate call, from its arguments to its outputs, sync and async,
one output, a list, or a stream (of a batch and of n > 1 samples too). Each job is its own part:

- `RequestBuilder` (request_builder.py): tokenizing, checks, images, splitting `n` into requests;
- `PrepareWorkers` (prepare_workers.py): the threads and time budget that preparation runs under;
- `ConstraintCompiler` (constraint_compiler.py): constraint specs compiled once, to refuse a bad one
  before anything is queued;
- `Delivery` (delivery.py): the call/reply pump to the scheduler and back.

Outputs arrive with their text: detokenizing and stop strings are the scheduler's (one detokenizer per
request, on the side that must stop at a stop string).
"""

from __future__ import annotations

import asyncio
import functools
import queue
import time
import weakref
from typing import Any, AsyncIterator, Callable, Iterator

from radixlm.core.runtime.constraint_compiler import ConstraintCompiler
from radixlm.core.runtime.deadline import caller_limit, deadline_of, seconds_left, timeout_output
from radixlm.core.runtime.delivery import Delivery, Output, Sink, merge_chunks, output_dict
from radixlm.core.runtime.images import ImagePreparer
from radixlm.core.runtime.loop_mailbox import LoopMailbox
from radixlm.core.runtime.messages import CheckInvariants, FlushCache, GenerateRequest, GetStats
from radixlm.core.runtime.options import EngineOptions
from radixlm.core.runtime.prepare_workers import PrepareWorkers
from radixlm.core.runtime.request_builder import RequestBuilder

# Prompts up to this many characters (or token ids) in all are prepared on the event loop itself.
_SMALL_PROMPT = 4096


class FrontEnd:
    def __init__(self, tokenizer: Any, opts: EngineOptions, vocab_size: int, context_len: int,
                 eos_token_ids: list[int], scheduler: Any, images: ImagePreparer | None = None,
                 constraints: ConstraintCompiler | None = None) -> None:
        self.builder = RequestBuilder(tokenizer, opts, vocab_size, context_len, images)
        self.constraints = constraints or ConstraintCompiler(tokenizer, eos_token_ids, opts)
        self.constraints.prepare_in_background()
        self.workers = PrepareWorkers(opts.prepare_workers, opts.prepare_timeout)
        self.delivery = Delivery(scheduler, opts)
        self.request_timeout = opts.request_timeout  # the default deadline of a call (core.runtime.deadline)
        self._mailboxes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its LoopMailbox

    @property
    def scheduler(self) -> Any:
        """The scheduler client: a LocalScheduler or SchedulerProcess (core.runtime.scheduler_client)."""
        return self.delivery.scheduler

    @property
    def in_flight(self) -> int:
        return self.delivery.in_flight

    def close(self) -> None:
        self.constraints.close()
        self.workers.close()
        self.delivery.close()

    # ---- generation ------------------------------------------------------------------------

    def generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                 logprob_start_len=None, top_logprobs_num=0, stream=False, rid=None, image_data=None,
                 video_data=None, timeout=None):
        deadline = deadline_of(timeout, self.request_timeout)  # counted from the call
        reqs, single = self.prepare(prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
                                    top_logprobs_num, stream, rid, image_data, video_data)  # on the caller's own thread
        _set_deadline(reqs, deadline)
        kind = _constraint_kind(reqs)
        if kind is not None:
            self.workers.compile(self.check_constraints, kind, reqs)
        if stream:
            return self._stream_sync(reqs)
        boxes: list[queue.Queue] = [queue.Queue(maxsize=1) for _ in reqs]
        self.delivery.submit(reqs, [box.put for box in boxes])
        until = caller_limit(deadline)
        outs = [self.delivery.wait(box, until) for box in boxes]
        outs = [self._timed_out(req) if out is None else out for req, out in zip(reqs, outs)]
        return outs[0] if single else outs

    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                             logprob_start_len=None, top_logprobs_num=0, stream=False, rid=None, image_data=None,
                             video_data=None, timeout=None):
        deadline = deadline_of(timeout, self.request_timeout)  # counted from the call
        args = (prompt, sampling_params, input_ids, return_logprob, logprob_start_len, top_logprobs_num, stream, rid,
                image_data, video_data)
        # Microseconds of work: less than a hop to a worker, and keeps arrival order (images are decoded: not small).
        if _is_small(prompt, input_ids) and image_data is None and video_data is None:
            reqs, single = self.prepare(*args)
        else:
            reqs, single = await self.workers.offload(self.prepare, *args)
        _set_deadline(reqs, deadline)
        kind = _constraint_kind(reqs)
        if kind is not None:
            await self.workers.compile_async(self.check_constraints, kind, reqs)
        if stream:
            return self._stream_async(reqs)
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in reqs]
        post = self._mailbox(loop).post
        self.delivery.submit(reqs, [lambda out, fut=fut: post(functools.partial(_set_result, fut), out) for fut in futures])
        try:
            await asyncio.wait(futures, timeout=seconds_left(caller_limit(deadline)))
        except asyncio.CancelledError:
            for req in reqs:
                self.abort_request(req.rid)
            raise
        outs = [fut.result() if fut.done() else self._timed_out(req) for req, fut in zip(reqs, futures)]
        return outs[0] if single else outs

    def _stream_sync(self, reqs: list[GenerateRequest]) -> Iterator[Output]:
        chunks: queue.Queue = queue.Queue()
        self.delivery.submit(reqs, _indexed_sinks(chunks.put, len(reqs)))
        until = caller_limit(reqs[0].deadline)

        def iterate() -> Iterator[Output]:
            stream = _StreamState(len(reqs))
            try:
                while stream.live:
                    chunk = self.delivery.wait(chunks, until)
                    if chunk is None or _past(until):
                        yield from self._end_overdue(reqs, stream, [chunk, *_drain(chunks)])
                        return
                    yield stream.noted(chunk)
            finally:
                for i in stream.live:  # the consumer stopped early: free the requests' memory
                    self.abort_request(reqs[i].rid)

        return iterate()

    async def _stream_async(self, reqs: list[GenerateRequest]) -> AsyncIterator[Output]:
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue = asyncio.Queue()
        post = self._mailbox(loop).post
        self.delivery.submit(reqs, _indexed_sinks(lambda item: post(chunks.put_nowait, item), len(reqs)))
        until = caller_limit(reqs[0].deadline)
        # Wakes a consumer waiting at the deadline; one that is behind notices when it takes its next chunk.
        timer = None if until is None else loop.call_later(seconds_left(until), chunks.put_nowait, None)
        stream = _StreamState(len(reqs))
        try:
            while stream.live:
                # Everything queued at once: a consumer that fell behind (a busy event loop) takes the
                # chunks queued meanwhile as one per request, not one per token.
                batch = [await chunks.get(), *_drain(chunks)]
                if any(c is None for c in batch) or _past(until):
                    for out in self._end_overdue(reqs, stream, batch):
                        yield out
                    return
                for chunk in _coalesced(batch):
                    if isinstance(chunk, BaseException):
                        raise chunk
                    yield stream.noted(chunk)
        finally:
            if timer is not None:
                timer.cancel()
            for i in stream.live:
                self.abort_request(reqs[i].rid)

    def _mailbox(self, loop: asyncio.AbstractEventLoop) -> LoopMailbox:
        """The loop's mailbox: the outputs of all its calls reach it batched (one wake-up per batch)."""
        mailbox = self._mailboxes.get(loop)
        if mailbox is None:
            mailbox = self._mailboxes[loop] = LoopMailbox(loop)
        return mailbox

    def _timed_out(self, req: GenerateRequest, completion_tokens: int = 0) -> Output:
        """The timeout ending of a request the scheduler has not ended by the caller's limit; aborted."""
        self.abort_request(req.rid)
        return output_dict(timeout_output(req, completion_tokens), req)

    def _end_overdue(self, reqs: list[GenerateRequest], stream: "_StreamState", queued: list[Any]) -> list[Output]:
        """A stream past its deadline ends now, without the token chunks still queued: each request the
        scheduler ended gets its ending (with its queued chunks when it ended by itself before the
        deadline), each other one a timeout ending here (and an abort)."""
        error = next((c for c in queued if isinstance(c, BaseException)), None)
        if error is not None:
            raise error
        got: dict[int, list[Output]] = {}
        for chunk in queued:
            if chunk is not None:
                got.setdefault(chunk["index"] if len(reqs) > 1 else 0, []).append(chunk)
        outs: list[Output] = []
        for i in sorted(stream.live):
            mine = got.get(i, [])
            reason = mine[-1]["meta_info"]["finish_reason"] if mine else None
            if reason is None:
                out = self._timed_out(reqs[i], stream.tokens[i])
                outs.append({**out, "index": i} if len(reqs) > 1 else out)
            else:
                outs.extend(mine[-1:] if reason.get("status_code") == 408 else mine)
        stream.live.clear()
        return outs

    def abort_request(self, rid: str) -> None:
        """Aborts the request `rid`, or all n branches of the request the caller named `rid`."""
        self.delivery.abort(rid)

    def abort_all(self) -> None:
        """Aborts every request in flight (each ends with finish reason "abort")."""
        self.delivery.abort_all()

    def alive(self) -> bool:
        """Whether the engine takes requests: not shut down and its scheduler loop running."""
        return self.delivery.alive()

    def fail_in_flight(self) -> None:
        """Once the scheduler has died: fails every request still waiting on it."""
        self.delivery.fail_in_flight()

    def flush_cache(self) -> bool:
        return self.delivery.call(FlushCache())

    def get_stats(self) -> dict[str, Any]:
        return self.delivery.call(GetStats())

    def check_invariants(self) -> None:
        self.delivery.call(CheckInvariants())

    # ---- the parts' work, for the Engine and for tests ----------------------------------------

    def prepare(self, *args: Any) -> tuple[list[GenerateRequest], bool]:
        """RequestBuilder.build on an open engine."""
        self.delivery.check_open()
        return self.builder.build(*args)

    def check_constraints(self, reqs: list[GenerateRequest]) -> None:
        """Compiles each distinct constraint spec once, on a compile thread, so that a bad pattern or
        schema fails before anything is queued; the scheduler's own build is then a cache hit."""
        self.constraints.check(r.constraint for r in reqs if r.constraint is not None)

    def submit(self, reqs: list[GenerateRequest], sinks: list[Sink]) -> None:
        self.delivery.submit(reqs, sinks)


def _indexed_sinks(put: Callable[[Any], None], count: int) -> list[Sink]:
    """Sinks that put each output (or the request's exception) on one queue, tagged with the request's
    index when there are several."""
    if count == 1:
        return [put]

    def sink_for(i: int) -> Sink:
        return lambda out: put(out if isinstance(out, BaseException) else {**out, "index": i})

    return [sink_for(i) for i in range(count)]


class _StreamState:
    """The requests of a stream that have not finished, and the tokens each one's caller was given."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.live = set(range(count))
        self.tokens = [0] * count

    def noted(self, chunk: Output) -> Output:
        """Notes what the chunk gives its request's caller (and that it ended, when it is the last)."""
        i = chunk["index"] if self.count > 1 else 0
        self.tokens[i] = chunk["meta_info"]["completion_tokens"]
        if chunk["meta_info"]["finish_reason"] is not None:
            self.live.discard(i)
        return chunk


def _past(until: float | None) -> bool:
    return until is not None and time.time() > until


def _coalesced(items: list[Any]) -> list[Any]:
    """The queued chunks with each request's merged into one (delivery.merge_chunks), in the order the
    requests first appear; a request's last chunk closes its merge."""
    out: list[Any] = []
    open_at: dict[Any, int] = {}  # request index -> where its merged chunk is in `out`
    for item in items:
        if not isinstance(item, dict):  # the exception that ends the stream
            out.append(item)
            continue
        i = item.get("index")
        at = open_at.get(i)
        if at is None:
            out.append(item)
            at = len(out) - 1
        else:
            out[at] = merge_chunks(out[at], item)
        open_at[i] = at
        if item["meta_info"]["finish_reason"] is not None:
            del open_at[i]
    return out


def _drain(box: Any) -> list[Any]:
    """What is queued on `box` now (a queue.Queue or an asyncio.Queue)."""
    out = []
    while True:
        try:
            out.append(box.get_nowait())
        except (queue.Empty, asyncio.QueueEmpty):
            return out


def _is_small(prompt: Any, input_ids: Any) -> bool:
    if isinstance(prompt, str):
        return len(prompt) <= _SMALL_PROMPT
    if isinstance(prompt, list):
        return len(prompt) <= _SMALL_PROMPT and sum(len(p) if isinstance(p, str) else 1 for p in prompt) <= _SMALL_PROMPT
    if isinstance(input_ids, list):
        return len(input_ids) <= _SMALL_PROMPT and sum(
            len(ids) if isinstance(ids, list) else 1 for ids in input_ids) <= _SMALL_PROMPT
    return True


def _constraint_kind(reqs: list[GenerateRequest]) -> str | None:
    """The first constraint kind among the requests (what a too-complex error names), or None."""
    return next((r.constraint.kind for r in reqs if r.constraint is not None), None)


def _set_deadline(reqs: list[GenerateRequest], deadline: float | None) -> None:
    for req in reqs:
        req.deadline = deadline


def _set_result(fut: asyncio.Future, out: Any) -> None:
    if fut.done():
        return
    if isinstance(out, BaseException):
        fut.set_exception(out)
    else:
        fut.set_result(out)
