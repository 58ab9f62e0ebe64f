"""LangChain runnables -> radixlm programs: `to_program(runnable)`.

A chain is read as [steps before] -> model stage -> [steps after]. The steps before (prompt templates,
passthroughs, lambdas) run in Python and produce the model's input; the steps after (output parsers,
...) run on its reply. The model stage is either one ChatSGLang call (possibly bound: tools, structured
output, stop, ...) or a RunnableParallel whose branches call ChatSGLang models on one engine:

- one call: the program is `s += prompt; s += gen(...)`; a batch of inputs is one batch program (the
  prompts' common prefix computed once, then all calls in flight together, served longest cached
  prefix first) -- this is what `chain.batch()` does on its own as well, through ChatSGLang.batch;
- RunnableParallel: one fork/join program per input: the branches' common prompt prefix is appended
  and prefilled once, then each branch generates from it concurrently.

Model calls after the first stage (a second model later in the chain) run as ordinary LangChain steps.
`str(to_program(r))` shows the program in the SGLang language, with the inputs as placeholders.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from langchain_core.runnables import Runnable, RunnableBinding, RunnableConfig, RunnableParallel, RunnableSequence
from langchain_core.runnables.base import coerce_to_runnable
from langchain_core.runnables.config import get_config_list, run_in_executor

from radixlm.adapters.langchain.chat_model import ChatSGLang
from radixlm.adapters.langchain.program import ChatCall, run_forked, shared_prefix
from radixlm.core.lang.ir import GenParams

# Stand-ins for the inputs when the program is shown: private-use characters cannot clash with text.
_OPEN, _CLOSE = "\ue000", "\ue001"
_PLACEHOLDER = re.compile(f"{_OPEN}(\\w+){_CLOSE}")


@dataclass
class ModelCall:
    """A ChatSGLang call site: the model, the options its bindings add, and the step as written."""

    llm: ChatSGLang
    options: dict[str, Any]
    step: Runnable

    def call(self, model_input: Any) -> ChatCall:
        options = dict(self.options)
        stop = options.pop("stop", None)
        return self.llm.to_call(self.llm._convert_input(model_input).to_messages(), stop, **options)


@dataclass
class Branch:
    """A path to a model call: Python steps before it, the call, Python steps after it. A branch
    without a call (`model` None) runs as it is."""

    before: list[Runnable] = field(default_factory=list)
    model: ModelCall | None = None
    after: list[Runnable] = field(default_factory=list)


def _model_call(step: Runnable) -> ModelCall | None:
    options: dict[str, Any] = {}
    node = step
    while isinstance(node, RunnableBinding):
        options = {**node.kwargs, **options}  # an outer binding's options override an inner one's
        node = node.bound
    return ModelCall(node, options, step) if isinstance(node, ChatSGLang) else None


def _steps(runnable: Runnable) -> list[Runnable]:
    return list(runnable.steps) if isinstance(runnable, RunnableSequence) else [runnable]


def _branch(runnable: Runnable) -> Branch:
    steps = _steps(runnable)
    for i, step in enumerate(steps):
        model = _model_call(step)
        if model is not None:
            return Branch(steps[:i], model, steps[i + 1:])
    return Branch(steps)


def _run(steps: list[Runnable], value: Any, config: RunnableConfig | None) -> Any:
    for step in steps:
        value = step.invoke(value, config)
    return value


def _run_batch(steps: list[Runnable], values: list[Any], config: Any) -> list[Any]:
    for step in steps:
        values = step.batch(values, config)
    return values


class LangChainProgram(Runnable[Any, Any]):
    """A runnable translated into a radixlm program. Use it like the runnable it came from (invoke,
    batch, ...); `str(program)` shows the program."""

    def __init__(self, source: Runnable | dict[str, Any]) -> None:
        source = coerce_to_runnable(source)  # a dict of runnables is a RunnableParallel
        self.source = source
        steps = _steps(source)
        # The stage: one model call (`model`), or a RunnableParallel with model calls (`branches`).
        self.model: ModelCall | None = None
        self.branches: dict[str, Branch] | None = None
        for i, step in enumerate(steps):
            self.before, self.after = steps[:i], steps[i + 1:]
            self.model = _model_call(step)
            if self.model is not None:
                return
            if isinstance(step, RunnableParallel):
                self.branches = {key: _branch(r) for key, r in step.steps__.items()}
                if any(b.model is not None for b in self.branches.values()):
                    return
                self.branches = None
        raise ValueError(f"{type(source).__name__} has no ChatSGLang call (alone or in a RunnableParallel) "
                         "to translate")

    # ----- the program for an input -----

    def calls(self, stage_input: Any, config: RunnableConfig | None = None) -> dict[str, ChatCall]:
        """The model calls of the stage, by branch ("output" for a single call), for the stage's input
        (what the steps before the stage produced)."""
        if self.model is not None:
            return {"output": self.model.call(stage_input)}
        return {key: b.model.call(_run(b.before, stage_input, config))
                for key, b in self.branches.items() if b.model is not None}

    def _models(self) -> list[ChatSGLang]:
        if self.model is not None:
            return [self.model.llm]
        return [b.model.llm for b in self.branches.values() if b.model is not None]

    def _backend(self) -> Any:
        models = self._models()
        backends = {id(m.connection().backend): m.connection().backend for m in models}
        if len(backends) != 1:
            raise ValueError("RunnableParallel branches run as one fork/join program only when their ChatSGLang "
                             "models share one engine or server")
        return next(iter(backends.values()))

    # ----- running -----

    def invoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        return self.batch([input], config, **kwargs)[0]

    def batch(self, inputs: list[Any], config: RunnableConfig | list[RunnableConfig] | None = None, *,
              return_exceptions: bool = False, **kwargs: Any) -> list[Any]:
        if return_exceptions:
            raise NotImplementedError("LangChainProgram.batch runs the batch as one program; "
                                      "return_exceptions is not supported")
        configs = get_config_list(config, len(inputs))
        stage_inputs = _run_batch(self.before, list(inputs), configs)
        if self.model is not None:
            outputs = self.model.step.batch(stage_inputs, configs, **kwargs)  # ChatSGLang.batch: one program
        else:
            outputs = self._fork_join(stage_inputs, configs)
        return _run_batch(self.after, outputs, configs)

    async def abatch(self, inputs: list[Any], config: RunnableConfig | list[RunnableConfig] | None = None, *,
                     return_exceptions: bool = False, **kwargs: Any) -> list[Any]:
        return await run_in_executor(None, lambda: self.batch(inputs, config, return_exceptions=return_exceptions,
                                                              **kwargs))

    def _fork_join(self, stage_inputs: list[Any], configs: list[RunnableConfig]) -> list[dict[str, Any]]:
        plans = [self.calls(x, c) for x, c in zip(stage_inputs, configs)]
        replies = run_forked(self._backend(), [list(plan.values()) for plan in plans])
        outputs = []
        for x, config, plan, branch_replies in zip(stage_inputs, configs, plans, replies):
            values = dict(zip(plan, branch_replies))
            out = {}
            for key, branch in self.branches.items():
                if branch.model is None:
                    out[key] = _run(branch.before, x, config)
                else:
                    call, (text, meta) = plan[key], values[key]
                    out[key] = _run(branch.after, branch.model.llm.to_message(call, text, meta), config)
            outputs.append(out)
        return outputs

    # ----- showing -----

    def __str__(self) -> str:
        names = _input_names(self.source)
        symbolic = {n: f"{_OPEN}{n}{_CLOSE}" for n in names} if names else f"{_OPEN}input{_CLOSE}"
        args = ", ".join(names or ["input"])
        lines = ["@function", f"def program(s, {args}):"]
        try:
            calls = self.calls(_run(self.before, symbolic, None))
        except Exception as error:  # the steps before the model need real inputs
            return "\n".join(lines + [f"    # the prompt is computed per input ({error}); then:",
                                      "    s += gen('output')"])
        if self.before:
            lines.insert(0, f"# input prepared by: {' | '.join(type(s).__name__ for s in self.before)}")
        prefix = _cut_placeholder(shared_prefix(list(calls.values())))
        # Every gen also stops at the chat template's end-of-turn marker (the interpreter adds it).
        template_stops = list(self._models()[0].connection().backend.get_chat_template().stop_str)
        gens = {name: _gen(name, call.params, template_stops) for name, call in calls.items()}
        if len(calls) == 1:
            (name, call), = calls.items()
            lines.append(f"    s += {_text(call.prompt)}")
            lines.append(f"    s += {gens[name]}")
        else:
            lines.append(f"    s += {_text(prefix)}")
            lines.append(f"    forks = s.fork({len(calls)})")
            for i, (name, call) in enumerate(calls.items()):
                rest = call.prompt[len(prefix):]
                lines.append(f"    forks[{i}] += {_text(rest) + ' + ' if rest else ''}{gens[name]}")
            lines.append("    forks.join()")
        if self.after:
            lines.append(f"# output then goes through: {' | '.join(type(s).__name__ for s in self.after)}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"LangChainProgram({type(self.source).__name__})"


def to_program(runnable: Runnable | dict[str, Any]) -> LangChainProgram:
    """The radixlm program of a LangChain runnable whose model calls are ChatSGLang's: a runnable that
    runs it (invoke/batch/...), shown by `print(...)`. A chain `prompt | ChatSGLang(...) | parser` runs
    batches as one shared-prefix program; a RunnableParallel of such chains on one engine runs as
    fork/join, its branches' shared prompt prefix computed once."""
    return LangChainProgram(runnable)


def _input_names(runnable: Runnable) -> list[str]:
    try:
        schema = runnable.get_input_jsonschema()
    except Exception:
        return []
    return list(schema.get("properties", {})) if schema.get("type") == "object" else []


def _cut_placeholder(prefix: str) -> str:
    """A prefix that does not end inside a placeholder."""
    start = prefix.rfind(_OPEN)
    return prefix[:start] if start > prefix.rfind(_CLOSE) else prefix


def _text(text: str) -> str:
    """Python for text with placeholders: "..." + name + "..."."""
    pieces = _PLACEHOLDER.split(text)
    parts = [repr(piece) if i % 2 == 0 else piece for i, piece in enumerate(pieces) if piece or i % 2]
    return " + ".join(parts) or '""'


def _gen(name: str, params: GenParams, template_stops: list[str]) -> str:
    shown = []
    params = dataclasses.replace(params, stop=params.stop_list() + [s for s in template_stops
                                                                      if s not in params.stop_list()])
    for key in ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
                "presence_penalty", "stop", "return_logprob", "top_logprobs_num", "json_schema"):
        value = getattr(params, key)
        if value is None or value == []:
            continue
        if key == "json_schema":
            value = _short(repr(value))
        shown.append(f"{key}={value if key == 'json_schema' else repr(value)}")
    return f"gen({', '.join([repr(name)] + shown)})"


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."
