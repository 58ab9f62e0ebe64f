"""The starlette application: routes, API-key check, request metrics, and shutdown hooks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, AsyncIterator

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixlm.core.errors import EngineShutdownError, QueueFullError
from radixlm.server.args import ServerArgs
from radixlm.server.errors import EXCEPTION_HANDLERS, APIError, error_response
from radixlm.server.front import APIKeyMiddleware, ClientGone, api_routes, client_gone, route_path
from radixlm.server.generation import EngineClient, engine_down_code
from radixlm.server.lifecycle import AdmissionMiddleware, Lifecycle
from radixlm.server.metrics import CONTENT_TYPE, Metrics, Throughput, kv_tokens_used
from radixlm.server.native import NativeAPI
from radixlm.server.openai_api import OpenAIAPI
from radixlm.server.openapi import openapi_document
from radixlm.server.responses_api import ResponsesAPI

# Paths anyone may call even when an API key is set (probes and scrapers), as in SGLang.
_OPEN_PATHS = ("/health", "/health_generate", "/metrics")
# Generation endpoints counted in radixlm:http_requests_total.
_COUNTED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/generate")
access_log = logging.getLogger("radixlm.server.access")
logger = logging.getLogger("radixlm.server")


class _AccessLogMiddleware:
    """One log line per HTTP request (method, path, status, latency), and the count of generation
    requests by path and status for the metrics."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.monotonic(), 0

        async def observing_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if route_path(scope) in _COUNTED_PATHS:
                    self.metrics.count_request(route_path(scope), status)
            await send(message)

        try:
            await self.app(scope, receive, observing_send)
        finally:
            client = scope.get("client") or ("-", 0)
            access_log.info('%s:%s "%s %s" %s %.3fs', client[0], client[1], scope["method"], scope["path"],
                            status or "-", time.monotonic() - start)


async def _queue_full(request: Request, exc: Exception) -> Response:
    return error_response(APIError(503, str(exc), code="queue_full", headers={"Retry-After": "1"}))


async def _engine_down(request: Request, exc: Exception) -> Response:
    return error_response(APIError(503, str(exc), code=engine_down_code(exc)))


def create_app(engine: Any, args: ServerArgs | None = None) -> Starlette:
    """The app serving `engine`. The caller owns the engine (and shuts it down after the server)."""
    args = args or ServerArgs()
    metrics = Metrics(engine.served_model_name)
    client = EngineClient(engine, metrics, args.log_requests)
    openai = OpenAIAPI(engine, client)
    responses = ResponsesAPI(openai, client, args.max_stored_responses)
    native = NativeAPI(engine, client, {"api_key_set": bool(args.api_key)})
    lifecycle = Lifecycle(engine, client, args.drain_timeout)
    native.refusal = lifecycle.refusal
    spec = openapi_document()

    async def metrics_endpoint(request: Request) -> Response:
        return Response(metrics.render(await engine_stats(engine)), media_type=CONTENT_TYPE)

    async def openapi_endpoint(request: Request) -> Response:
        return JSONResponse(spec)

    routes = api_routes({
        "/v1/chat/completions": openai.chat_completions, "/v1/completions": openai.completions,
        "/v1/responses": responses.create, "/v1/responses/{response_id}": responses.retrieve,
        "/v1/models": openai.list_models, "/v1/models/{model:path}": openai.retrieve_model,
        "/generate": native.generate, "/health": native.health, "/health_generate": native.health_generate,
        "/get_model_info": native.get_model_info, "/get_server_info": native.get_server_info,
        "/flush_cache": native.flush_cache, "/abort_request": native.abort_request,
        "/metrics": metrics_endpoint, "/openapi.json": openapi_endpoint,
    })
    middleware = [Middleware(_AccessLogMiddleware, metrics=metrics)]
    if args.allowed_origins:  # outside the API-key check: browsers send preflights without credentials
        middleware.insert(0, Middleware(CORSMiddleware, allow_origins=args.allowed_origins, allow_methods=["*"],
                                        allow_headers=["*"], allow_credentials=True))
    if args.api_key:
        middleware.append(Middleware(APIKeyMiddleware, api_key=args.api_key, open_paths=_OPEN_PATHS))
    middleware.append(Middleware(AdmissionMiddleware, lifecycle=lifecycle, paths=_COUNTED_PATHS,
                                 route_path=route_path))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        app.state.loop = asyncio.get_running_loop()
        watch = asyncio.ensure_future(lifecycle.watch_engine())
        ticker = None
        if args.log_interval > 0:
            throughput = Throughput()
            throughput.update((await engine_stats(engine))["generated_tokens_total"])  # the starting point
            ticker = asyncio.ensure_future(_log_load(engine, args.log_interval, throughput))
        try:
            yield
        finally:
            watch.cancel()
            if ticker is not None:
                ticker.cancel()

    handlers = {**EXCEPTION_HANDLERS, QueueFullError: _queue_full, EngineShutdownError: _engine_down,
                ClientGone: client_gone}
    app = Starlette(routes=routes, middleware=middleware, exception_handlers=handlers, lifespan=lifespan)
    app.state.client = client
    app.state.native = native
    app.state.metrics = metrics
    app.state.lifecycle = lifecycle
    return app


async def engine_stats(engine: Any) -> dict[str, Any]:
    """The engine's statistics as its scheduler loop last published them, for /metrics and the load
    log: never waits for a step that runs long."""
    return engine.stats_snapshot()


async def _log_load(engine: Any, interval: float, throughput: Throughput) -> None:
    """Every `interval` seconds in which the engine was busy, one line with its load (SGLang logs the
    same numbers per decode interval)."""
    while True:
        await asyncio.sleep(interval)
        try:
            stats = await engine_stats(engine)
        except EngineShutdownError:
            return
        gen = throughput.update(stats["generated_tokens_total"])
        if stats["running"] or stats["waiting"] or gen:
            logger.info("load: #running-req %d, #queue-req %d, #token %d (token usage %.2f), cache hit rate "
                        "%.1f%%, gen throughput %.1f token/s", stats["running"], stats["waiting"],
                        kv_tokens_used(stats), kv_tokens_used(stats) / max(stats["kv_slots_total"], 1),
                        100 * stats["cache_hit_rate"], gen)


def begin_drain(app: Starlette) -> None:
    """Starts the drain (server.lifecycle): no new work, the requests in flight finish up to
    drain_timeout, then the server stops. Safe to call from a signal handler or any thread."""
    loop = getattr(app.state, "loop", None)
    if loop is not None and not loop.is_closed():
        loop.call_soon_threadsafe(app.state.lifecycle.begin_drain)

