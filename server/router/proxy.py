"""Forwarding one generation request to a replica, with failover.

A request goes to the replica the policy picks among the healthy ones. If that replica fails before the
client got any byte of its answer (connection refused or lost, a 503 while it drains or its queue is
full), the request goes to another replica, up to --retry-max-retries times: nothing was shown to the
client yet, so sending it again is safe. A stream is relayed chunk by chunk, unchanged, from its first
chunk on; a replica lost after that ends the stream with an error event (its tokens cannot be taken
back). A client that disconnects closes the connection to the replica, which aborts the request there.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import httpx
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from radixlm.server.errors import APIError, error_body
from radixlm.server.front import ClientGone
from radixlm.server.router.args import RouterArgs
from radixlm.server.router.keys import RoutingKeys
from radixlm.server.router.replicas import ReplicaSet

logger = logging.getLogger("radixlm.router")
T = TypeVar("T")

# Not passed on in either direction (RFC 9110 hop-by-hop fields, and what httpx or starlette set).
_DROPPED_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "trailer",
                    "upgrade", "proxy-authorization", "proxy-connection", "accept-encoding", "content-encoding",
                    "date", "server"}
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[0-9A-Za-z_-]+)"')
_MAX_STICKY = 100_000  # /v1/responses ids remembered (their replica holds the stored conversation)


@dataclass
class RouterStats:
    """The router's own counters (replicas keep theirs), read by /metrics."""

    requests_total: int = 0  # routing decisions, failovers included
    prefix_routed_total: int = 0  # of them, sent to a replica believed to hold part of the prompt
    key_tokens_total: int = 0
    matched_tokens_total: int = 0
    failovers_total: int = 0
    no_replica_total: int = 0  # answered 503: no healthy replica left
    broken_streams_total: int = 0  # streams whose replica was lost after the first chunk


class _Retry(Exception):
    """The replica failed before anything reached the client; `reply` is its answer, if it gave one."""

    def __init__(self, reply: Response | None = None) -> None:
        super().__init__()
        self.reply = reply


class Forwarder:
    def __init__(self, args: RouterArgs, replicas: ReplicaSet, policy: Any, keys: RoutingKeys,
                 http: httpx.AsyncClient) -> None:
        self.args, self.replicas, self.policy, self.keys, self.http = args, replicas, policy, keys, http
        self.stats = RouterStats()
        self.sticky: OrderedDict[str, str] = OrderedDict()  # response id -> replica URL

    async def forward(self, request: Request, path: str, raw: bytes, body: dict[str, Any]) -> Response:
        if self.keys.tokenizer is not None:  # a long prompt's encoding must not hold up the event loop
            ids = await anyio.to_thread.run_sync(self.keys.key, path, body)
        else:
            ids = self.keys.key(path, body)
        stream = body.get("stream") is True
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROPPED_HEADERS}
        owner = self.sticky.get(body.get("previous_response_id") or "") if path == "/v1/responses" else None
        tried: list[str] = []
        last: _Retry | None = None
        for _ in range(1 + self.args.retry_max_retries):
            candidates = [u for u in self.replicas.healthy() if u not in tried]
            if owner is not None:  # the stored conversation lives on one replica
                if owner not in candidates:
                    raise APIError(503, f"The replica that stored previous_response_id ({owner}) is not available",
                                   "previous_response_id", code="replica_unavailable")
                candidates = [owner]
            if not candidates:
                break
            url, matched = self.policy.route(ids, among=candidates)
            self._count(url, len(ids), matched)
            try:
                return await self._send(request, url, path, raw, headers, stream)
            except _Retry as exc:
                tried.append(url)
                last = exc
                self.stats.failovers_total += 1
        if last is not None and last.reply is not None:
            return last.reply  # every replica tried answered 503: pass the last one's answer on
        self.stats.no_replica_total += 1
        raise APIError(503, "No healthy replica to send the request to" + (" (tried " + ", ".join(tried) + ")"
                                                                           if tried else ""),
                       code="no_healthy_replica", headers={"Retry-After": "1"})

    def _count(self, url: str, key_len: int, matched: int) -> None:
        self.stats.requests_total += 1
        self.stats.key_tokens_total += key_len
        self.stats.matched_tokens_total += matched
        self.stats.prefix_routed_total += matched > 0
        self.replicas.replicas[url].requests_total += 1

    async def _send(self, request: Request, url: str, path: str, raw: bytes, headers: dict[str, str],
                    stream: bool) -> Response:
        """Sends to one replica; owns the request's load count there until its answer ends."""
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.policy.finish(url)

        timeout = httpx.Timeout(self.args.request_timeout_secs, connect=self.args.health_check_timeout_secs)
        upstream = self.http.build_request("POST", url + path, content=raw, headers=headers, timeout=timeout)
        resp: httpx.Response | None = None
        relayed = False  # from the first chunk of a stream on, the relay owns resp and the load count
        try:
            resp = await _until_disconnected(request, self.http.send(upstream, stream=True))
            if resp.status_code == 503:  # draining or queue full: another replica may take it
                raise _Retry(_response(resp, await resp.aread()))
            if not (stream and resp.status_code == 200):
                data = await _until_disconnected(request, resp.aread())
                self._remember(url, data)
                return _response(resp, data)
            chunks = resp.aiter_raw()
            first = await _until_disconnected(request, anext(chunks, b""))
            relayed = True
        except httpx.TimeoutException as exc:
            if isinstance(exc, httpx.ConnectTimeout):
                self.replicas.mark_failed(url, "connect timed out")
                raise _Retry() from None
            raise APIError(504, f"The replica sent nothing for {self.args.request_timeout_secs:g} s",
                           code="replica_timeout") from None
        except httpx.TransportError as exc:
            self.replicas.mark_failed(url, f"{type(exc).__name__}: {exc}")
            raise _Retry() from None
        finally:
            if not relayed:
                if resp is not None:
                    await resp.aclose()
                release()
        self._remember(url, first)

        async def cleanup() -> None:
            await resp.aclose()
            release()

        return StreamingResponse(self._relay(first, chunks, url, cleanup), status_code=resp.status_code,
                                 headers=_headers(resp), background=BackgroundTask(cleanup))

    async def _relay(self, first: bytes, chunks: AsyncIterator[bytes], url: str,
                     cleanup: Any) -> AsyncIterator[bytes]:
        try:
            yield first
            async for chunk in chunks:
                yield chunk
        except httpx.HTTPError as exc:
            self.stats.broken_streams_total += 1
            self.replicas.mark_failed(url, f"lost mid-stream: {type(exc).__name__}")
            event = error_body(502, f"The replica was lost mid-stream ({type(exc).__name__}); the output so "
                                    "far is incomplete", code="replica_lost")
            yield f"data: {json.dumps(event)}\n\n".encode()
        finally:
            await cleanup()

    def _remember(self, url: str, data: bytes) -> None:
        """Notes which replica stores a /v1/responses answer (for previous_response_id)."""
        match = _RESPONSE_ID.search(data[:4096])
        if match:
            self.sticky[match.group(1).decode()] = url
            while len(self.sticky) > _MAX_STICKY:
                self.sticky.popitem(last=False)


def _headers(resp: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in resp.headers.items() if k.lower() not in _DROPPED_HEADERS}


def _response(resp: httpx.Response, data: bytes) -> Response:
    return Response(data, status_code=resp.status_code, headers=_headers(resp))


async def _until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Awaits `work` unless the client disconnects first (then cancels it: closing the connection to
    the replica aborts the request there) and raises ClientGone."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        raise ClientGone()
    return task.result()
