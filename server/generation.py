"""The one place the server calls engine.async_generate, shared by the OpenAI and native endpoints.

It makes sure that a request never outlives its client: a non-streaming call whose client disconnects
is cancelled (the engine aborts it and frees its KV), and a stream that stops early, for any reason,
aborts every branch that has not finished. Streams with several branches (n > 1, or several prompts)
are opened as one engine stream per branch and merged, each chunk tagged with its branch index.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from radixlm.core.errors import EngineDeadError, EngineShutdownError
from radixlm.server.errors import APIError, error_body, failure_code
from radixlm.server.front import ClientGone
from radixlm.server.metrics import Metrics

Output = dict[str, Any]
logger = logging.getLogger("radixlm.server")
# The limit given to the engine for a request that reached it with no time left: it ends at once (408).
_MIN_TIME_LEFT_S = 1e-3


@dataclass
class Branch:
    """One engine request of a stream: its prompt (text or ids) and sampling params with n == 1."""

    sampling_params: dict[str, Any]
    prompt: str | None = None
    input_ids: list[int] | None = None
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    return_logprob: bool = False
    logprob_start_len: int | None = None
    top_logprobs_num: int = 0
    image_data: list[str] | None = None  # the prompt's images (data URLs), in order
    video_data: list[Any] | None = None  # its videos (lists of frames), in order
    timeout: float | None = None  # seconds (its deadline); None: the engine's request_timeout


def as_list(result: Output | list[Output]) -> list[Output]:
    return result if isinstance(result, list) else [result]


def raise_if_failed(meta: dict[str, Any]) -> None:
    """An output the engine ended by a failure (not an abort someone asked for) becomes an HTTP error."""
    reason = meta.get("finish_reason") or {}
    status = reason.get("status_code")
    if status is not None:
        raise APIError(status, meta.get("error") or "generation failed", code=failure_code(status))


def failure_event(meta: dict[str, Any]) -> bytes | None:
    """The error event a stream sends after its last chunk when the engine ended it by a failure (a
    deadline, memory, the engine stopping): the status and code its non-streaming twin would get."""
    status = (meta.get("finish_reason") or {}).get("status_code")
    if status is None:
        return None
    return sse(json.dumps(error_body(status, meta.get("error") or "generation failed", code=failure_code(status))))


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class EngineClient:
    """Calls the engine on behalf of HTTP handlers, recording metrics and honouring disconnects."""

    def __init__(self, engine: Any, metrics: Metrics, log_requests: bool = False) -> None:
        self.engine = engine
        self.metrics = metrics
        self.log_requests = log_requests
        self.inflight = 0  # HTTP generation requests admitted and not finished
        self._tasks: set[asyncio.Task] = set()  # engine calls awaited by a handler
        self._stream_rids: set[str] = set()  # branches of open streams that have not finished
        # Set by end_all (the server stops): what every request it ends answers, and why.
        self.ending: APIError | None = None

    async def _unless_disconnected(self, request: Request, work: Awaitable[Any]) -> Any:
        """Runs `work`; if the client disconnects first (or the handler is cancelled), cancels it, which
        makes the engine abort the request and free its KV. end_all() cancels it too."""
        task = asyncio.ensure_future(work)
        watcher = asyncio.ensure_future(_wait_for_disconnect(request.receive))
        self._tasks.add(task)
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            self._tasks.discard(task)
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if task.cancelled():
            if watcher.done() and not watcher.cancelled():
                raise ClientGone()
            raise self.ending or APIError(503, "The request was cancelled: the server is stopping", code="shutdown")
        return task.result()

    def time_left(self, request: Request, timeout: float | None) -> float | None:
        """The request's limit (its own `timeout`, else the engine's request_timeout) less the time since
        it arrived (AdmissionMiddleware's stamp): what is left of it for the engine call."""
        timeout = timeout if timeout is not None else self.engine.options.request_timeout
        arrival = request.scope.get("state", {}).get("arrival")
        if timeout is None or arrival is None:
            return timeout
        return max(timeout - (time.time() - arrival), _MIN_TIME_LEFT_S)

    async def generate(self, request: Request, **kwargs: Any) -> Output | list[Output]:
        """A non-streaming call, with the engine's arguments; returns what the engine returns."""
        kwargs["timeout"] = self.time_left(request, kwargs.get("timeout"))
        self.inflight += 1
        try:
            result = await self._unless_disconnected(request, self.engine.async_generate(**kwargs))
        finally:
            self.inflight -= 1
        for out in as_list(result):
            self.finished(out["meta_info"])
        return result

    def finished(self, meta: dict[str, Any]) -> None:
        """Records one finished engine request in the metrics, and logs it with --log-requests."""
        self.metrics.record_output(meta)
        if self.log_requests:
            ttft, e2e = meta.get("ttft"), meta.get("e2e_latency")
            logger.info("request %s: prompt %d (cached %d), completion %d tokens, ttft %s, e2e %s, finish %s",
                        meta["id"], meta["prompt_tokens"], meta["cached_tokens"], meta["completion_tokens"],
                        "-" if ttft is None else f"{ttft:.3f}s", "-" if e2e is None else f"{e2e:.3f}s",
                        meta["finish_reason"]["type"])

    async def open_stream(self, request: Request, branches: list[Branch]) -> "MergedStream":
        """Opens one engine stream per branch and waits for the first chunk of each, so that invalid
        input and a full queue surface as HTTP errors before any response byte is sent."""
        self.engine.check_fan_out(len(branches))
        for b in branches:
            b.timeout = self.time_left(request, b.timeout)
        stream = MergedStream(self, branches)
        self.inflight += 1
        try:
            await self._unless_disconnected(request, stream.start())
        except BaseException:
            await stream.close()
            raise
        return stream

    def abort(self, rid: str) -> None:
        """Aborts an engine request, or all the samples (`{rid}-{i}`) of one with n > 1."""
        self.engine.abort_request(rid)

    def abort_all(self) -> None:
        """/abort_request's abort_all: every engine request in flight ends with finish_reason "abort"
        (streams and non-streaming calls alike, answered as any aborted request is)."""
        self.engine.abort_request(abort_all=True)

    def end_all(self, reason: APIError) -> None:
        """The server stops: every request still in flight ends with `reason` (a non-streaming call as
        its HTTP error, a stream as its final error event)."""
        self.ending = reason
        for rid in list(self._stream_rids):
            self.engine.abort_request(rid)
        for task in list(self._tasks):
            task.cancel()


class MergedStream:
    """The chunks of several engine streams as (branch index, chunk), in arrival order."""

    def __init__(self, client: EngineClient, branches: list[Branch]) -> None:
        self.client = client
        self.branches = branches
        self.finished = [False] * len(branches)
        self._iters: list[AsyncIterator[Output]] = []
        # Bounded: a chunk the client has not taken yet stays in the engine's stream, where a request past
        # its deadline skips what is queued (core.runtime.frontend), not here, behind the send.
        self._queue: asyncio.Queue = asyncio.Queue(maxsize=len(branches))
        self._pumps: list[asyncio.Task] = []
        self._first: list[Output] = []
        self._closed = False
        self._last_chunk = [0.0] * len(branches)  # when each branch last sent tokens

    async def start(self) -> None:
        for b in self.branches:
            it = await self.client.engine.async_generate(
                prompt=b.prompt, input_ids=b.input_ids, sampling_params=b.sampling_params, stream=True,
                rid=b.rid, return_logprob=b.return_logprob, logprob_start_len=b.logprob_start_len,
                top_logprobs_num=b.top_logprobs_num, image_data=b.image_data, video_data=b.video_data,
                timeout=b.timeout)
            self._iters.append(it)
            self.client._stream_rids.add(b.rid)
        # The engine submits a stream's request on its first iteration: pull one chunk from each
        # (from all of them even when one fails, so that no generator is left mid-step when closed).
        firsts = await asyncio.gather(*(it.__anext__() for it in self._iters), return_exceptions=True)
        for first in firsts:
            if isinstance(first, BaseException):
                raise first
        self._first = list(firsts)

    async def __aiter__(self) -> AsyncIterator[tuple[int, Output]]:
        for i, chunk in enumerate(self._first):
            yield self._note(i, chunk)
        live = [(i, it) for i, it in enumerate(self._iters) if not self.finished[i]]
        if len(live) == 1:
            # One branch (most streams): its chunks taken straight from the engine's stream, in this task.
            # A pump task would cost every chunk a task switch and one more pass of the event loop (the
            # queue's hand-over), which with 200 streams is busy.
            i, it = live[0]
            async for chunk in it:
                yield self._checked(i, chunk)
            return
        self._pumps = [asyncio.ensure_future(self._pump(i, it)) for i, it in live]
        remaining = len(self._pumps)
        while remaining:
            i, chunk = await self._queue.get()
            if isinstance(chunk, BaseException):
                raise chunk
            if chunk is None:
                remaining -= 1
                continue
            yield self._checked(i, chunk)

    def _checked(self, i: int, chunk: Output) -> tuple[int, Output]:
        ending = self.client.ending
        if ending is not None and chunk["meta_info"]["finish_reason"] is not None \
                and chunk["meta_info"]["finish_reason"]["type"] == "abort":
            self._note(i, chunk)
            raise ending  # ended by the server stopping: the stream's last event says so
        return self._note(i, chunk)

    async def _pump(self, i: int, it: AsyncIterator[Output]) -> None:
        try:
            async for chunk in it:
                await self._queue.put((i, chunk))
        except Exception as exc:  # re-raised by the consumer
            await self._queue.put((i, exc))
        await self._queue.put((i, None))

    def _note(self, i: int, chunk: Output) -> tuple[int, Output]:
        new_tokens = len(chunk.get("output_ids") or ())
        if new_tokens:
            now = time.monotonic()
            if self._last_chunk[i]:
                self.client.metrics.observe_stream_chunk(now - self._last_chunk[i], new_tokens)
            self._last_chunk[i] = now
        meta = chunk["meta_info"]
        if meta["finish_reason"] is not None:
            self.finished[i] = True
            self.client._stream_rids.discard(self.branches[i].rid)
            self.client.finished(meta)
        return i, chunk

    async def close(self) -> None:
        """Stops the pumps and aborts every branch that has not finished (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.client.inflight -= 1
        for task in self._pumps:
            task.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        for it in self._iters:
            await it.aclose()
        for b, done in zip(self.branches, self.finished):
            self.client._stream_rids.discard(b.rid)
            if not done:
                self.client.engine.abort_request(b.rid)


class EventStreamResponse(StreamingResponse):
    """Server-sent events that end when either side does, and always run `on_close` afterwards, so a
    client that disconnects mid-stream gets its requests aborted whatever the ASGI server version."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass  # the client went away while we were sending
                    except Exception as exc:  # the engine failed mid-stream: say so, end the stream properly
                        body = stream_error_body(exc)
                        with contextlib.suppress(OSError):
                            await send({"type": "http.response.body", "more_body": False,
                                        "body": sse(json.dumps(body)) + sse("[DONE]")})
                    tg.cancel_scope.cancel()

                async def watch() -> None:
                    await _wait_for_disconnect(receive)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                tg.start_soon(watch)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
                await self.on_close()


def engine_down_code(exc: EngineShutdownError) -> str:
    """The error code of a request the engine could not finish: its scheduler died, or it was shut down."""
    return "engine_dead" if isinstance(exc, EngineDeadError) else "engine_shutdown"


def stream_error_body(exc: Exception) -> dict[str, Any]:
    """The final error event of a stream that `exc` ended: the server stopping, the engine gone, or an
    unexpected failure (logged)."""
    if isinstance(exc, APIError):
        return error_body(exc.status, exc.message, exc.param, exc.code)
    if isinstance(exc, EngineShutdownError):
        return error_body(503, str(exc), code=engine_down_code(exc))
    logger.error("stream failed", exc_info=exc)
    return error_body(500, "Generation failed (a server error; the server log has the details)")


def sse(payload: bytes | str) -> bytes:
    """One server-sent event."""
    data = payload.encode() if isinstance(payload, str) else payload
    return b"data: " + data + b"\n\n"
