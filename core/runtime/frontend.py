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
import queue
from typing import Any, AsyncIterator, Callable, Iterator

from radixlm.core.runtime.constraint_compiler import ConstraintCompiler
from radixlm.core.runtime.deadline import deadline_of
from radixlm.core.runtime.delivery import Delivery, Output, Sink
from radixlm.core.runtime.images import ImagePreparer
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

    @property
    def scheduler(self) -> Any:
        """The scheduler client: a LocalScheduler or SchedulerProcess (core.runtime.scheduler_client)."""
        return self.delivery.scheduler

    @property
    def in_flight(self) -> int:
        return self.delivery.in_flight

    def close(self) -> None:
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
        outs = [self.delivery.wait(box) for box in boxes]
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
        self.delivery.submit(reqs, [lambda out, fut=fut: loop.call_soon_threadsafe(_set_result, fut, out) for fut in futures])
        try:
            outs = list(await asyncio.gather(*futures))
        except asyncio.CancelledError:
            for req in reqs:
                self.abort_request(req.rid)
            raise
        return outs[0] if single else outs

    def _stream_sync(self, reqs: list[GenerateRequest]) -> Iterator[Output]:
        chunks: queue.Queue = queue.Queue()
        self.delivery.submit(reqs, _indexed_sinks(chunks.put, len(reqs)))

        def iterate() -> Iterator[Output]:
            live = set(range(len(reqs)))
            try:
                while live:
                    chunk = self.delivery.wait(chunks)
                    yield _noted(chunk, live, len(reqs))
            finally:
                for i in live:  # the consumer stopped early: free the requests' memory
                    self.abort_request(reqs[i].rid)

        return iterate()

    async def _stream_async(self, reqs: list[GenerateRequest]) -> AsyncIterator[Output]:
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue = asyncio.Queue()
        self.delivery.submit(reqs, _indexed_sinks(lambda item: loop.call_soon_threadsafe(chunks.put_nowait, item), len(reqs)))
        live = set(range(len(reqs)))
        try:
            while live:
                chunk = await chunks.get()
                if isinstance(chunk, BaseException):
                    raise chunk
                yield _noted(chunk, live, len(reqs))
        finally:
            for i in live:
                self.abort_request(reqs[i].rid)

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


def _noted(chunk: Output, live: set[int], count: int) -> Output:
    """Marks the chunk's request finished in `live` when the chunk is its last."""
    if chunk["meta_info"]["finish_reason"] is not None:
        live.discard(chunk["index"] if count > 1 else 0)
    return chunk


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
