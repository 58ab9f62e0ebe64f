"""What a ChatSGLang talks to: a program backend (an in-process Engine, or a radixlm server through its
native /generate) and what rendering a chat needs from the model (tokenizer, context length, names)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from radixlm.adapters.langchain.messages import ChatRenderer
from radixlm.core.lang.backends.base import BaseBackend
from radixlm.core.lang.backends.runtime_endpoint import RuntimeEndpoint, check_response
from radixlm.core.lang.backends.resolve import resolve_backend

# Statuses worth retrying: the server's queue is full or it is (re)starting.
_RETRY_STATUSES = {429, 502, 503, 504}


@dataclass
class Connection:
    backend: BaseBackend
    renderer: ChatRenderer
    context_len: int
    model_name: str
    # Names a caller may pass as `model`: the served name and the checkpoint path.
    model_names: frozenset[str]
    in_process: bool


def engine_connection(engine: Any) -> Connection:
    backend = resolve_backend(engine)
    return Connection(backend=backend, renderer=ChatRenderer(engine.tokenizer, backend._encode),
                      context_len=engine.context_len, model_name=engine.served_model_name,
                      model_names=frozenset({engine.served_model_name, engine.model_path}), in_process=True)


# Engines started by ChatSGLang(model_path=...), one per (path, options): every ChatSGLang of the same
# model shares it (and its radix cache) instead of loading the weights again. They live as long as
# the process (their scheduler threads are daemons).
_engines: dict[tuple[str | None, str], Any] = {}
_engines_lock = threading.Lock()


def shared_engine(model_path: str | None, options: dict[str, Any]) -> Any:
    key = (model_path, repr(sorted(options.items())))
    with _engines_lock:
        if key not in _engines:
            from radixlm.core.runtime.engine import Engine
            _engines[key] = Engine(model_path, **options)
        return _engines[key]


class RetryingEndpoint(RuntimeEndpoint):
    """A RuntimeEndpoint whose /generate calls are retried, with exponential backoff, when the
    connection fails or the server answers 429/502/503/504 (queue full, restarting)."""

    def __init__(self, base_url: str, api_key: str | None, timeout: float | None, max_retries: int) -> None:
        super().__init__(base_url, api_key=api_key, timeout=timeout if timeout is not None else 600.0)
        self.max_retries = max_retries

    def _generate(self, request: dict[str, Any]) -> Any:
        import httpx

        for attempt in range(self.max_retries + 1):
            last = attempt == self.max_retries
            try:
                response = self._http.post("/generate", json=request)
            except httpx.TransportError:
                if last:
                    raise
            else:
                if last or response.status_code not in _RETRY_STATUSES:
                    check_response(response)
                    return response.json()
            time.sleep(min(0.25 * 2 ** attempt, 4.0))


def server_connection(base_url: str, api_key: str | None, timeout: float | None, max_retries: int,
                      tokenizer_path: str | None) -> Connection:
    # The native endpoints live at the root; accept the OpenAI base URL (.../v1) as well.
    root = base_url.rstrip("/").removesuffix("/v1")
    endpoint = RetryingEndpoint(root, api_key, timeout, max_retries)
    tokenizer = endpoint.tokenizer
    if tokenizer_path is not None:
        from radixlm.core.runtime.tokenizer.loader import load_tokenizer
        tokenizer = endpoint.tokenizer = load_tokenizer(tokenizer_path)
    if tokenizer is None:
        raise ValueError(f"ChatSGLang renders chats with the model's own chat template, so it needs the model's "
                         f"tokenizer: the server's model path {endpoint.model_info.get('model_path')!r} is not on this "
                         "machine; pass tokenizer_path=")
    info = endpoint.model_info
    name = info.get("served_model_name") or info["model_path"]
    return Connection(backend=endpoint, renderer=ChatRenderer(tokenizer, endpoint._encode),
                      context_len=info["context_len"],
                      model_name=name, model_names=frozenset({name, info["model_path"]}), in_process=False)
