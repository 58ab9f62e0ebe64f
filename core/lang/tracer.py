"""Tracing: run a program's Python code against a recording state instead of a model.

Each state (the program's and every fork's) becomes a stream of IR nodes; `prev_node` links a node
to the one before it, a fork's first node (GetForkItem) to the Fork in its parent's stream, and a
`Variable` to the node that produces it. Arguments not given are placeholders (`Argument`), and
generated values are `Variable`s: both can be appended to a state, but branching on them,
converting or formatting them raises TracingError, because their values only exist at run time.

The constant text a program starts with (its prefix) is what `f.cache()` and `run_batch` pre-fill
into the backend's radix cache.
"""

from __future__ import annotations

import copy
import os
import uuid
from typing import Any, Iterator

from radixlm.core.lang.chat_template import ChatTemplate, get_chat_template
from radixlm.core.lang.errors import TracingError
from radixlm.core.lang.interpreter import GatherVariables
from radixlm.core.lang.state import ProgramState, ProgramStateGroup
from radixlm.core.lang.ir import (
    Argument, Constant, Expr, ExprList, Fork, Gen, GetForkItem, RoleBegin, RoleEnd, Select, Variable,
    VarScopeBegin, VarScopeEnd, as_expr,
)


class StopTracing(Exception):
    """Raised inside a prefix-only trace at the first node that is not constant text."""


class TracerProgramState(ProgramState):
    def __init__(self, chat_template: ChatTemplate, arguments: dict[str, Any], only_prefix: bool) -> None:
        # No stream executor: nothing runs.
        self.chat_template = chat_template
        self.arguments = arguments
        self.only_prefix = only_prefix
        self.pid = uuid.uuid4().hex
        self.nodes: list[Expr] = []
        self.last_node: Expr | None = None
        self.variables: dict[Any, Any] = {}
        self.messages_: list[dict[str, Any]] = []
        self.cur_role: str | None = None
        self.child_states: list[TracerProgramState] = []
        self.ret_value: Any = None

    # ----- recording -----

    def _append(self, node: Expr) -> None:
        node.pid = self.pid
        node.prev_node = self.last_node
        self.nodes.append(node)
        self.last_node = node

    def _submit(self, expr: Expr) -> None:
        self._record(as_expr(expr))

    def _end(self) -> None:
        pass

    def _record(self, expr: Expr) -> None:
        if isinstance(expr, ExprList):
            for item in expr.exprs:
                self._record(item)
            return
        constant_text = isinstance(expr, (Constant, RoleBegin, RoleEnd, VarScopeBegin, VarScopeEnd))
        if self.only_prefix and not constant_text:
            raise StopTracing()
        # A node of the graph belongs to one stream at one place; the program may append one
        # expression object in several (`forks += sgl.gen("x")`), so each place gets its own copy.
        expr = copy.copy(expr)
        expr.node_id = next(Expr._ids)
        if isinstance(expr, RoleBegin):
            if not self.messages_ and expr.role != "system" and self.chat_template.default_system_prompt:
                self._record(ExprList([RoleBegin("system"), Constant(self.chat_template.default_system_prompt),
                                       RoleEnd("system")]))
            self.cur_role = expr.role
        self._append(expr)
        if isinstance(expr, RoleEnd):
            self.messages_.append({"role": expr.role, "content": ""})
            self.cur_role = None
        elif isinstance(expr, (Gen, Select, VarScopeEnd)):
            self.variables[expr.name] = Variable(expr.name, source=expr)
        elif isinstance(expr, GatherVariables):
            self._gather(expr.states)

    def _gather(self, children: list["TracerProgramState"]) -> None:
        known = set(self.variables)
        for child in children:
            for name, value in child.variables.items():
                if name not in known:
                    self.variables.setdefault(name, []).append(value)

    def fork(self, size: int = 1, position_ids_offset: Any = None) -> ProgramStateGroup:
        if self.only_prefix:
            raise StopTracing()
        fork = Fork(int(size))
        self._append(fork)
        children = []
        for i in range(int(size)):
            child = TracerProgramState(self.chat_template, self.arguments, False)
            item = GetForkItem(i)
            item.pid, item.prev_node = child.pid, fork
            child.nodes, child.last_node = [item], item
            child.variables = dict(self.variables)
            child.messages_ = list(self.messages_)
            child.cur_role = self.cur_role
            children.append(child)
        self.child_states += children
        return ProgramStateGroup(children, self)

    # ----- reads: only what exists without a model -----

    def get_var(self, name: Any) -> Any:
        if name in self.variables:
            return self.variables[name]
        raise KeyError(f"the program has no variable {name!r} at this point")

    def set_var(self, name: Any, value: Any) -> None:
        self.variables[name] = value

    def _unavailable(self, what: str) -> TracingError:
        return TracingError(f"{what} is only available when the program runs, not while tracing")

    def text(self) -> str:
        raise self._unavailable("s.text()")

    def messages(self) -> list[dict[str, Any]]:
        raise self._unavailable("s.messages()")

    def text_iter(self, var_name: Any = None) -> Iterator[str]:
        raise self._unavailable("s.text_iter()")

    def get_meta_info(self, name: Any) -> Any:
        raise self._unavailable("s.get_meta_info()")

    def sync(self) -> None:
        pass

    def error(self) -> None:
        return None

    def __contains__(self, name: Any) -> bool:
        return name in self.variables

    def __repr__(self) -> str:
        return f"TracerProgramState({len(self.nodes)} nodes, {len(self.child_states)} forks)"

    def __del__(self) -> None:
        pass

    # ----- results -----

    def all_streams(self) -> list["TracerProgramState"]:
        """This stream and every fork's, each parent before its forks."""
        streams = [self]
        for child in self.child_states:
            streams += child.all_streams()
        return streams

    def prefix_text(self) -> str:
        """The constant text this stream starts with (role markers included)."""
        text, history = "", []
        for node in self.nodes:
            if isinstance(node, Constant):
                text += node.value
            elif isinstance(node, RoleBegin):
                text += self.chat_template.get_prefix_and_suffix(node.role, history)[0]
            elif isinstance(node, RoleEnd):
                text += self.chat_template.get_prefix_and_suffix(node.role, history)[1]
                history.append({"role": node.role, "content": ""})
            elif not isinstance(node, (VarScopeBegin, VarScopeEnd)):
                break
        return text

    def graph_text(self) -> str:
        """One line per node: `stream k: %id = %prev + Node(...)`."""
        names = {s.pid: i for i, s in enumerate(self.all_streams())}
        lines = []
        for stream in self.all_streams():
            for node in stream.nodes:
                prev = f"%{node.prev_node.node_id} + " if node.prev_node is not None else ""
                lines.append(f"stream {names[stream.pid]}: %{node.node_id} = {prev}{node!r}")
        return "\n".join(lines)

    def print_graph(self) -> None:
        print(self.graph_text())


def _template_of(backend: Any) -> ChatTemplate:
    if backend is None:
        from radixlm.core.lang.config import global_config
        backend = global_config.default_backend
    if backend is None:
        return get_chat_template("default")
    from radixlm.core.lang.backends.resolve import resolve_backend
    return resolve_backend(backend).get_chat_template()


def trace_program(function: Any, kwargs: dict[str, Any], backend: Any = None) -> TracerProgramState:
    """The whole program as a graph. Arguments not in kwargs (nor bound) are placeholders; a
    program whose Python code depends on a run-time value raises TracingError."""
    arguments = {name: Argument(name) for name in function.arg_names}
    arguments.update(kwargs)
    arguments.update(function.bind_arguments)
    tracer = TracerProgramState(_template_of(backend), arguments, only_prefix=False)
    tracer.ret_value = function.func(tracer, **arguments)
    return tracer


def extract_prefix(function: Any, backend: Any, kwargs: dict[str, Any] | None = None) -> str:
    """The constant text the program starts with, for these arguments (placeholders where not
    given): its Python code runs until the first thing that is not constant text."""
    arguments: dict[str, Any] = {name: Argument(name) for name in function.arg_names}
    arguments.update(kwargs or {})
    arguments.update(function.bind_arguments)
    tracer = TracerProgramState(_template_of(backend), arguments, only_prefix=True)
    try:
        function.func(tracer, **arguments)
    except Exception:  # StopTracing, a placeholder refusing, or the program's own code: stop there
        pass
    return tracer.prefix_text()


def cache_program(function: Any, backend: Any) -> str:
    prefix = extract_prefix(function, backend)
    if prefix:
        backend.cache_prefix(prefix)
    return prefix


def precache_batch(function: Any, backend: Any, batch: list[dict[str, Any]]) -> str:
    """Sends the constant prefix common to every program of a batch once, so the batch's
    requests find it in the radix cache instead of racing to compute it."""
    prefix = os.path.commonprefix([extract_prefix(function, backend, kwargs) for kwargs in batch])
    if prefix:
        backend.cache_prefix(prefix)
    return prefix
