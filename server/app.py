"""The starlette application: routes, API-key check, request metrics, and shutdown hooks."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from dataclasses import dataclass
from typing import Any, AsyncIterator

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixlm.core.errors import EngineShutdownError, QueueFullError
from radixlm.server.errors import EXCEPTION_HANDLERS, APIError, error_body, error_response
from radixlm.server.generation import ClientGone, EngineClient
from radixlm.server.metrics import Metrics
from radixlm.server.native import NativeAPI
from radixlm.server.openai_api import OpenAIAPI
from radixlm.server.openapi import openapi_document

# Paths anyone may call even when an API key is set (probes and scrapers), as in SGLang.
_OPEN_PATHS = ("/health", "/health_generate", "/metrics")
# Generation endpoints counted in radixlm_requests_total.
_COUNTED_PATHS = ("/v1/chat/completions", "/v1/completions", "/generate")


@dataclass
class ServerArgs:
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None


class _APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in _OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(given, self.expected):
            message = "Missing API key" if not given else "Invalid API key"
            response = JSONResponse(error_body(401, message + " (send 'Authorization: Bearer <key>')",
                                               code="invalid_api_key"),
                                    status_code=401, headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class _CountingMiddleware:
    """Counts generation requests by path and response status."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in _COUNTED_PATHS:
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.count_request(scope["path"], message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)


async def _queue_full(request: Request, exc: Exception) -> Response:
    return error_response(APIError(503, str(exc), code="queue_full", headers={"Retry-After": "1"}))


async def _engine_down(request: Request, exc: Exception) -> Response:
    return error_response(APIError(503, str(exc), code="engine_shutdown"))


async def _client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)  # nobody reads it; nginx's code for "client closed request"


def create_app(engine: Any, args: ServerArgs | None = None) -> Starlette:
    """The app serving `engine`. The caller owns the engine (and shuts it down after the server)."""
    args = args or ServerArgs()
    metrics = Metrics()
    client = EngineClient(engine, metrics)
    openai = OpenAIAPI(engine, client)
    native = NativeAPI(engine, client, {"api_key_set": bool(args.api_key)})
    spec = openapi_document()

    async def metrics_endpoint(request: Request) -> Response:
        return PlainTextResponse(metrics.render(engine.stats_snapshot(), client.inflight),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    async def openapi_endpoint(request: Request) -> Response:
        return JSONResponse(spec)

    routes = [
        Route("/v1/chat/completions", openai.chat_completions, methods=["POST"]),
        Route("/v1/completions", openai.completions, methods=["POST"]),
        Route("/v1/models", openai.list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", openai.retrieve_model, methods=["GET"]),
        Route("/generate", native.generate, methods=["POST"]),
        Route("/health", native.health, methods=["GET"]),
        Route("/health_generate", native.health_generate, methods=["GET"]),
        Route("/get_model_info", native.get_model_info, methods=["GET"]),
        Route("/get_server_info", native.get_server_info, methods=["GET"]),
        Route("/flush_cache", native.flush_cache, methods=["GET", "POST"]),
        Route("/abort_request", native.abort_request, methods=["POST"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/openapi.json", openapi_endpoint, methods=["GET"]),
    ]
    middleware = [Middleware(_CountingMiddleware, metrics=metrics)]
    if args.api_key:
        middleware.append(Middleware(_APIKeyMiddleware, api_key=args.api_key))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        app.state.loop = asyncio.get_running_loop()
        yield

    handlers = {**EXCEPTION_HANDLERS, QueueFullError: _queue_full, EngineShutdownError: _engine_down,
                ClientGone: _client_gone}
    app = Starlette(routes=routes, middleware=middleware, exception_handlers=handlers, lifespan=lifespan)
    app.state.client = client
    app.state.native = native
    app.state.metrics = metrics
    return app


def begin_shutdown(app: Starlette) -> None:
    """Stops new work and aborts everything in flight; safe to call from a signal handler or any thread."""

    def on_loop() -> None:
        app.state.native.closing = True
        app.state.client.abort_all()

    loop = getattr(app.state, "loop", None)
    if loop is not None and not loop.is_closed():
        loop.call_soon_threadsafe(on_loop)

