"""Running the server: an engine, the app, and uvicorn with a drain on SIGTERM/SIGINT.

On the first signal the server drains (server.lifecycle): new requests get 503 `draining`, the ones in
flight finish for up to --drain-timeout seconds, the rest then end with a 503 or a final error event;
then it shuts the engine down and the process exits 0. A second signal exits at once (status 1). When
the engine's scheduler dies the server stops and exits 1.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import sys
import threading
from typing import Any, Iterator

import uvicorn

from radixlm.server.app import ServerArgs, begin_drain, create_app

logger = logging.getLogger("radixlm.server")


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.url: str | None = None
        self.draining = False

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started and self.servers and self.servers[0].sockets:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            scheme = "https" if self.config.ssl_keyfile else "http"
            self.url = f"{scheme}://{host}:{port}"
            logger.info("radixlm server listening on %s (OpenAI base_url %s/v1)", self.url, self.url)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.draining:  # the second signal: no more waiting
            logger.warning("second %s: exiting now", signal.Signals(sig).name)
            os._exit(1)  # a scheduler process exits with its parent (scheduler_client)
        self.draining = True
        begin_drain(self.config.app)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn's own version re-raises the signal after shutting down, which would turn a clean stop
        # into a KeyboardInterrupt or a kill; this one just shuts down.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def serve(model_path: str | None = None, args: ServerArgs | None = None, *, exit_process: bool = False,
          **engine_options: Any) -> int:
    """Starts an engine and serves it until SIGINT/SIGTERM (then drains) or its scheduler dies; returns the
    process's exit status: 0 after a drain, 1 when the engine died.

    With `exit_process` (the `radixlm serve` command) the process ends with that status as soon as the
    engine is shut down (os._exit): the interpreter's teardown (a collection of the model's whole heap,
    every module's finalizers) took seconds on a busy machine between the drain's end and the exit that
    an orchestrator waits for."""
    from radixlm import Engine

    args = args or ServerArgs()
    engine = Engine(model_path, **engine_options)
    # The URL and start/stop lines are shown whatever the engine's log level; they go through the
    # engine's "radixlm" handler when it has one.
    logger.setLevel(logging.INFO)
    if not (logger.handlers or logging.getLogger("radixlm").handlers or logging.getLogger().handlers):
        logger.addHandler(logging.StreamHandler())
    try:
        app = create_app(engine, args)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                timeout_graceful_shutdown=10, lifespan="on", root_path=args.root_path,
                                ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                                access_log=False)  # the app logs each request itself (radixlm.server.access)
        server = _Server(config)
        lifecycle = app.state.lifecycle
        lifecycle.stop_server = lambda: setattr(server, "should_exit", True)
        server.run()
    finally:
        if exit_process:
            gc.disable()  # the heap goes with the process: nothing to collect on the way out
        engine.shutdown()
        logger.info("radixlm server stopped")
    if exit_process:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(lifecycle.exit_code)
    return lifecycle.exit_code
