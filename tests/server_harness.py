"""Helpers for the server tests: the real app on a free loopback port, served by uvicorn in a thread.

One server per checkpoint is shared by every server test module of a session (starting an engine is
the slow part); it stops when the session ends.
"""

from __future__ import annotations

import atexit
import threading
import time
from typing import Any

import httpx
import uvicorn

from radixlm import Engine
from radixlm.server.app import create_app
from radixlm.server.args import ServerArgs


class LiveServer:
    def __init__(self, engine: Engine, api_key: str | None = None) -> None:
        self.engine = engine
        self.app = create_app(engine, ServerArgs(port=0, api_key=api_key))
        config = uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    @property
    def model(self) -> str:
        return self.engine.served_model_name

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120, **kwargs)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


_servers: dict[str, LiveServer] = {}


def shared_server(model_path: str | None) -> LiveServer:
    """One engine and server per model path (None: the default model), shared by the tests that ask for it."""
    if model_path not in _servers:
        _servers[model_path] = LiveServer(Engine(model_path))
    return _servers[model_path]


@atexit.register
def _stop_all() -> None:
    for live in _servers.values():
        live.stop()
        live.engine.shutdown()


def wait_idle(live: LiveServer, timeout: float = 30) -> dict[str, Any]:
    """Waits until the engine runs nothing; returns its stats."""
    deadline = time.monotonic() + timeout
    while True:
        stats = live.engine.get_stats()
        if stats["running"] == 0 and stats["waiting"] == 0 and stats["in_flight"] == 0:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"engine still busy after {timeout}s: {stats}")
        time.sleep(0.05)


def render_chat(engine: Engine, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    """The oracle prompt: the tokenizer's chat template, rendered and encoded independently."""
    text = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    return engine.tokenizer.encode(text, add_special_tokens=False)


