"""Running the router under uvicorn until SIGINT or SIGTERM: on the signal it stops accepting
connections and lets the requests in flight finish (up to 30 s) before it exits with status 0."""

from __future__ import annotations

import logging
from typing import Any

import uvicorn

from radixlm.server.router.app import Router, create_router_app
from radixlm.server.router.args import RouterArgs

logger = logging.getLogger("radixlm.router")
# The URL and start/stop lines, shown whatever --log-level says (they go through the router's handler).
lifecycle = logging.getLogger("radixlm.router.lifecycle")
lifecycle.setLevel(logging.INFO)
GRACEFUL_SHUTDOWN_S = 30


class _Server(uvicorn.Server):
    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started and self.servers and self.servers[0].sockets:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            lifecycle.info("radixlm router listening on http://%s:%s (OpenAI base_url http://%s:%s/v1)",
                        host, port, host, port)


def serve_router(args: RouterArgs) -> None:
    """Serves the router until SIGINT/SIGTERM (blocks)."""
    logger.setLevel(args.log_level.upper())
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    app = create_router_app(args, Router(args))
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, lifespan="on", access_log=False)
    _Server(config).run()
    lifecycle.info("radixlm router stopped")
