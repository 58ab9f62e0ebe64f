"""Which backend a program runs on: what a user passed (a backend, a `radixlm.Engine`, a `Runtime`) or
the default backend (`sgl.set_default_backend`), resolved where the program runs."""

from __future__ import annotations

from typing import Any

from radixlm.core.lang.backends.base import BaseBackend
from radixlm.core.lang.backends.local_engine import EngineBackend
from radixlm.core.lang.config import global_config
from radixlm.core.lang.errors import ProgramError


def resolve_backend(backend: Any) -> BaseBackend:
    """The backend object for what a user passed: a backend, a radixlm.Engine, or a Runtime."""
    backend = backend if backend is not None else global_config.default_backend
    if backend is None:
        raise ProgramError("no backend: call sgl.set_default_backend(...) or pass backend=...")
    if isinstance(backend, BaseBackend):
        return backend
    if hasattr(backend, "endpoint"):  # a Runtime
        return backend.endpoint
    if hasattr(backend, "generate") and hasattr(backend, "tokenizer"):  # a radixlm.Engine
        # One backend per engine, so `run(backend=engine)` does not recover its chat template every
        # time. It is kept on the engine itself: that cycle is freed with the engine, whereas a
        # weak-keyed table would keep every engine alive through its backend's reference to it.
        cached = vars(backend).get("_program_backend")
        if cached is None:
            cached = backend._program_backend = EngineBackend(backend)
        return cached
    raise TypeError(f"not a backend: {backend!r}")
