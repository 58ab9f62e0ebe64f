"""`@sgl.function`: a Python function over a program state, run with `.run`, `.run_batch`,
traced with `.trace`, compiled with `.compile`."""

from __future__ import annotations

import functools
import inspect
import threading
from typing import Any, Callable

from radixlm.core.lang.compiler import CompiledFunction
from radixlm.core.lang.config import global_config
from radixlm.core.lang.backends.resolve import resolve_backend
from radixlm.core.lang.state import ProgramState, new_state, run_function
from radixlm.core.lang.ir import GenParams
from radixlm.core.lang.running import RUN_SAMPLING_NAMES, run_threaded, split_run_kwargs
from radixlm.core.lang.tracer import cache_program, precache_batch, trace_program

class SglFunction:
    def __init__(self, func: Callable[..., Any], num_api_spec_tokens: int | None = None,
                 bind_arguments: dict[str, Any] | None = None) -> None:
        parameters = list(inspect.signature(func).parameters.values())
        if not parameters or parameters[0].kind not in (inspect.Parameter.POSITIONAL_ONLY,
                                                        inspect.Parameter.POSITIONAL_OR_KEYWORD):
            raise TypeError(f"{func.__name__}: the first parameter of a program must be its state (s)")
        self.func = func
        self.num_api_spec_tokens = num_api_spec_tokens
        self.bind_arguments = dict(bind_arguments or {})
        named = [p for p in parameters[1:] if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                          inspect.Parameter.KEYWORD_ONLY)]
        self.arg_names = [p.name for p in named]
        self.arg_defaults = {p.name: p.default for p in named if p.default is not inspect.Parameter.empty}
        functools.update_wrapper(self, func)

    def bind(self, **kwargs: Any) -> "SglFunction":
        unknown = [k for k in kwargs if k not in self.arg_names]
        if unknown:
            raise TypeError(f"{self.func.__name__} has no argument(s) {unknown}")
        return SglFunction(self.func, self.num_api_spec_tokens, {**self.bind_arguments, **kwargs})

    def run(self, *args: Any, stream: bool = False, backend: Any = None, **kwargs: Any) -> ProgramState:
        """Runs the program; returns its state at once (reading a value waits for it). Keywords
        named like sampling parameters (temperature, max_new_tokens, ...) are defaults for every
        gen; the others are the program's arguments."""
        defaults, program_kwargs = split_run_kwargs(kwargs)
        program_kwargs.update(self.bind_arguments)
        state = new_state(resolve_backend(backend), program_kwargs, defaults, stream, self.num_api_spec_tokens)
        if stream:
            threading.Thread(target=run_function, args=(state, self.func, args, program_kwargs, True),
                             daemon=True).start()
        else:
            run_function(state, self.func, args, program_kwargs, keep_errors=False)
        return state

    def run_batch(self, batch_kwargs: list[dict[str, Any]] | list[tuple], *, backend: Any = None,
                  num_threads: int | str = "auto", progress_bar: bool = False,
                  **sampling: Any) -> list[ProgramState]:
        """Runs one program per argument dict (or tuple of positional arguments), concurrently on
        `num_threads` threads. A program's error stays on its own state (`state.error()`)."""
        unknown = set(sampling) - RUN_SAMPLING_NAMES
        if unknown:
            raise TypeError(f"run_batch got unknown keyword(s) {sorted(unknown)}")
        batch = [self._as_kwargs(item) for item in batch_kwargs]
        if not batch:
            return []
        backend = resolve_backend(backend)
        defaults = GenParams.run_defaults(**sampling)
        if len(batch) > 1 and global_config.enable_precache_with_tracing:
            precache_batch(self, backend, batch)

        def run_one(kwargs: dict[str, Any]) -> ProgramState:
            kwargs = {**kwargs, **self.bind_arguments}
            state = new_state(backend, kwargs, defaults, False, self.num_api_spec_tokens)
            run_function(state, self.func, (), kwargs, keep_errors=True)
            state.sync()
            return state

        return run_threaded(run_one, batch, num_threads, progress_bar)

    def _as_kwargs(self, item: Any) -> dict[str, Any]:
        if isinstance(item, dict):
            return dict(item)
        if isinstance(item, (list, tuple)) and len(item) <= len(self.arg_names):
            return dict(zip(self.arg_names, item))
        raise TypeError(f"run_batch items must be dicts or tuples of {self.arg_names}, got {item!r}")

    def trace(self, *, backend: Any = None, **kwargs: Any) -> Any:
        """The program's graph, built without running a model (see tracer.py)."""
        return trace_program(self, kwargs, backend)

    def cache(self, backend: Any = None) -> str:
        """Pre-fills the program's constant prefix (found by tracing) into the backend's cache;
        returns that prefix."""
        return cache_program(self, resolve_backend(backend))

    def compile(self, *, backend: Any = None) -> Any:
        return CompiledFunction(self, backend)

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)


def function(func: Callable[..., Any] | None = None, num_api_spec_tokens: int | None = None) -> Any:
    """`@function` or `@function(num_api_spec_tokens=N)`."""
    if func is not None:
        return SglFunction(func, num_api_spec_tokens=num_api_spec_tokens)
    return lambda f: SglFunction(f, num_api_spec_tokens=num_api_spec_tokens)
