"""The interpreter: each program state is an asynchronous stream of expressions.

`s += expr` only queues `expr` on the state's stream; a worker thread executes the stream in order
against the backend. So the Python code of a program runs ahead of the model, forks run
concurrently (one stream each), and the program blocks only where it reads a value (`s["x"]`,
`s.text()`), which waits for the expression that produces it. An error stops its own stream only:
it is kept on the state (`s.error()`) and raised where one of its missing values is read.
"""

from __future__ import annotations

import base64
import queue
import threading
import uuid
from typing import TYPE_CHECKING, Any, Iterator

from radixlm.core.lang.backends import speculative
from radixlm.core.lang.chat_template import ChatTemplate
from radixlm.core.lang.config import global_config
from radixlm.core.lang.errors import ProgramError
from radixlm.core.lang.ir import (
    CommitLazy, ConcateAndAppend, Constant, Expr, ExprList, Fork, Gen, GenParams, Image, Video,
    RoleBegin, RoleEnd, Select, Variable, VarScopeBegin, VarScopeEnd, as_expr,
)

if TYPE_CHECKING:
    from radixlm.core.lang.backends.base import BaseBackend

_END = object()  # queued by end(): the program appends nothing more


class GatherVariables(Expr):
    """join() in its default mode: the parent gets, for every variable the forks created, the list
    of their values (in fork order)."""

    def __init__(self, states: list[Any]) -> None:
        super().__init__()
        self.states = states

    def __repr__(self) -> str:
        return f"GatherVariables({len(self.states)} states)"


class StreamExecutor:
    """Executes one state's stream of expressions in a worker thread and holds its results."""

    def __init__(self, backend: "BaseBackend", arguments: dict[str, Any], defaults: GenParams,
                 chat_template: ChatTemplate | None = None, stream: bool = False,
                 num_api_spec_tokens: int | None = None) -> None:
        self.sid = uuid.uuid4().hex
        self.backend = backend
        self.arguments = arguments
        self.defaults = defaults
        self.stream = stream
        self.chat_template = chat_template or backend.get_chat_template()

        self.text_ = ""
        self.messages_: list[dict[str, Any]] = []
        self.variables: dict[Any, Any] = {}
        self.meta_info: dict[Any, Any] = {}
        self.cur_role: str | None = None
        self.cur_role_begin_pos: int | None = None
        self.images_: list[tuple[str, Any]] = []  # (label, base64 data): an image's, or a list of a video's frames
        self.cur_images: list[tuple[str, str]] = []
        self.fork_start_text_pos: int | None = None
        self.fork_variable_names: set[Any] = set()
        self.error_: BaseException | None = None
        self.is_finished = False

        # API speculative execution (paper §5); only API backends use it, they cannot reuse KV.
        use_spec = num_api_spec_tokens is not None and backend.supports_api_speculation and not stream
        self.num_api_spec_tokens = num_api_spec_tokens if use_spec else None
        self.speculation = speculative.CompletionSpeculation() if use_spec else None
        self.spec_turn: list[speculative.TurnItem] | None = None

        # Per variable name, how many queued expressions will still set it (a loop may gen the
        # same name again): a read waits until none is left.
        self._pending: dict[Any, int] = {}
        self._scope_starts: dict[str, int] = {}
        self._fork_points: dict[int, threading.Event] = {}
        self._fork_snapshots: dict[int, dict[str, Any]] = {}
        self._changed = threading.Condition()
        # With stream=True: the pieces of text and of each variable, in order, for text_iter.
        self._text_pieces: list[str] = []
        self._var_pieces: dict[Any, list[str]] = {}
        self._ended = False
        self._queue: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._work, daemon=True, name=f"radixlm-stream-{self.sid[:8]}")
        self._worker.start()

    # ----- the program's side -----

    def submit(self, expr: Expr) -> None:
        self._register_outputs(expr)
        self._queue.put(expr)

    def sync(self) -> None:
        """Waits until everything submitted so far has executed (or been skipped after an error)."""
        self._queue.join()

    def end(self) -> None:
        if not self._ended:
            self._ended = True
            self._queue.put(_END)

    def _wait_for(self, name: Any, timeout: float | None = None) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: not self._pending.get(name) or self.error_ is not None,
                                          timeout)

    def get_var(self, name: Any) -> Any:
        if name in self._pending:
            self._wait_for(name)
        elif name not in self.variables:
            self.sync()  # a pending join may be about to create it
        if self._pending.get(name) or (name not in self.variables and self.error_ is not None):
            raise ProgramError(f"variable {name!r} was not produced: {self.error_!r}") from self.error_
        if name in self.variables:
            return self.variables[name]
        raise KeyError(f"the program has no variable {name!r}")

    def set_var(self, name: Any, value: Any) -> None:
        self.variables[name] = value

    def get_meta_info(self, name: Any, timeout: float | None = None) -> Any:
        if not self._wait_for(name, timeout):
            raise TimeoutError(f"timed out waiting for variable {name!r}")
        return self.meta_info.get(name)

    def text(self) -> str:
        self.sync()
        return self.text_

    def messages(self) -> list[dict[str, Any]]:
        self.sync()
        return self.messages_

    def error(self) -> BaseException | None:
        self.sync()
        return self.error_

    def fail(self, error: BaseException) -> None:
        """Records an error raised outside the stream (in the program's own Python code)."""
        if self.error_ is None:
            self.error_ = error
        self._release_waiters()

    def fork(self, size: int) -> list["StreamExecutor"]:
        """`size` new streams that continue from this one's current state."""
        size = int(size)
        if size < 1:
            raise ValueError("fork size must be >= 1")
        fork = Fork(size)
        self.submit(fork)
        children = [self._child() for _ in range(size)]
        for child in children:
            child.submit(ForkItem(self, fork))
        return children

    def _child(self) -> "StreamExecutor":
        return StreamExecutor(self.backend, self.arguments, self.defaults, self.chat_template, self.stream,
                              self.num_api_spec_tokens)

    # ----- streaming reads -----

    def iter_text(self, var_name: Any = None) -> Iterator[str]:
        """Yields the state's text (or one variable) piece by piece as it is produced: every
        appended text and every streamed chunk of a gen is one piece."""
        pieces = self._text_pieces if var_name is None else self._var_pieces.setdefault(var_name, [])

        def done() -> bool:
            if self.is_finished or (var_name is not None and self.error_ is not None):
                return True
            return var_name is not None and var_name in self._pending and not self._pending[var_name]

        sent = 0
        while True:
            with self._changed:
                self._changed.wait_for(lambda: len(pieces) > sent or done())
                new, finished = pieces[sent:], done()
            sent += len(new)
            yield from (piece for piece in new if piece)
            if finished and sent >= len(pieces):
                value = self.variables.get(var_name)
                if var_name is not None and sent == 0 and isinstance(value, str) and value:
                    yield value  # a variable set at once (a select, a var_scope)
                return

    # ----- the worker's side -----

    def _work(self) -> None:
        while True:
            expr = self._queue.get()
            try:
                if expr is _END:
                    self.backend.end_program(self)
                    return
                if self.error_ is None:
                    self._execute(expr)
            except Exception as error:  # the stream stops here; the program and other streams go on
                self.error_ = error
                self._release_waiters()
            finally:
                self._queue.task_done()
                if expr is _END:
                    with self._changed:
                        self.is_finished = True
                        self._changed.notify_all()
                else:
                    self._notify()

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def _release_waiters(self) -> None:
        for event in list(self._fork_points.values()):
            event.set()
        self._notify()

    def _register_outputs(self, expr: Expr) -> None:
        if isinstance(expr, ExprList):
            for item in expr.exprs:
                self._register_outputs(item)
        elif isinstance(expr, (Gen, Select, VarScopeEnd)):
            with self._changed:
                self._pending[expr.name] = self._pending.get(expr.name, 0) + 1
        elif isinstance(expr, Fork):
            self._fork_points[expr.node_id] = threading.Event()

    def _set_var(self, name: Any, value: Any, meta: Any = None) -> None:
        with self._changed:
            self.variables[name] = value
            self.meta_info[name] = meta
            if self._pending.get(name):
                self._pending[name] -= 1
            self._changed.notify_all()

    def _execute(self, expr: Expr | str) -> None:
        expr = as_expr(expr)
        if isinstance(expr, Constant):
            self._fill(expr.value)
        elif isinstance(expr, ExprList):
            for item in expr.exprs:
                self._execute(item)
        elif isinstance(expr, Gen):
            self._gen(expr)
        elif isinstance(expr, Select):
            self._select(expr)
        elif isinstance(expr, RoleBegin):
            self._role_begin(expr.role)
        elif isinstance(expr, RoleEnd):
            self._role_end(expr.role)
        elif isinstance(expr, Variable):
            self._fill(str(expr.executor.get_var(expr.name)))
        elif isinstance(expr, VarScopeBegin):
            self._scope_starts[expr.name] = len(self.text_)
        elif isinstance(expr, VarScopeEnd):
            if expr.name not in self._scope_starts:
                raise ProgramError(f"var_scope {expr.name!r} ended without beginning")
            self._set_var(expr.name, self.text_[self._scope_starts.pop(expr.name):])
        elif isinstance(expr, Image):
            self._image(expr)
        elif isinstance(expr, Video):
            self._video(expr)
        elif isinstance(expr, CommitLazy):
            self.backend.commit_lazy_operations(self)
        elif isinstance(expr, Fork):
            self._fork_point(expr)
        elif isinstance(expr, ForkItem):
            self._start_from_fork(expr.parent, expr.fork)
        elif isinstance(expr, ConcateAndAppend):
            self._concate_and_append([_executor_of(s) for s in expr.states])
        elif isinstance(expr, GatherVariables):
            self._gather([_executor_of(s) for s in expr.states])
        else:
            raise ProgramError(f"cannot execute {expr!r}")

    # ----- text -----

    def _fill(self, value: str, role_marker: bool = False) -> None:
        if self.spec_turn is not None and not role_marker:
            self.spec_turn.append(speculative.TurnItem(text=value))
            return
        if self.speculation is not None:
            self.speculation.consume_text(value)
        with self._changed:
            self.text_ += value
            if self.stream:
                self._text_pieces.append(value)

    def _image(self, image: Image) -> None:
        if not self.backend.supports_vision:
            raise ProgramError(f"{type(self.backend).__name__} has no vision support; sgl.image({image.label()!r}) "
                               "needs a vision-language model (a LLaVA checkpoint, or an OpenAI chat model)")
        data = base64.b64encode(_image_bytes(image.source)).decode()
        self.images_.append((image.label(), data))
        self.cur_images.append((image.label(), data))
        self._fill(self.chat_template.image_token)

    def _video(self, video: Video) -> None:
        if not self.backend.supports_video:
            raise ProgramError(f"{type(self.backend).__name__} takes no video: sgl.video needs a video model "
                               "(Qwen2-VL) on the local engine or a radixlm server")
        frames = [base64.b64encode(_image_bytes(frame)).decode() for frame in video.frames]
        self.images_.append((repr(video), frames))  # a video: its frames' data, in prompt order with images
        self._fill(self.chat_template.video_token)

    # ----- roles -----

    def _role_begin(self, role: str) -> None:
        if self.cur_role is not None:
            raise ProgramError(f"role {role!r} begins inside role {self.cur_role!r}; roles do not nest")
        if not self.messages_ and role != "system" and self.chat_template.default_system_prompt:
            self._role_begin("system")
            self._fill(self.chat_template.default_system_prompt)
            self._role_end("system")
        prefix, _ = self.chat_template.get_prefix_and_suffix(role, self.messages_)
        self.cur_role = role
        self._fill(prefix, role_marker=True)
        self.cur_role_begin_pos = len(self.text_)
        if role == "assistant" and self.num_api_spec_tokens is not None and self.backend.is_chat_model:
            self.spec_turn = []

    def _role_end(self, role: str) -> None:
        if self.cur_role != role:
            raise ProgramError(f"role {role!r} ends but the open role is {self.cur_role!r}")
        if self.spec_turn is not None:
            items, self.spec_turn = self.spec_turn, None
            self._run_speculative_turn(items)
        content = self.text_[self.cur_role_begin_pos:].lstrip()
        _, suffix = self.chat_template.get_prefix_and_suffix(role, self.messages_)
        self.cur_role = None
        self._fill(suffix, role_marker=True)
        if self.cur_images:
            parts: list[dict[str, Any]] = [{"type": "text", "text": content}]
            parts += [{"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{data}"}}
                      for _, data in self.cur_images]
            self.messages_.append({"role": role, "content": parts})
            self.cur_images = []
        else:
            self.messages_.append({"role": role, "content": content})

    # ----- model calls -----

    def resolve_params(self, params: GenParams) -> GenParams:
        """The run's defaults overridden by this gen's own parameters, plus the chat template's
        end-of-turn markers as stops."""
        resolved = self.defaults.override(params)
        resolved.stop = resolved.stop_list() + [s for s in self.chat_template.stop_str
                                                if s not in resolved.stop_list()]
        resolved.stop_token_ids = list(resolved.stop_token_ids or []) + [
            t for t in self.chat_template.stop_token_ids if t not in (resolved.stop_token_ids or [])]
        return resolved

    def _gen(self, expr: Gen) -> None:
        params = self.resolve_params(expr.params)
        if self.spec_turn is not None:
            self.spec_turn.append(speculative.TurnItem(name=expr.name, params=params))
            return
        if self.stream:
            self._gen_streaming(expr.name, params)
            return
        if self.speculation is not None and not self.backend.is_chat_model:
            text, meta = self.speculation.generate(self, params)
        else:
            text, meta = self.backend.generate(self, params)
        self._fill(text)
        self._set_var(expr.name, text, meta)

    def _gen_streaming(self, name: Any, params: GenParams) -> None:
        self.variables[name] = ""
        for chunk, meta in self.backend.generate_stream(self, params):
            with self._changed:
                self.text_ += chunk
                self._text_pieces.append(chunk)
                self._var_pieces.setdefault(name, []).append(chunk)
                self.variables[name] += chunk
                self.meta_info[name] = meta
                self._changed.notify_all()
        self._set_var(name, self.variables[name], self.meta_info.get(name))

    def _select(self, expr: Select) -> None:
        decision = self.backend.select(self, expr.choices, expr.temperature, expr.choices_method)
        self._fill(decision.decision)
        self._set_var(expr.name, decision.decision, decision.meta_info)

    def _run_speculative_turn(self, items: list[speculative.TurnItem]) -> None:
        """An assistant turn of a chat model under speculation: one call for the whole turn, its
        pieces matched to the turn's text and gens; what does not match is generated normally."""
        values = speculative.speculate_turn(self, items)
        for item, value in zip(items, values):
            if item.is_text:
                self._fill(item.text)
            elif value is not None:
                self._fill(value)
                self._set_var(item.name, value, {"speculative": True})
            else:
                text, meta = self.backend.generate(self, item.params)
                self._fill(text)
                self._set_var(item.name, text, meta)

    # ----- fork / join -----

    def _fork_point(self, fork: Fork) -> None:
        if fork.number > 1 and (self.text_ or fork.hoisted_text) and global_config.enable_fork_precache:
            # Co-design with the radix cache: prefill the shared prefix once, before the branches.
            self.backend.commit_lazy_operations(self, extra_text=fork.hoisted_text)
        self._fork_snapshots[fork.node_id] = {
            "text_": self.text_, "messages_": list(self.messages_), "variables": dict(self.variables),
            "meta_info": dict(self.meta_info), "cur_role": self.cur_role,
            "cur_role_begin_pos": self.cur_role_begin_pos, "images_": list(self.images_),
            "cur_images": list(self.cur_images),
        }
        self._fork_points[fork.node_id].set()

    def _start_from_fork(self, parent: "StreamExecutor", fork: Fork) -> None:
        parent._fork_points[fork.node_id].wait()
        snapshot = parent._fork_snapshots.get(fork.node_id)
        if snapshot is None:
            raise ProgramError(f"the parent stream failed before the fork: {parent.error_!r}")
        for key, value in snapshot.items():
            setattr(self, key, list(value) if isinstance(value, list) else
                    dict(value) if isinstance(value, dict) else value)
        self.fork_start_text_pos = len(self.text_)
        self.fork_variable_names = set(self.variables)
        if fork.hoisted_text:
            self._fill(fork.hoisted_text)

    def _concate_and_append(self, children: list["StreamExecutor"]) -> None:
        # Without a KV-concatenation primitive in the engine, the forks' texts are appended as text;
        # the radix cache still reuses the parent's prefix.
        pieces = []
        for child in children:
            child.sync()
            if child.error_ is not None:
                raise ProgramError(f"a fork failed: {child.error_!r}") from child.error_
            pieces.append(child.text_[child.fork_start_text_pos:])
        self._fill("".join(pieces))

    def _gather(self, children: list["StreamExecutor"]) -> None:
        gathered: dict[Any, list[Any]] = {}
        for child in children:
            child.sync()
            for name in child.variables:
                if name not in child.fork_variable_names:
                    gathered.setdefault(name, []).append(child.variables[name])
        for name, values in gathered.items():
            self._set_var(name, values)


class ForkItem(Expr):
    """The first expression of a fork's stream: start from the parent's state at the fork."""

    def __init__(self, parent: StreamExecutor, fork: Fork) -> None:
        super().__init__()
        self.parent = parent
        self.fork = fork


def _executor_of(state: Any) -> StreamExecutor:
    """The executor of a ProgramState (state.py, above this module), or the executor itself."""
    return getattr(state, "stream_executor", state)


def _image_bytes(source: Any) -> bytes:
    """The encoded image sgl.image was given: a file's bytes, bytes as they are, a PIL image as PNG."""
    if isinstance(source, (bytes, bytearray)):
        return bytes(source)
    if isinstance(source, str):
        with open(source, "rb") as f:
            return f.read()
    if hasattr(source, "save"):  # a PIL image
        import io

        buf = io.BytesIO()
        source.save(buf, format="PNG")
        return buf.getvalue()
    raise ProgramError(f"sgl.image takes a path, bytes or a PIL image, not {type(source).__name__}")
