"""`SGLangLM`: a `dspy.BaseLM` whose calls run as programs of radixlm's program model.

    dspy.configure(lm=SGLangLM(engine=radixlm.Engine(...)))            # in-process
    dspy.configure(lm=SGLangLM(base_url="http://127.0.0.1:30000"))     # a radixlm server (native /generate)

Every call becomes an `LMCall` (messages, generation parameters, n). Calls made together by several
threads (dspy.Parallel, Module.batch) are grouped into one fork/join program whose shared prefix is
computed once (program.py). Replies follow the calling adapter's format through constrained decoding
when the call comes from a dspy.Predict via ChatAdapter or JSONAdapter (formats.py).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import dspy
import pydantic

from radixlm.adapters.dspy.formats import bound_schema, format_for_call
from radixlm.adapters.dspy.program import CallBatcher, LMCall, Sample, build_tree, run_program
from radixlm.core.engine.sampling_params import SamplingParams
from radixlm.core.program.interpreter import resolve_backend
from radixlm.core.program.ir import GenParams

# OpenAI-style request parameters SGLangLM honours, and the engine's extras (SGLang's names).
_OPENAI_PARAMS = frozenset({
    "temperature", "top_p", "max_tokens", "max_completion_tokens", "n", "stop", "presence_penalty",
    "frequency_penalty", "logprobs", "top_logprobs", "response_format",
})
_EXTRA_PARAMS = frozenset({"top_k", "min_p", "min_tokens", "regex", "json_schema"})
# Keys DSPy itself may pass along that mean nothing to a generation: `rollout_id` only keys DSPy's own
# response cache, and `cache` switches it (calls to a BaseLM subclass are not cached by DSPy anyway).
_DSPY_KEYS = frozenset({"rollout_id", "cache"})
_ROLES = ("system", "user", "assistant")
# The GenParams fields that take an OpenAI parameter of another name, or of the same name.
_RENAMED = {"min_tokens": "min_new_tokens"}
_SAME = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "stop")


class SGLangLM(dspy.BaseLM):
    """A DSPy LM on a radixlm Engine (`engine=`) or a radixlm / SGLang server (`base_url=`).

    `constrain_format`: constrain replies to the calling adapter's format (ChatAdapter, JSONAdapter).
    `max_field_chars`: bound each free-text value and JSON string of a constrained reply (for models
    that do not end them by themselves, like the random-weight test model); None leaves it to the model.
    `batch_window_s`: how long a call waits for more calls while others are in flight (see CallBatcher).
    `chat_template`: a named template (core.program.chat_template) for a server whose tokenizer cannot
    be loaded on this machine. Other keywords are default request parameters (`supported_params`).
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
        unknown = set(kwargs) - self.supported_params
        if unknown:
            raise ValueError(f"SGLangLM does not support {sorted(unknown)}; supported: {sorted(self.supported_params)}")
        if engine is not None:
            backend = resolve_backend(engine)
            names = (engine.served_model_name, engine.model_path)
            self.context_len = engine.context_len
        else:
            from radixlm.core.backends.runtime_endpoint import RuntimeEndpoint

            base_url = base_url.rstrip("/").removesuffix("/v1")
            backend = RuntimeEndpoint(base_url, api_key=api_key, chat_template_name=chat_template)
            info = backend.model_info
            names = (info.get("served_model_name") or info.get("model_path"), info.get("model_path"))
            self.context_len = info.get("context_len")  # SGLang servers do not report it
        if model is not None and model not in names:
            raise ValueError(f"the model {model!r} is not served here; this backend serves {names[0]!r}")
        super().__init__(model=model or names[0], model_type="chat", temperature=temperature,
                         max_tokens=max_tokens, cache=cache, callbacks=callbacks, num_retries=num_retries, **kwargs)
        self.engine = engine
        self.base_url = base_url
        self.constrain_format = constrain_format
        self.max_field_chars = max_field_chars
        self.backend = backend
        self._runner = _ProgramRunner(backend)
        self._batcher = CallBatcher(self._runner.run, window_s=batch_window_s)

    # ----- what DSPy asks about the model -----

    @property
    def supported_params(self) -> set[str]:
        return set(_OPENAI_PARAMS | _EXTRA_PARAMS)

    @property
    def supports_response_schema(self) -> bool:
        return True  # response_format json_schema is enforced by constrained decoding

    @property
    def last_program(self) -> str | None:
        """The program of the last group of calls, as text (streams, forks, generations)."""
        return self._runner.describe_last()

    # ----- calls -----

    def forward(self, prompt: str | None = None, messages: list[dict[str, Any]] | None = None,
                **kwargs: Any) -> dict[str, Any]:
        """An OpenAI chat.completion response (as a dict) for the messages (or a user prompt)."""
        options = {k: v for k, v in {**self.kwargs, **kwargs}.items() if v is not None and k not in _DSPY_KEYS}
        unknown = set(options) - self.supported_params
        if unknown:
            raise ValueError(f"SGLangLM does not support {sorted(unknown)}; supported: {sorted(self.supported_params)}")
        chat = _chat_messages(prompt, messages)
        call = LMCall(chat, self._gen_params(options, messages or []), _count(options.get("n", 1)))
        samples = self._batcher.submit(call)
        return self._response(samples, options)

    async def aforward(self, prompt: str | None = None, messages: list[dict[str, Any]] | None = None,
                       **kwargs: Any) -> dict[str, Any]:
        # The program model runs on threads; to_thread carries DSPy's context (settings) along.
        return await asyncio.to_thread(self.forward, prompt, messages, **kwargs)

    def _gen_params(self, options: dict[str, Any], messages: list[dict[str, Any]]) -> GenParams:
        max_tokens = options.get("max_completion_tokens", options.get("max_tokens", self.context_len))
        if max_tokens is None:
            raise ValueError("this server does not report its context length: pass max_tokens")
        params = GenParams(max_new_tokens=max_tokens,
                           **{name: options[name] for name in _SAME if name in options},
                           **{new: options[old] for old, new in _RENAMED.items() if old in options})
        if "top_logprobs" in options and not options.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs=True")
        if options.get("logprobs"):
            params.return_logprob = True
            params.return_text_in_logprobs = True
            params.top_logprobs_num = options.get("top_logprobs", 0)
        explicit = [k for k in ("regex", "json_schema") if k in options]
        if len(explicit) > 1:
            raise ValueError("give at most one of regex and json_schema")
        if explicit:
            setattr(params, explicit[0], options[explicit[0]])
        else:
            constraint = format_for_call(messages, self.max_field_chars) if self.constrain_format else None
            if constraint is None and "response_format" in options:
                schema = _response_format_schema(options["response_format"])
                constraint = None if schema is None else {"json_schema": bound_schema(schema, self.max_field_chars)}
            for key, value in (constraint or {}).items():
                setattr(params, key, value)
        SamplingParams.from_dict(params.sampling_params())  # bad values fail here, on the caller's thread
        return params

    def _response(self, samples: list[Sample], options: dict[str, Any]) -> dict[str, Any]:
        choices = []
        for i, sample in enumerate(samples):
            reason = sample.meta_info["finish_reason"]["type"]
            if reason == "abort":
                raise RuntimeError(f"the request was aborted: {sample.meta_info.get('error', 'no reason given')}")
            choices.append({"index": i, "message": {"role": "assistant", "content": sample.text},
                            "finish_reason": reason,
                            "logprobs": _logprobs(sample.meta_info, options.get("top_logprobs", 0))
                            if options.get("logprobs") else None})
        first = samples[0].meta_info  # the n samples share one prompt: count it once, as OpenAI does
        completion_tokens = sum(s.meta_info["completion_tokens"] for s in samples)
        usage = {"prompt_tokens": first["prompt_tokens"], "completion_tokens": completion_tokens,
                 "total_tokens": first["prompt_tokens"] + completion_tokens,
                 "prompt_tokens_details": {"cached_tokens": first["cached_tokens"]}}
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model, "choices": choices, "usage": usage}

    # ----- copies and saved state -----

    def __deepcopy__(self, memo: dict[int, Any]) -> "SGLangLM":
        # Deep copies of modules (optimizers make them) share the runtime, as copy() does.
        return self.copy()

    def dump_state(self) -> dict[str, Any]:
        state = super().dump_state()
        state.update(constrain_format=self.constrain_format, max_field_chars=self.max_field_chars,
                     batch_window_s=self._batcher.window_s)
        if self.base_url is not None:
            state["base_url"] = self.base_url
        return state


class _ProgramRunner:
    """Runs a group of calls as one program on a backend and keeps the last program for inspection."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self._last: tuple[Any, list[LMCall]] | None = None

    def run(self, calls: list[LMCall]) -> list[list[Sample] | BaseException]:
        tree = build_tree(calls)
        self._last = (tree, calls)
        return run_program(self.backend, calls, tree)

    def describe_last(self) -> str | None:
        last = self._last
        return None if last is None else last[0].describe(last[1])


def _count(n: Any) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    return n


def _chat_messages(prompt: str | None, messages: list[dict[str, Any]] | None) -> list[tuple[str, str]]:
    """(role, text) pairs; text content parts are joined, other parts are refused."""
    if messages is None:
        if prompt is None:
            raise ValueError("give a prompt or messages")
        messages = [{"role": "user", "content": prompt}]
    chat = []
    for message in messages:
        role, content = message.get("role"), message.get("content")
        if role not in _ROLES:
            raise ValueError(f"SGLangLM takes {_ROLES} messages, got role {role!r}")
        if isinstance(content, list):
            if any(not isinstance(part, dict) or part.get("type") != "text" for part in content):
                raise ValueError("SGLangLM takes text content only (no images, audio or files)")
            content = "".join(part["text"] for part in content)
        if not isinstance(content, str):
            raise ValueError(f"a {role} message needs text content, got {content!r}")
        chat.append((role, content))
    return chat


def _response_format_schema(response_format: Any) -> dict[str, Any] | None:
    """The JSON schema an OpenAI response_format asks for (None for plain text)."""
    if isinstance(response_format, type) and issubclass(response_format, pydantic.BaseModel):
        return response_format.model_json_schema()
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
        if isinstance(schema, dict):
            return schema
    raise ValueError(f"unsupported response_format {response_format!r}: use a pydantic model class, "
                     "{'type': 'json_schema', 'json_schema': {'schema': ...}}, json_object or text")


def _logprobs(meta: dict[str, Any], top_n: int) -> dict[str, Any]:
    """OpenAI's chat logprobs from the engine's (logprob, token id, text) entries."""
    def entry(lp: float, text: str) -> dict[str, Any]:
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    tops = meta.get("output_top_logprobs") or []
    content = []
    for i, (lp, _, text) in enumerate(meta.get("output_token_logprobs") or []):
        top = tops[i] if i < len(tops) and tops[i] else []
        content.append({**entry(lp, text), "top_logprobs": [entry(t_lp, t_text) for t_lp, _, t_text in top[:top_n]]})
    return {"content": content}
