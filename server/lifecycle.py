"""The server's life after it starts: serving, draining (after SIGTERM), stopped; and the watch on the
engine that turns a dead scheduler into an exit the orchestrator can act on.

- Draining: new generation requests get 503 `draining` with Retry-After and /health 503 `draining`
  (a load balancer takes the replica out), while the requests admitted before the signal finish, for
  up to `drain_timeout` seconds; then the rest end (a non-streaming call 503 `shutdown`, a stream a
  final error event with that code), and the server stops and exits 0.
- The engine dying (its scheduler loop raised outside a request, or its process was killed): every
  waiting caller gets an error within a second or two (the front end fails them), /health answers 503
  `engine_dead`, and the server stops and exits 1, for the orchestrator to restart the pod (as vLLM and
  SGLang do): a scheduler restarted in place would come back with an empty cache and no way to resume
  the requests it lost, which a fresh process does as well, with a clean slate.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from radixlm.server.errors import APIError, error_response

logger = logging.getLogger("radixlm.server")

# How often the watch looks at the engine, seconds.
WATCH_INTERVAL_S = 0.25
# How long the requests ended at the drain timeout get to send their last bytes, seconds.
_END_GRACE_S = 5.0
# How long a server whose engine died still answers /health (503 engine_dead) before it exits, seconds.
_DEAD_LINGER_S = 1.0


class Lifecycle:
    def __init__(self, engine: Any, client: Any, drain_timeout: float) -> None:
        self.engine = engine
        self.client = client  # the EngineClient (server.generation)
        self.drain_timeout = drain_timeout
        self.state = "serving"  # then "draining" or "engine_dead"
        self.exit_code = 0
        self.active = 0  # generation requests admitted and not yet answered in full
        self.stop_server: Callable[[], None] = lambda: None  # set by whoever runs the server (launch.py)
        self._drain: asyncio.Task | None = None

    def refusal(self) -> APIError | None:
        """Why a new request is refused now (None: it is admitted)."""
        if self.state == "draining":
            return APIError(503, "The server is draining (shutting down); retry on another replica",
                            code="draining", headers={"Retry-After": "1"})
        if self.state == "engine_dead":
            return APIError(503, "The engine's scheduler has died; the server is exiting", code="engine_dead")
        return None

    def begin_drain(self) -> None:
        """The first SIGTERM/SIGINT (on the event loop): stop admitting, finish what runs, then stop."""
        if self.state != "serving":
            return
        self.state = "draining"
        logger.info("draining: %d requests in flight, up to %g s (drain_timeout)", self.active, self.drain_timeout)
        self._drain = asyncio.ensure_future(self._drain_then_stop())

    async def _drain_then_stop(self) -> None:
        start = time.monotonic()
        if not await self._wait_idle(self.drain_timeout):
            logger.warning("drain timeout: ending %d requests still in flight", self.active)
            self.client.end_all(APIError(503, f"The server is shutting down: the request was still running at "
                                              f"the end of the drain ({self.drain_timeout:g} s)", code="shutdown"))
            await self._wait_idle(_END_GRACE_S)
        logger.info("drained in %.1f s", time.monotonic() - start)
        self.stop_server()

    async def _wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.active:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def watch_engine(self) -> None:
        """Runs while the server does: notices a dead scheduler within WATCH_INTERVAL_S."""
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            if self.engine.alive():
                continue
            if self.state == "engine_dead":
                return
            self.state, self.exit_code = "engine_dead", 1
            logger.error("the engine's scheduler died: failing the requests in flight and exiting (code 1)")
            self.client.end_all(APIError(503, "The engine's scheduler died before the request finished",
                                         code="engine_dead"))
            self.engine.fail_in_flight()
            await self._wait_idle(_END_GRACE_S)
            await asyncio.sleep(_DEAD_LINGER_S)  # probes and scrapers read why before the exit
            self.stop_server()
            return


class AdmissionMiddleware:
    """Counts the generation requests in flight (what a drain waits for) and refuses new ones while the
    server drains or after the engine died."""

    def __init__(self, app: ASGIApp, lifecycle: Lifecycle, paths: tuple[str, ...],
                 route_path: Callable[[Scope], str]) -> None:
        self.app = app
        self.lifecycle = lifecycle
        self.paths = paths
        self.route_path = route_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.route_path(scope) not in self.paths:
            await self.app(scope, receive, send)
            return
        refusal = self.lifecycle.refusal()
        if refusal is not None:
            await error_response(refusal)(scope, receive, send)
            return
        # A request's time limit counts from here, its arrival (EngineClient.time_left), not from the engine
        # call, which a busy event loop may reach seconds later.
        scope.setdefault("state", {})["arrival"] = time.time()
        self.lifecycle.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.lifecycle.active -= 1
