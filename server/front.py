"""What both HTTP fronts share, `radixlm serve`'s app (server.app) and `radixlm router`'s (server.router.app):
the endpoints of the API, reading a request body within a size bound, the API-key check with the paths it leaves open, the path the
routes see under --root-path, and the 499 answer to a client that went away. Imports no engine (nor
torch): the router runs without them."""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from radixlm.server.errors import APIError, error_body


# The HTTP API, path and methods: the server answers each, the router forwards each (server.router.app).
ENDPOINTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("/v1/chat/completions", ("POST",)), ("/v1/completions", ("POST",)), ("/v1/responses", ("POST",)),
    ("/v1/responses/{response_id}", ("GET",)), ("/v1/models", ("GET",)), ("/v1/models/{model:path}", ("GET",)),
    ("/generate", ("POST",)), ("/health", ("GET",)), ("/health_generate", ("GET",)),
    ("/get_model_info", ("GET",)), ("/get_server_info", ("GET",)), ("/flush_cache", ("GET", "POST")),
    ("/abort_request", ("POST",)), ("/metrics", ("GET",)), ("/openapi.json", ("GET",)),
)


def api_routes(handlers: dict[str, Any]) -> list[Route]:
    """One route per endpoint of ENDPOINTS, to its handler in `handlers` (KeyError if one has none)."""
    return [Route(path, handlers[path], methods=list(methods)) for path, methods in ENDPOINTS]


class ClientGone(Exception):
    """The client disconnected before its answer was ready; there is no one to answer."""


async def client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)  # nobody reads it; nginx's code for "client closed request"


def route_path(scope: Scope) -> str:
    """The path the routes see: without the --root-path prefix that uvicorn puts in front of it."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


async def read_body(request: Request, limit: int, option: str | None = None) -> bytes:
    """The request's body; a 413 as soon as it is over `limit` bytes (declared or read), naming the
    command-line `option` that sets the limit, if one does."""
    too_large = f"Request body larger than {limit} bytes" + (f" ({option})" if option else "")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, too_large)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, too_large)
        chunks.append(chunk)
    return b"".join(chunks)


class APIKeyMiddleware:
    """Requires 'Authorization: Bearer <api_key>' on every path but `open_paths` (probes and scrapers);
    a 401 in the OpenAI error shape otherwise."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: Iterable[str]) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope) in self.open_paths:
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
