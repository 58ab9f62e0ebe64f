"""`SGLangLM`: a `dspy.LM` whose calls run as programs of radixlm's program model.

    dspy.configure(lm=SGLangLM(engine=radixlm.Engine(...)))            # in-process
    dspy.configure(lm=SGLangLM(base_url="http://127.0.0.1:30000"))     # a radixlm server (native /generate)

It follows DSPy 3.4's contract for custom backends: a `dspy.LM` given an engine object whose
`complete(Request) -> Response` answers one lm15 request (`ProgramEngine`; `AsyncProgramEngine` for
`acall`). DSPy owns everything around that: turning a call's arguments into a Request, `n` (one request
per answer), its response cache, retries, history, usage tracking and callbacks.

Every request becomes an `LMCall` (messages, generation parameters). Requests made together by several
threads (dspy.Parallel, Module.batch) are grouped into one fork/join program whose shared prefix is
computed once (program.py). Replies follow the calling adapter's format through constrained decoding
when the call comes from a dspy.Predict via ChatAdapter or JSONAdapter (formats.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from typing import Any

import dspy
from dspy.lm15 import (Config, ImagePart, InvalidRequestError, Message, Request, Response, ServerError, TextPart,
                       TokenLogprob, TopLogprob, UnsupportedFeatureError, Usage)

from radixlm.adapters.dspy.formats import bound_schema, format_for_call
from radixlm.adapters.dspy.program import CallBatcher, LMCall, Sample, build_tree, content_text, run_program
from radixlm.core.runtime.sampling_params import SamplingParams
from radixlm.core.lang.backends.resolve import resolve_backend
from radixlm.core.lang.ir import GenParams

# The OpenAI-style call parameters DSPy can hand an engine and SGLangLM honours (`supported_params`).
_CALL_PARAMS = frozenset({
    "temperature", "top_p", "top_k", "max_tokens", "max_completion_tokens", "n", "stop", "presence_penalty",
    "frequency_penalty", "logprobs", "top_logprobs", "response_format",
})
# The lm15 Config fields honoured; any other one that is set is refused, by name.
_CONFIG_FIELDS = frozenset({"max_tokens", "temperature", "top_p", "top_k", "stop", "response_format",
                            "frequency_penalty", "presence_penalty", "logprobs", "extensions"})
# The engine's own extras (SGLang's names), which lm15 carries only in an explicit Request's
# `Config.extensions`: DSPy refuses them as keyword arguments of an ordinary call.
_EXTENSIONS = frozenset({"regex", "json_schema", "min_p", "min_tokens"})
_SAME = ("temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty")
# lm15 calls a system message that does not open the conversation a developer message.
_ROLES = {"user": "user", "assistant": "assistant", "developer": "system"}


class SGLangLM(dspy.LM):
    """A DSPy LM on a radixlm Engine (`engine=`) or a radixlm / SGLang server (`base_url=`).

    `constrain_format`: constrain replies to the calling adapter's format (ChatAdapter, JSONAdapter).
    `max_field_chars`: bound each free-text value and JSON string of a constrained reply (for models
    that do not end them by themselves, like the random-weight test model); None leaves it to the model.
    `batch_window_s`: how long a call waits for more calls while others are in flight (see CallBatcher).
    `chat_template`: a named template (core.lang.chat_template) for a server whose tokenizer cannot
    be loaded on this machine. Other keywords are default call parameters (`supported_params`).
    `lm.engine` is the DSPy engine (`ProgramEngine`), which holds the radixlm backend.
    """

    def __init__(self, engine: Any = None, *, base_url: str | None = None, model: str | None = None,
                 api_key: str | None = None, chat_template: str | None = None,
                 temperature: float | None = None, max_tokens: int | None = None,
                 constrain_format: bool = True, max_field_chars: int | None = None,
                 batch_window_s: float = 0.02, model_type: str = "chat", cache: bool = False,
                 num_retries: int = 0, callbacks: list[Any] | None = None, **kwargs: Any) -> None:
        if (engine is None) == (base_url is None):
            raise ValueError("SGLangLM needs exactly one of engine= (a radixlm.Engine) and base_url= (a server)")
        if model_type != "chat":
            raise ValueError("SGLangLM is a chat model (model_type='chat')")
        if max_field_chars is not None and max_field_chars < 1:
            raise ValueError("max_field_chars must be at least 1")
        unknown = set(kwargs) - _CALL_PARAMS
        if unknown:
            raise ValueError(f"SGLangLM does not support {sorted(unknown)}; supported: {sorted(_CALL_PARAMS)}"
                             + _extension_hint(unknown))
        if engine is not None:
            backend = resolve_backend(engine)
            names = (engine.served_model_name, engine.model_path)
            context_len = engine.context_len
        else:
            from radixlm.core.lang.backends.runtime_endpoint import RuntimeEndpoint

            base_url = base_url.rstrip("/").removesuffix("/v1")
            backend = RuntimeEndpoint(base_url, api_key=api_key, chat_template_name=chat_template)
            info = backend.model_info
            names = (info.get("served_model_name") or info.get("model_path"), info.get("model_path"))
            context_len = info.get("context_len")  # SGLang servers do not report it
        if model is not None and model not in names:
            raise ValueError(f"the model {model!r} is not served here; this backend serves {names[0]!r}")
        program_engine = ProgramEngine(_ProgramRunner(backend, batch_window_s), context_len, constrain_format,
                                       max_field_chars)
        super().__init__(model=model or names[0], model_type="chat", temperature=temperature,
                         max_tokens=max_tokens, cache=cache, callbacks=callbacks, num_retries=num_retries,
                         engine=program_engine, async_engine=AsyncProgramEngine(program_engine), **kwargs)
        self.base_url = base_url

    @property
    def constrain_format(self) -> bool:
        return self.engine.constrain_format

    @property
    def max_field_chars(self) -> int | None:
        return self.engine.max_field_chars

    @property
    def context_len(self) -> int | None:
        return self.engine.context_len

    @property
    def last_program(self) -> str | None:
        """The program of the last group of calls, as text (streams, forks, generations)."""
        return self.engine.runner.describe_last()

    def copy(self, **kwargs: Any) -> "SGLangLM":
        # The format options live on the engine: a copy that changes them gets an engine of its own,
        # which still shares the runtime (and the grouping of calls into programs).
        options = {name: kwargs.pop(name) for name in ("constrain_format", "max_field_chars") if name in kwargs}
        if options:
            engine = dataclasses.replace(self.engine, **options)
            kwargs.update(engine=engine, async_engine=AsyncProgramEngine(engine))
        return super().copy(**kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> "SGLangLM":
        # Deep copies of modules (optimizers make them) share the runtime, as copy() does.
        return self.copy()

    def dump_state(self) -> dict[str, Any]:
        # BaseLM's state, not dspy.LM's: that one would record the engine object, which SGLangLM
        # builds itself from these arguments.
        state = dspy.BaseLM.dump_state(self)
        state.update(constrain_format=self.constrain_format, max_field_chars=self.max_field_chars,
                     batch_window_s=self.engine.runner.batcher.window_s)
        if self.base_url is not None:
            state["base_url"] = self.base_url
        return state


class _ProgramRunner:
    """Groups calls (CallBatcher), runs each group as one program on a backend, and keeps the last
    program for inspection. Shared by an LM's copies."""

    def __init__(self, backend: Any, window_s: float) -> None:
        self.backend = backend
        self.batcher = CallBatcher(self.run, window_s=window_s)
        self._last: tuple[Any, list[LMCall]] | None = None

    def run(self, calls: list[LMCall]) -> list[list[Sample] | BaseException]:
        tree = build_tree(calls)
        self._last = (tree, calls)
        return run_program(self.backend, calls, tree)

    def describe_last(self) -> str | None:
        last = self._last
        return None if last is None else last[0].describe(last[1])


@dataclasses.dataclass(frozen=True)
class ProgramEngine:
    """DSPy's engine contract on radixlm: `complete(Request) -> Response` runs the request as a call of
    the program model. Its class attributes declare SGLangLM's capabilities: DSPy reads a custom
    engine's (`lm.supported_params`, `lm.supports_response_schema`, ...)."""

    runner: _ProgramRunner
    context_len: int | None
    constrain_format: bool = True
    max_field_chars: int | None = None

    supports_function_calling = False
    supports_reasoning = False
    supports_response_schema = True  # a response_format JSON schema is enforced by constrained decoding
    supported_params = _CALL_PARAMS

    def complete(self, request: Request) -> Response:
        messages = _chat_messages(request)
        call = LMCall(messages, self._gen_params(request, messages))
        try:
            (sample,) = self.runner.batcher.submit(call)
        except ValueError as error:  # the engine refused it: a prompt too long, a pattern it cannot compile
            raise InvalidRequestError(str(error)) from error
        meta = sample.meta_info
        reason = meta["finish_reason"]["type"]
        if reason == "abort":
            raise ServerError(f"the request was aborted: {meta.get('error', 'no reason given')}")
        usage = Usage(input_tokens=meta["prompt_tokens"], output_tokens=meta["completion_tokens"],
                      total_tokens=meta["prompt_tokens"] + meta["completion_tokens"],
                      cache_read_tokens=meta["cached_tokens"])
        logprobs = None if request.config.logprobs is None else _logprobs(meta, request.config.logprobs)
        return Response(id=f"chatcmpl-{uuid.uuid4().hex}", model=request.model,
                        message=Message.assistant(sample.text), finish_reason=reason, usage=usage, logprobs=logprobs)

    def stream(self, request: Request) -> Any:
        raise UnsupportedFeatureError("SGLangLM does not stream (a reply is sent whole)", feature="stream")

    def _gen_params(self, request: Request, messages: list[tuple[str, str]]) -> GenParams:
        config = request.config
        unsupported = [f.name for f in dataclasses.fields(config)
                       if f.name not in _CONFIG_FIELDS and getattr(config, f.name) != _default(f)]
        extensions = dict(config.extensions or {})
        unsupported += sorted(set(extensions) - _EXTENSIONS) + (["tools"] if request.tools else [])
        if unsupported:
            raise UnsupportedFeatureError(f"SGLangLM does not support {unsupported}", feature=unsupported[0])
        # Unset: up to the end of the context, as OpenAI-style servers do (the engine resolves None).
        params = GenParams(max_new_tokens=config.max_tokens, stop=list(config.stop) or None,
                           min_p=extensions.get("min_p"), min_new_tokens=extensions.get("min_tokens"),
                           **{name: getattr(config, name) for name in _SAME})
        if config.logprobs is not None:
            params.return_logprob = True
            params.return_text_in_logprobs = True
            params.top_logprobs_num = config.logprobs
        for key, value in self._constraint(config, extensions, messages).items():
            setattr(params, key, value)
        try:
            SamplingParams.from_dict(params.sampling_params())  # bad values fail here, on the caller's thread
        except ValueError as error:
            raise InvalidRequestError(str(error)) from error
        return params

    def _constraint(self, config: Config, extensions: dict[str, Any],
                    messages: list[tuple[str, str]]) -> dict[str, Any]:
        """The reply's constraint: an explicit regex or json_schema, else the calling adapter's format,
        else the response_format."""
        explicit = {key: extensions[key] for key in ("regex", "json_schema") if key in extensions}
        if len(explicit) > 1:
            raise InvalidRequestError("give at most one of regex and json_schema")
        if explicit:
            return explicit
        if self.constrain_format:
            found = format_for_call([{"role": role, "content": content_text(text)} for role, text in messages],
                                    self.max_field_chars)
            if found is not None:
                return found
        schema = _response_format_schema(config.response_format)
        return {} if schema is None else {"json_schema": bound_schema(schema, self.max_field_chars)}


@dataclasses.dataclass(frozen=True)
class AsyncProgramEngine:
    """The async counterpart DSPy's `acall` needs: the same engine, on a worker thread (asyncio.to_thread
    carries DSPy's context along)."""

    sync: ProgramEngine

    async def complete(self, request: Request) -> Response:
        return await asyncio.to_thread(self.sync.complete, request)

    def stream(self, request: Request) -> Any:
        return self.sync.stream(request)


def _default(field: dataclasses.Field) -> Any:
    return field.default_factory() if field.default is dataclasses.MISSING else field.default


def _extension_hint(names: set[str]) -> str:
    if names & _EXTENSIONS:
        return (f"; {sorted(names & _EXTENSIONS)} go in an explicit dspy.lm15.Request's "
                "config=Config(extensions={...})")
    return ""


def _chat_messages(request: Request) -> list[tuple[str, Any]]:
    """(role, content) pairs: the system instructions, then the messages; text and image parts."""
    chat = []
    if request.system is not None:
        chat.append(("system", request.system if isinstance(request.system, str) else _text(request.system)))
    for message in request.messages:
        if message.role not in _ROLES:
            raise UnsupportedFeatureError(f"SGLangLM takes system, user and assistant messages, got {message.role!r}",
                                          feature="messages")
        chat.append((_ROLES[message.role], _text(message.parts)))
    return chat


def _text(parts: tuple[Any, ...]) -> str | tuple[str | bytes, ...]:
    """The parts' text; with images (dspy.Image fields), a tuple of text and encoded images in order
    (the local program backend refuses them unless the model is a vision-language one)."""
    if all(isinstance(part, TextPart) for part in parts):
        return "".join(part.text for part in parts)
    out: list[str | bytes] = []
    for part in parts:
        if isinstance(part, TextPart):
            out.append(part.text)
        elif isinstance(part, ImagePart):
            if part.data is None and part.path is None:
                raise UnsupportedFeatureError("SGLangLM takes images as data (a data: URL, a file or bytes); "
                                              "it does not fetch image URLs", feature="content")
            out.append(part.bytes)
        else:
            raise UnsupportedFeatureError("SGLangLM takes text and image content only (no audio or files)",
                                          feature="content")
    return tuple(out)


def _response_format_schema(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """The JSON schema an lm15 response_format asks for (None for plain text)."""
    kind = None if response_format is None else response_format.get("type")
    if kind is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema" and isinstance(response_format.get("schema"), dict):
        return response_format["schema"]
    raise UnsupportedFeatureError(f"unsupported response_format {response_format!r}", feature="response_format")


def _logprobs(meta: dict[str, Any], top_n: int) -> tuple[TokenLogprob, ...]:
    """lm15's token logprobs from the engine's (logprob, token id, text) entries."""
    tops = meta.get("output_top_logprobs") or []
    out = []
    for i, (lp, _, text) in enumerate(meta.get("output_token_logprobs") or []):
        top = tops[i] if i < len(tops) and tops[i] else []
        out.append(TokenLogprob(text, lp, bytes=tuple(text.encode("utf-8")),
                                top=tuple(TopLogprob(t_text, t_lp, bytes=tuple(t_text.encode("utf-8")))
                                          for t_lp, _, t_text in top[:top_n])))
    return tuple(out)
