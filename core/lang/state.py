"""The user's handle on a running program: `ProgramState` (the `s` of `s += ...`, `s["name"]`), the
group a fork returns, and starting a program's Python code on a fresh state."""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any, Callable, Iterator

from radixlm.core.lang.interpreter import GatherVariables, StreamExecutor
from radixlm.core.lang.ir import (
    ConcateAndAppend, Expr, ExprList, GenParams, RoleBegin, RoleEnd, VarScopeBegin, VarScopeEnd, as_expr,
)

if TYPE_CHECKING:
    from radixlm.core.lang.backends.base import BaseBackend


class ProgramState:
    """The `s` of a program: append with `s += ...`, read with `s["name"]`, `s.text()`, ..."""

    def __init__(self, stream_executor: StreamExecutor) -> None:
        self.stream_executor = stream_executor
        self.ret_value: Any = None

    def _submit(self, expr: Expr) -> None:
        self.stream_executor.submit(expr)

    def _end(self) -> None:
        self.stream_executor.end()

    def __iadd__(self, other: Any) -> "ProgramState":
        if other is None:
            raise ValueError("cannot append None to a program state")
        self._submit(as_expr(other))
        return self

    def _role(self, role: str, expr: Any = None) -> Any:
        if expr is not None:
            self._submit(ExprList([RoleBegin(role), as_expr(expr), RoleEnd(role)]))
            return None

        @contextlib.contextmanager
        def scope() -> Iterator[None]:
            self._submit(RoleBegin(role))
            yield
            self._submit(RoleEnd(role))
        return scope()

    def system(self, expr: Any = None) -> Any:
        return self._role("system", expr)

    def user(self, expr: Any = None) -> Any:
        return self._role("user", expr)

    def assistant(self, expr: Any = None) -> Any:
        return self._role("assistant", expr)

    @contextlib.contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        """Everything appended inside the block becomes the variable `name`."""
        self._submit(VarScopeBegin(name))
        yield
        self._submit(VarScopeEnd(name))

    def fork(self, size: int = 1, position_ids_offset: Any = None) -> "ProgramStateGroup":
        return ProgramStateGroup([ProgramState(e) for e in self.stream_executor.fork(size)], self)

    @contextlib.contextmanager
    def copy(self) -> Iterator["ProgramState"]:
        group = self.fork(1)
        try:
            yield group[0]
        finally:
            group.join()

    def text(self) -> str:
        return self.stream_executor.text()

    def messages(self) -> list[dict[str, Any]]:
        return self.stream_executor.messages()

    def sync(self) -> None:
        self.stream_executor.sync()

    def error(self) -> BaseException | None:
        return self.stream_executor.error()

    def get_var(self, name: Any) -> Any:
        return self.stream_executor.get_var(name)

    def set_var(self, name: Any, value: Any) -> None:
        self.stream_executor.set_var(name, value)

    def get_meta_info(self, name: Any) -> Any:
        return self.stream_executor.get_meta_info(name)

    def text_iter(self, var_name: Any = None) -> Iterator[str]:
        """Streams the text (or one variable) as it is generated when the program runs with
        stream=True; otherwise yields the finished text (or value) once."""
        if self.stream_executor.stream:
            yield from self.stream_executor.iter_text(var_name)
        else:
            yield self.text() if var_name is None else self.get_var(var_name)

    async def text_async_iter(self, var_name: Any = None) -> Any:
        chunks = self.text_iter(var_name)
        loop = asyncio.get_running_loop()
        while True:
            chunk = await loop.run_in_executor(None, next, chunks, None)
            if chunk is None:
                return
            yield chunk

    def __getitem__(self, name: Any) -> Any:
        return self.get_var(name)

    def __setitem__(self, name: Any, value: Any) -> None:
        self.set_var(name, value)

    def __contains__(self, name: Any) -> bool:
        self.stream_executor.sync()
        return name in self.stream_executor.variables

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"

    def __del__(self) -> None:
        # A state nobody holds can receive nothing more; let its worker thread finish.
        executor = self.__dict__.get("stream_executor")
        if executor is not None:
            executor.end()


class ProgramStateGroup:
    """The states returned by `s.fork(n)`."""

    def __init__(self, states: list[ProgramState], src_state: ProgramState) -> None:
        self.states = states
        self.src_state = src_state

    def join(self, mode: str = "gather_variable") -> None:
        if mode == "gather_variable":
            self.src_state._submit(GatherVariables(self.states))
        elif mode == "concate_and_append":
            self.src_state._submit(ConcateAndAppend(self.states))
        else:
            raise ValueError(f"unknown join mode {mode!r}; use 'gather_variable' or 'concate_and_append'")
        for state in self.states:
            state._end()

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, value: ProgramState) -> None:
        if value is not self.states[i]:  # `forks[i] += ...` assigns the same state back
            raise ValueError("fork states cannot be replaced")

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __iadd__(self, other: Any) -> "ProgramStateGroup":
        if isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"{len(other)} expressions for {len(self.states)} forks")
            for state, expr in zip(self.states, other):
                state += expr
        elif callable(other) and not isinstance(other, Expr):
            for i, state in enumerate(self.states):
                state += other(i)
        else:
            for state in self.states:
                state += other
        return self


def new_state(backend: "BaseBackend", arguments: dict[str, Any], defaults: GenParams, stream: bool,
              num_api_spec_tokens: int | None) -> ProgramState:
    return ProgramState(StreamExecutor(backend, arguments, defaults, stream=stream,
                                       num_api_spec_tokens=num_api_spec_tokens))


def run_function(state: ProgramState, func: Callable[..., Any], args: tuple, kwargs: dict[str, Any],
                 keep_errors: bool) -> None:
    """Runs the program's Python code on `state`. With keep_errors an exception lands on the state
    (run_batch) instead of propagating (run)."""
    executor = state.stream_executor
    try:
        state.ret_value = func(state, *args, **kwargs)
    except Exception as error:
        executor.fail(error)
        if not keep_errors:
            raise
    finally:
        executor.end()
