"""DSPy LM calls as one fork/join program.

The calls that a DSPy module makes together (`Module.batch`, `dspy.Parallel`) share a prefix: the
same instructions and demos, a different input at the end. They become one program of the program
model (core.lang), shaped as the prefix tree of their messages:

    root stream: the messages every call starts with (system prompt, demos)
    fork(k):     one branch per next message that differs
      branch:    its own messages ... down to a call's last message, then the assistant turn: gen
                 (n > 1: a fork of n gens)

The interpreter runs it: at each fork the text so far is sent once as a prefill-only request, so the
shared prefix is computed once and every branch finds it in the radix cache; the branches run
concurrently, so the engine batches their generations.

`CallBatcher` collects the calls that arrive together from several threads into one such program.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from radixlm.core.lang.errors import ProgramError
from radixlm.core.lang.state import ProgramState, new_state
from radixlm.core.lang.ir import Constant, ExprList, Gen, GenParams, Image, RoleBegin, RoleEnd

# A message's content: its text, or its text and images (encoded image bytes) in order.
Content = str | tuple[str | bytes, ...]

# The variable each call's generation is stored in.
_OUTPUT = "completion"


@dataclass
class LMCall:
    """One chat request: its messages as (role, content) pairs, its generation parameters, and how
    many samples to draw. A content is text, or a tuple of text and images (encoded bytes) in order."""

    messages: list[tuple[str, Content]]
    params: GenParams
    n: int = 1


@dataclass
class Sample:
    text: str
    meta_info: dict[str, Any]


@dataclass
class ProgramNode:
    """One stream of the program: the messages it appends after its parent's text, then either the
    generation of call number `call` or a fork into `children`."""

    messages: list[tuple[str, Content]]
    call: int | None = None
    children: list["ProgramNode"] = field(default_factory=list)

    def describe(self, calls: list[LMCall], indent: str = "") -> str:
        """The program as indented text: each stream's messages, forks and generations."""
        lines = [f"{indent}{role}: {_preview(content)}" for role, content in self.messages]
        if self.call is not None:
            call = calls[self.call]
            constraint, _ = call.params.constraint()
            kind = next(iter(constraint), None)
            gen = f"gen(call {self.call}, max_tokens={call.params.max_new_tokens}" + (f", {kind}" if kind else "") + ")"
            lines.append(f"{indent}assistant: " + (f"fork({call.n}) -> {gen}" if call.n > 1 else gen))
        elif self.children:
            lines.append(f"{indent}fork({len(self.children)})")
            for i, child in enumerate(self.children):
                lines.append(f"{indent}  branch {i}:")
                lines.append(child.describe(calls, indent + "    "))
        return "\n".join(lines)


def content_text(content: Content) -> str:
    """A content's text, an image standing as `<image>`."""
    if isinstance(content, str):
        return content
    return "".join(p if isinstance(p, str) else "<image>" for p in content)


def _preview(content: Content, width: int = 60) -> str:
    text = content_text(content)
    flat = text.replace("\n", "\\n")
    return repr(flat if len(flat) <= width else flat[:width] + "...") + f" ({len(text)} chars)"


def build_tree(calls: list[LMCall]) -> ProgramNode:
    """The prefix tree of the calls' message lists (see the module docstring)."""
    if not calls:
        raise ValueError("no calls")
    return _subtree(calls, list(range(len(calls))), 0)


def _subtree(calls: list[LMCall], members: list[int], depth: int) -> ProgramNode:
    if len(members) == 1:
        return ProgramNode(list(calls[members[0]].messages[depth:]), call=members[0])
    node = ProgramNode([])
    while True:
        heads = [calls[i].messages[depth] if depth < len(calls[i].messages) else None for i in members]
        if heads[0] is None or any(h != heads[0] for h in heads):
            break
        node.messages.append(heads[0])
        depth += 1
    groups: dict[Any, list[int]] = {}
    for i, head in zip(members, heads):
        # Calls whose messages end here (identical requests) each get their own branch.
        groups.setdefault(("end", i) if head is None else head, []).append(i)
    node.children = [_subtree(calls, group, depth) for group in groups.values()]
    return node


def run_program(backend: Any, calls: list[LMCall], tree: ProgramNode) -> list[list[Sample] | BaseException]:
    """Runs the program of `tree` on `backend`; per call, its n samples or the error that stopped it."""
    root = new_state(backend, {}, GenParams.run_defaults(), False, None)
    leaves: dict[int, list[ProgramState]] = {}
    _emit(root, tree, calls, leaves)
    root.stream_executor.end()
    results: list[list[Sample] | BaseException] = []
    for i in range(len(calls)):
        try:
            results.append([Sample(state.get_var(_OUTPUT), state.get_meta_info(_OUTPUT)) for state in leaves[i]])
        except ProgramError as error:
            # The engine's own error (a bad request, say) is more useful than the wrapper.
            results.append(error.__cause__ if error.__cause__ is not None else error)
    return results


def _emit(state: ProgramState, node: ProgramNode, calls: list[LMCall], leaves: dict[int, list[ProgramState]]) -> None:
    for role, content in node.messages:
        parts = [content] if isinstance(content, str) else content
        state += ExprList([RoleBegin(role), *(Constant(p) if isinstance(p, str) else Image(p) for p in parts),
                           RoleEnd(role)])
    if node.call is not None:
        call = calls[node.call]
        state += RoleBegin("assistant")
        if call.n == 1:
            state += Gen(_OUTPUT, call.params)
            leaves[node.call] = [state]
            return
        samples = state.fork(call.n)
        samples += Gen(_OUTPUT, call.params)
        leaves[node.call] = list(samples)
        samples.join()
        return
    branches = state.fork(len(node.children))
    for branch, child in zip(branches, node.children):
        _emit(branch, child, calls, leaves)
    branches.join()


@dataclass
class _Pending:
    call: LMCall
    done: threading.Event = field(default_factory=threading.Event)
    result: list[Sample] | BaseException | None = None


class CallBatcher:
    """Runs the calls that arrive together, from any number of threads, as one program.

    The first call to arrive leads a group: it waits until no other call has come for `window_s` (at
    most `max_wait_s` in all), takes every call that came meanwhile, runs their program and hands each
    caller its result. Calls that arrive while a group runs form the next group. A call from the main
    thread that finds the batcher idle (no call in flight, none in the last `window_s`) runs at once,
    so sequential code pays no latency; concurrent callers (dspy.Parallel, Module.batch, acall) run
    on worker threads.
    """

    def __init__(self, run: Callable[[list[LMCall]], list[list[Sample] | BaseException]],
                 window_s: float = 0.02, max_wait_s: float = 0.2) -> None:
        if window_s < 0 or max_wait_s < 0:
            raise ValueError("window_s and max_wait_s must be >= 0")
        self._run = run
        self.window_s = window_s
        self.max_wait_s = max(max_wait_s, window_s)
        self._changed = threading.Condition()
        self._waiting: list[_Pending] = []
        self._arrivals = 0
        self._last_arrival = float("-inf")
        self._in_flight = 0
        self._collecting = False

    def submit(self, call: LMCall) -> list[Sample]:
        """The call's samples; raises the error that stopped it."""
        item = _Pending(call)
        with self._changed:
            now = time.monotonic()
            busy = (self._in_flight > 0 or now - self._last_arrival < self.window_s
                    or threading.current_thread() is not threading.main_thread())
            self._waiting.append(item)
            self._arrivals += 1
            self._last_arrival = now
            self._in_flight += 1
            self._changed.notify_all()
            leader = not self._collecting
            self._collecting = True
        try:
            if leader:
                self._lead(wait=busy)
            item.done.wait()
        finally:
            with self._changed:
                self._in_flight -= 1
        if isinstance(item.result, BaseException):
            raise item.result
        return item.result

    def _lead(self, wait: bool) -> None:
        with self._changed:
            deadline = time.monotonic() + self.max_wait_s
            while wait and self.window_s > 0:
                seen = self._arrivals
                self._changed.wait(min(self.window_s, max(0.0, deadline - time.monotonic())))
                if self._arrivals == seen or time.monotonic() >= deadline:
                    break
            group, self._waiting = self._waiting, []
            self._collecting = False
        try:
            results = self._run([item.call for item in group])
        except BaseException as error:  # the program could not be built or started: all of them fail
            results = [error] * len(group)
        for item, result in zip(group, results):
            item.result = result
            item.done.set()
