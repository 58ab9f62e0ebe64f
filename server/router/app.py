"""The router's starlette application: the generation endpoints forwarded to a replica (proxy.Forwarder),
the read-only ones answered by any healthy replica, cache flushes and aborts sent to all, the replica
admin endpoints (SGLang router's /add_worker, /remove_worker, /list_workers), /health and /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import AsyncIterator

import anyio
import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from radixlm.server.errors import EXCEPTION_HANDLERS, APIError, bad_request
from radixlm.server.front import APIKeyMiddleware, ClientGone, api_routes, client_gone, read_body, route_path
from radixlm.server.router.args import RouterArgs
from radixlm.server.router.keys import RoutingKeys
from radixlm.server.router.metrics import render, router_registry
from radixlm.server.router.policy import make_policy
from radixlm.server.router.proxy import Forwarder
from radixlm.server.router.replicas import ADMIN, STATIC, Replica, ReplicaSet, normalize_url

logger = logging.getLogger("radixlm.router")

_GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/generate")
_OPEN_PATHS = ("/health", "/metrics")
_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Router:
    """The router's state: replicas, policy, routing keys and the forwarder, built before the app starts
    and started (replicas checked, loops running) by its lifespan."""

    def __init__(self, args: RouterArgs) -> None:
        self.args = args
        self.http = httpx.AsyncClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
                                      headers={"accept-encoding": "identity"})
        self.policy = make_policy(args)
        self.keys = RoutingKeys(args.tokenizer_path)
        self.replicas = ReplicaSet(args, self.http, self._on_change)
        self.forwarder = Forwarder(args, self.replicas, self.policy, self.keys, self.http)
        self.registry = router_registry(self.replicas, self.policy, self.forwarder.stats)

    def _on_change(self, replica: Replica, event: str) -> None:
        if event == "removed":
            self.policy.remove_worker(replica.url)
        elif event == "up":
            if replica.url in self.policy.loads:  # back after a failure: it may have restarted, cache empty
                self.policy.forget_cache(replica.url)
            else:
                self.policy.add_worker(replica.url, replica.capacity * self.keys.units_per_token)

    async def start(self) -> None:
        await asyncio.gather(*(self.replicas.add(url, STATIC) for url in self.args.worker_urls or []))
        await self.replicas.discover()
        await self.ensure_tokenizer()

    async def ensure_tokenizer(self) -> None:
        """Without --tokenizer-path, loads the tokenizer the first healthy replica reports (once)."""
        if self.keys.tried:
            return
        info = next((r.info for r in self.replicas.replicas.values() if r.info), None)
        if info is None:
            return
        await anyio.to_thread.run_sync(self.keys.load, info.get("tokenizer_path") or info.get("model_path"))
        if self.keys.tokenizer is not None and hasattr(self.policy, "tree"):  # keys change from bytes to ids
            for url, replica in self.replicas.replicas.items():
                if url in self.policy.loads:
                    self.policy.tree.capacity[url] = replica.capacity
            self.policy.tree.reset()

    async def run(self) -> None:
        """Background work: health checks, discovery, and the tokenizer once a replica names it."""

        async def tokenizer_when_known() -> None:
            while not self.keys.tried:
                await asyncio.sleep(1)
                await self.ensure_tokenizer()

        await asyncio.gather(self.replicas.run(), tokenizer_when_known())

    # ---- endpoints --------------------------------------------------------------------------------

    async def generate(self, request: Request) -> Response:
        raw = await read_body(request, self.args.max_payload_size, "--max-payload-size")
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise bad_request(f"Request body is not valid JSON: {exc}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise bad_request("Request body must be a JSON object", code="invalid_json")
        path = route_path(request.scope)
        return await self.forwarder.forward(request, path, raw, body)

    async def any_replica(self, request: Request) -> Response:
        """A read-only GET any healthy replica answers alike (models, model and server info)."""
        path = route_path(request.scope)
        return await self._get_first(path, self.replicas.healthy(), request)

    async def retrieve_response(self, request: Request) -> Response:
        """GET /v1/responses/{id}: the replica that stored it, else whichever has it."""
        owner = self.forwarder.sticky.get(request.path_params["response_id"])
        healthy = self.replicas.healthy()
        order = ([owner] if owner in healthy else []) + [u for u in healthy if u != owner]
        path = route_path(request.scope)
        return await self._get_first(path, order, request, skip_404=True)

    async def _get_first(self, path: str, urls: list[str], request: Request, skip_404: bool = False) -> Response:
        reply = None
        for url in urls:
            try:
                reply = await self.http.get(url + path, headers=_auth(request), params=request.query_params,
                                            timeout=self.args.health_check_timeout_secs * 5)
            except httpx.HTTPError as exc:
                self.replicas.mark_failed(url, f"{type(exc).__name__}: {exc}")
                continue
            if not (skip_404 and reply.status_code == 404):
                break
        if reply is None:
            raise APIError(503, "No healthy replica to answer", code="no_healthy_replica")
        return Response(reply.content, status_code=reply.status_code,
                        media_type=reply.headers.get("content-type"))

    async def to_all(self, request: Request) -> Response:
        """/flush_cache and /abort_request: sent to every healthy replica; 200 if every one said 200."""
        path = route_path(request.scope)
        raw = await read_body(request, self.args.max_payload_size, "--max-payload-size") if request.method == "POST" else None
        urls = self.replicas.healthy()

        async def one(url: str) -> tuple[str, int, str]:
            try:
                reply = await self.http.request(request.method, url + path, content=raw, headers=_auth(request),
                                                timeout=self.args.request_timeout_secs)
                return url, reply.status_code, reply.text
            except httpx.HTTPError as exc:
                return url, 502, f"{type(exc).__name__}: {exc}"

        results = await asyncio.gather(*(one(u) for u in urls))
        ok = bool(results) and all(status == 200 for _, status, _ in results)
        if ok and path == "/flush_cache" and hasattr(self.policy, "tree"):
            self.policy.tree.reset()
        body = {"replicas": [{"url": u, "status": s, "body": t[:1000]} for u, s, t in results]}
        return JSONResponse(body, status_code=200 if ok else 503 if not results else 502)

    async def health(self, request: Request) -> Response:
        if not self.replicas.healthy():
            raise APIError(503, "No healthy replica", code="no_healthy_replica")
        return Response(status_code=200)

    async def metrics(self, request: Request) -> Response:
        return Response(render(self.registry), media_type=_CONTENT_TYPE)

    async def add_worker(self, request: Request) -> Response:
        url = _url_param(request)
        if url in self.replicas.replicas:
            raise bad_request(f"replica {url} is already routed to", "url")
        replica = await self.replicas.add(url, ADMIN)
        if not (replica.healthy or replica.passes):
            self.replicas.remove(url)
            raise bad_request(f"replica {url} did not answer its health check; not added", "url",
                              code="replica_unreachable")
        await self.ensure_tokenizer()
        return JSONResponse({"url": replica.url, "healthy": replica.healthy})

    async def remove_worker(self, request: Request) -> Response:
        url = _url_param(request)
        if not self.replicas.remove(url):
            raise APIError(404, f"no replica {url}", "url", code="replica_not_found")
        return JSONResponse({"url": url, "removed": True})

    async def list_workers(self, request: Request) -> Response:
        replicas = [{"url": r.url, "healthy": r.healthy, "source": r.source,
                     "in_flight": self.policy.loads.get(r.url, 0), "kv_capacity_tokens": r.capacity,
                     "requests_total": r.requests_total}
                    for r in self.replicas.replicas.values()]
        return JSONResponse({"urls": [r["url"] for r in replicas], "replicas": replicas})


def _auth(request: Request) -> dict[str, str]:
    given = request.headers.get("authorization")
    return {"authorization": given} if given else {}


def _url_param(request: Request) -> str:
    url = request.query_params.get("url")
    if not url:
        raise bad_request("give the replica's base URL as ?url=http://host:port", "url")
    try:
        return normalize_url(url)
    except ValueError as exc:
        raise bad_request(str(exc), "url") from None


def create_router_app(args: RouterArgs, router: Router | None = None) -> Starlette:
    router = router or Router(args)
    read_only = ("/v1/models", "/v1/models/{model:path}", "/get_model_info", "/get_server_info",
                 "/health_generate", "/openapi.json")
    routes = api_routes({
        **dict.fromkeys(_GENERATION_PATHS, router.generate), **dict.fromkeys(read_only, router.any_replica),
        "/v1/responses/{response_id}": router.retrieve_response, "/flush_cache": router.to_all,
        "/abort_request": router.to_all, "/health": router.health, "/metrics": router.metrics,
    }) + [
        Route("/add_worker", router.add_worker, methods=["POST"]),
        Route("/remove_worker", router.remove_worker, methods=["POST"]),
        Route("/list_workers", router.list_workers, methods=["GET"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await router.start()
        background = asyncio.ensure_future(router.run())
        try:
            yield
        finally:
            background.cancel()
            await router.http.aclose()

    app = Starlette(routes=routes, exception_handlers={**EXCEPTION_HANDLERS, ClientGone: client_gone},
                    lifespan=lifespan)
    app.state.router = router
    if args.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=args.api_key, open_paths=_OPEN_PATHS)
    return app
