"""Chat-model calls as programs of radixlm's program model (core.lang), run by its interpreter.

A call is the rendered prompt followed by one gen:

    @function
    def chat(s, call):
        s += call.prompt                          # the conversation, in the model's chat template
        s += gen("output", **call.params)         # sampling, stops, constraint (tools, JSON schema)

Several calls over one input whose prompts share a prefix (the branches of a RunnableParallel) are one
fork/join program: the shared prefix is appended once and prefilled once at the fork, then every branch
appends its own rest and gen, concurrently. A batch of calls is run the way `run_batch` runs a program:
the prefix common to the whole batch is found by tracing and sent once (max_new_tokens=0), then the
calls go to the engine together, whose cache-aware scheduler serves the longest cached prefix first.
"""

from __future__ import annotations

import base64
import os
from dataclasses import dataclass
from typing import Any, Iterator

from radixlm.adapters.langchain.tools import ToolMode
from radixlm.core.lang.backends.base import BaseBackend
from radixlm.core.lang.function import function
from radixlm.core.lang.state import ProgramState
from radixlm.core.lang.ir import Gen, GenParams, Image
from radixlm.core.lang.tracer import precache_batch


@dataclass
class ChatCall:
    """One chat-model call, translated: what to append, how to generate, how to read the reply."""

    prompt: str
    params: GenParams
    mode: ToolMode
    model_name: str
    # None: no logprobs; otherwise how many alternatives to report per token.
    top_logprobs: int | None = None
    # The prompt's images (data URLs), one per image_token in it, in order.
    images: tuple[str, ...] = ()
    image_token: str = ""

    @property
    def parsed_whole(self) -> bool:
        """Whether the reply must be complete before it can be read (it may hold tool calls)."""
        return self.mode.kind != "none"


def append_prompt(s: Any, call: ChatCall, start: int = 0) -> None:
    """Appends call.prompt[start:], its images (sgl.image) where their placeholders are; a prompt with
    images is appended whole (start 0)."""
    if not call.images:
        s += call.prompt[start:]
        return
    texts = call.prompt.split(call.image_token)
    s += texts[0]
    for image, text in zip(call.images, texts[1:]):
        s += Image(base64.b64decode(image.partition(",")[2]))
        s += text


@function
def chat_program(s: Any, call: ChatCall) -> None:
    append_prompt(s, call)
    s += Gen("output", call.params)


@function
def fork_program(s: Any, prefix: str, calls: list[ChatCall]) -> Any:
    s += prefix
    branches = s.fork(len(calls))
    for branch, call in zip(branches, calls):
        append_prompt(branch, call, len(prefix))
        branch += Gen("output", call.params)
    branches.join()
    return branches


def shared_prefix(calls: list[ChatCall]) -> str:
    """The text the calls' prompts share (none when a prompt has images: those are appended whole)."""
    if len(calls) < 2 or any(c.images for c in calls):
        return ""
    return os.path.commonprefix([c.prompt for c in calls])


def precache(backend: BaseBackend, calls: list[ChatCall]) -> str:
    """Sends the prefix common to a batch of calls once, before the batch runs; returns it."""
    if len(calls) < 2 or any(c.images for c in calls):
        return ""
    return precache_batch(chat_program, backend, [{"call": call} for call in calls])


def result(state: ProgramState, timeout: float | None = None) -> tuple[str, dict[str, Any]]:
    """The reply of a finished (or finishing) chat program: its text and the engine's meta_info."""
    try:
        state.stream_executor.get_meta_info("output", timeout)
    except TimeoutError:
        raise TimeoutError(f"no reply within {timeout} s") from None
    error = state.error()
    if error is not None:
        raise error
    return state["output"], state.get_meta_info("output")


def run_call(backend: BaseBackend, call: ChatCall, timeout: float | None) -> tuple[str, dict[str, Any]]:
    return result(chat_program.run(call=call, backend=backend), timeout)


def stream_call(backend: BaseBackend, call: ChatCall) -> tuple[Iterator[str], ProgramState]:
    """The reply's text as it is generated, and the state to read the final meta_info from."""
    state = chat_program.run(call=call, backend=backend, stream=True)
    return state.text_iter("output"), state


def run_forked(backend: BaseBackend, batch: list[list[ChatCall]]) -> list[list[tuple[str, dict[str, Any]]]]:
    """Runs, for each item of the batch, its calls as one fork/join program; the prefix common to
    the whole batch is sent once first. Returns (text, meta_info) per call."""
    programs = [{"prefix": shared_prefix(calls), "calls": calls} for calls in batch]
    if len(programs) == 1:
        states = [fork_program.run(**programs[0], backend=backend)]
    else:
        states = fork_program.run_batch(programs, backend=backend, num_threads=len(programs))
    out = []
    for state in states:
        state.sync()
        if state.error() is not None:
            raise state.error()  # the program failed before forking
        out.append([result(branch) for branch in state.ret_value])
    return out
