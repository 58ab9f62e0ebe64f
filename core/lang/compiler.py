"""The tracing compiler: `f.compile()` traces a program once and runs its graph afterwards.

Passes over the traced streams, none of which changes any state's text:
- adjacent constant texts merge into one node;
- hoisting: the constant text that every branch of a fork starts with moves to the fork itself,
  so the prefix that the fork pre-fills in the radix cache (one request, before the branches run)
  covers it and the branches share a longer prefix;
- prefetching: the program's constant prefix is pre-filled into the backend's cache when the
  program is compiled for a backend, and before every run_batch.

Running the graph needs no Python code of the program: each stream's nodes are queued on its own
executor at once, and cross-stream reads (a fork's start, a variable of another stream, a join)
wait inside the executors, so independent streams run concurrently.
"""

from __future__ import annotations

import os
from typing import Any

from radixlm.core.lang.backends.resolve import resolve_backend
from radixlm.core.lang.interpreter import ForkItem, GatherVariables, StreamExecutor
from radixlm.core.lang.ir import (
    Argument, ConcateAndAppend, Constant, Expr, Fork, GenParams, GetForkItem, Variable, as_expr,
)
from radixlm.core.lang.running import RUN_SAMPLING_NAMES, run_threaded, split_run_kwargs
from radixlm.core.lang.state import ProgramState
from radixlm.core.lang.tracer import TracerProgramState, trace_program


def merge_constants(nodes: list[Expr]) -> list[Expr]:
    merged: list[Expr] = []
    for node in nodes:
        if isinstance(node, Constant) and merged and isinstance(merged[-1], Constant):
            joined = Constant(merged[-1].value + node.value)
            joined.pid = node.pid
            merged[-1] = joined
        else:
            merged.append(node)
    return merged


def hoist_fork_constants(streams: dict[Any, list[Expr]]) -> None:
    """Moves the constant text common to the start of every branch of a fork onto the Fork."""
    branches: dict[int, list[list[Expr]]] = {}
    forks: dict[int, Fork] = {}
    for nodes in streams.values():
        first = nodes[0] if nodes else None
        if isinstance(first, GetForkItem) and isinstance(first.prev_node, Fork):
            branches.setdefault(first.prev_node.node_id, []).append(nodes)
            forks[first.prev_node.node_id] = first.prev_node
    for fork_id, group in branches.items():
        if len(group) < 2 or not all(len(n) > 1 and isinstance(n[1], Constant) for n in group):
            continue
        common = os.path.commonprefix([n[1].value for n in group])
        if not common:
            continue
        forks[fork_id].hoisted_text = common
        for nodes in group:
            rest = nodes[1].value[len(common):]
            if rest:
                trimmed = Constant(rest)
                trimmed.pid = nodes[1].pid
                nodes[1] = trimmed
            else:
                del nodes[1]


class CompiledFunction:
    def __init__(self, function: Any, backend: Any = None) -> None:
        self.function = function
        backend = resolve_backend(backend) if backend is not None else None
        tracer: TracerProgramState = trace_program(function, {}, backend)
        self.root_pid = tracer.pid
        # Streams in creation order: a parent is always queued before its forks.
        self.streams: dict[Any, list[Expr]] = {s.pid: merge_constants(s.nodes) for s in tracer.all_streams()}
        hoist_fork_constants(self.streams)
        self.prefix = tracer.prefix_text()
        self._tracer = tracer
        if backend is not None:
            self.prefetch(backend)

    def prefetch(self, backend: Any) -> None:
        """Pre-fills the program's constant prefix into the backend's cache."""
        if self.prefix:
            resolve_backend(backend).cache_prefix(self.prefix)

    def graph_text(self) -> str:
        names = {pid: i for i, pid in enumerate(self.streams)}
        return "\n".join(f"stream {names[pid]}: {node!r}" for pid, nodes in self.streams.items() for node in nodes)

    def print_graph(self) -> None:
        print(self.graph_text())

    def run(self, *, backend: Any = None, **kwargs: Any) -> ProgramState:
        defaults, program_kwargs = split_run_kwargs(kwargs)
        return self._run(resolve_backend(backend), program_kwargs, defaults)

    def run_batch(self, batch_kwargs: list[dict[str, Any]], *, backend: Any = None,
                  num_threads: int | str = "auto", progress_bar: bool = False,
                  **sampling: Any) -> list[ProgramState]:
        unknown = set(sampling) - RUN_SAMPLING_NAMES
        if unknown:
            raise TypeError(f"run_batch got unknown keyword(s) {sorted(unknown)}")
        if not batch_kwargs:
            return []
        backend = resolve_backend(backend)
        defaults = GenParams.run_defaults(**sampling)
        if len(batch_kwargs) > 1:
            self.prefetch(backend)

        def run_one(kwargs: dict[str, Any]) -> ProgramState:
            state = self._run(backend, dict(kwargs), defaults)
            state.sync()
            return state

        return run_threaded(run_one, list(batch_kwargs), num_threads, progress_bar)

    def _arguments(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        arguments = {**self.function.arg_defaults, **kwargs, **self.function.bind_arguments}
        missing = [name for name in self.function.arg_names if name not in arguments]
        if missing:
            raise TypeError(f"{self.function.func.__name__} missing argument(s) {missing}")
        return arguments

    def _run(self, backend: Any, kwargs: dict[str, Any], defaults: GenParams) -> ProgramState:
        arguments = self._arguments(kwargs)
        executors = {pid: StreamExecutor(backend, arguments if pid == self.root_pid else {}, defaults,
                                         num_api_spec_tokens=self.function.num_api_spec_tokens)
                     for pid in self.streams}
        for pid, nodes in self.streams.items():
            for node in nodes:
                executors[pid].submit(self._bind(node, executors, arguments))
        for executor in executors.values():
            executor.end()
        return ProgramState(executors[self.root_pid])

    @staticmethod
    def _bind(node: Expr, executors: dict[Any, StreamExecutor], arguments: dict[str, Any]) -> Expr:
        """The node to execute in this run: placeholders replaced by this run's values and streams."""
        if isinstance(node, Argument):
            return as_expr(arguments[node.name])
        if isinstance(node, Variable):
            return Variable(node.name, executor=executors[node.source.pid])
        if isinstance(node, GetForkItem):
            return ForkItem(executors[node.prev_node.pid], node.prev_node)
        if isinstance(node, ConcateAndAppend):
            return ConcateAndAppend([executors[s.pid] for s in node.states])
        if isinstance(node, GatherVariables):
            return GatherVariables([executors[s.pid] for s in node.states])
        return node
