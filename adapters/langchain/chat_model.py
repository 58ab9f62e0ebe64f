"""ChatSGLang: a langchain-core chat model served by radixlm, in-process or through `radixlm serve`.

Every call becomes a program (program.py): the conversation rendered with the model's chat template, and
one gen whose sampling parameters and constraint come from the model's settings and the call's
bindings. Tools and structured output are enforced by constrained decoding, so a forced tool call or a
JSON schema reply always has the requested shape (unless max_tokens cuts it short).
"""

from __future__ import annotations

import threading
from operator import itemgetter
from typing import Any, Callable, Iterator, Literal, Sequence

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.language_models.chat_models import LangSmithParams
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import JsonOutputKeyToolsParser, PydanticToolsParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableConfig, RunnableMap, RunnablePassthrough
from langchain_core.runnables.config import get_config_list, run_in_executor
from langchain_core.tools import BaseTool
from langchain_core.utils import from_env, secret_from_env
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import ConfigDict, Field, PrivateAttr, SecretStr, model_validator

from radixlm.adapters.langchain.connection import Connection, engine_connection, server_connection, shared_engine
from radixlm.adapters.langchain.messages import ai_message, final_chunk, template_messages
from radixlm.adapters.langchain.program import ChatCall, precache, result, run_call, stream_call
from radixlm.adapters.langchain.tools import bound_strings, forced_schema, parse_reply, tool_mode
from radixlm.core.chat.openai_output import chat_logprobs
from radixlm.core.lang.ir import GenParams

# Keyword arguments a call (invoke(..., **kwargs), or a binding) may carry.
_CALL_OPTIONS = {"model", "temperature", "max_tokens", "top_p", "top_k", "min_p", "frequency_penalty",
                 "presence_penalty", "logprobs", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
                 "response_format", "max_string_length"}
# Sampling settings that go to the gen as they are.
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty")


class ChatSGLang(BaseChatModel):
    """A chat model served by radixlm.

    In-process: `ChatSGLang(engine=radixlm.Engine(...))`, or `ChatSGLang(model_path=...)` (the engine
    starts on first use and is shared by every ChatSGLang of that path and `engine_kwargs`); with
    neither, the embedded tiny random-weight model. Through a server: `ChatSGLang(base_url=
    "http://host:30000", api_key=...)` (the root or the OpenAI base URL .../v1; env RADIXLM_BASE_URL,
    RADIXLM_API_KEY); the chat is rendered here, so the model's tokenizer must be loadable here (the
    server's model path, or `tokenizer_path=`).
    """

    model_config = ConfigDict(populate_by_name=True, arbitrary_types_allowed=True)

    engine: Any = Field(default=None, exclude=True)
    """An in-process `radixlm.Engine`."""
    model_path: str | None = None
    """HF checkpoint directory for an in-process engine."""
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Engine options (SGLang server-argument names) for the engine started from `model_path`."""
    base_url: str | None = Field(default_factory=from_env("RADIXLM_BASE_URL", default=None))
    """URL of a radixlm server."""
    api_key: SecretStr | None = Field(default_factory=secret_from_env("RADIXLM_API_KEY", default=None))
    """The server's --api-key."""
    tokenizer_path: str | None = None
    """Where to load the model's tokenizer from when the server's model path is not a local directory."""
    model_name: str | None = Field(default=None, alias="model")
    """The served model's name or path (checked against what the engine serves); default: whatever it serves."""
    temperature: float | None = None
    """Sampling temperature (0 = greedy); default 1."""
    max_tokens: int | None = None
    """Most tokens to generate; default: whatever room the context leaves."""
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    stop: list[str] | None = Field(default=None, alias="stop_sequences")
    """Stop strings (the chat template's end-of-turn marker is always one)."""
    timeout: float | None = None
    """Seconds to wait for a reply (HTTP timeout for a server; a TimeoutError in-process)."""
    max_retries: int = 2
    """Retries of a server call after a connection error or a 429/502/503/504 answer."""
    streaming: bool = False
    """Whether invoke() streams internally (callbacks get tokens as they come)."""
    logprobs: bool | None = None
    """Return output token logprobs in response_metadata["logprobs"] (invoke and batch)."""
    top_logprobs: int | None = None
    """With logprobs: how many most likely alternatives to report per token."""
    max_string_length: int | None = None
    """Bound on each JSON string of constrained output (tool arguments, structured output) whose schema
    sets no length: keeps output that small models never close inside max_tokens."""
    parallel_tool_calls: bool | None = None
    """Default for bind_tools: whether a forced tool choice may produce several calls (default yes)."""

    _connection: Connection | None = PrivateAttr(default=None)
    _connect_lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    @model_validator(mode="after")
    def _one_target(self) -> "ChatSGLang":
        given = [name for name in ("engine", "model_path", "base_url") if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"give one of engine, model_path and base_url (got {given})")
        return self

    # ----- LangChain plumbing -----

    @property
    def _llm_type(self) -> str:
        return "radixlm"

    @classmethod
    def is_lc_serializable(cls) -> bool:
        return True

    @classmethod
    def get_lc_namespace(cls) -> list[str]:
        return ["radixlm", "adapters", "langchain"]

    @property
    def lc_secrets(self) -> dict[str, str]:
        return {"api_key": "RADIXLM_API_KEY"}

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.model_name, "model_path": self.model_path, "base_url": self.base_url,
                "temperature": self.temperature, "max_tokens": self.max_tokens, "top_p": self.top_p,
                "stop": self.stop}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = super()._get_ls_params(stop=stop or self.stop, **kwargs)
        params["ls_provider"] = "radixlm"
        params["ls_model_name"] = kwargs.get("model") or self._known_model_name()
        return params

    def _known_model_name(self) -> str:
        """The model's name without connecting (tracing metadata is built before every call)."""
        if self.model_name:
            return self.model_name
        if self._connection is not None:
            return self._connection.model_name
        if self.engine is not None:
            return self.engine.served_model_name
        return self.engine_kwargs.get("served_model_name") or (self.model_path or "radixlm").rstrip("/").split("/")[-1]

    def connection(self) -> Connection:
        """The engine or server this model talks to, connected on first use."""
        with self._connect_lock:
            if self._connection is None:
                if self.base_url is not None:
                    key = self.api_key.get_secret_value() if self.api_key else None
                    self._connection = server_connection(self.base_url, key, self.timeout, self.max_retries,
                                                         self.tokenizer_path)
                else:
                    engine = self.engine if self.engine is not None else shared_engine(self.model_path,
                                                                                        self.engine_kwargs)
                    self._connection = engine_connection(engine)
            return self._connection

    # ----- calls -----

    def to_call(self, messages: list[BaseMessage], stop: list[str] | None = None, **kwargs: Any) -> ChatCall:
        """The program call for a conversation with these call options."""
        for name in ("ls_structured_output_format", "structured_output_format", "stream"):
            kwargs.pop(name, None)
        unknown = sorted(set(kwargs) - _CALL_OPTIONS)
        if unknown:
            raise ValueError(f"unsupported call option(s) {unknown}; supported: {sorted(_CALL_OPTIONS)}")
        conn = self.connection()
        model = kwargs.get("model") or self.model_name
        if model and model not in conn.model_names:
            raise ValueError(f"model {model!r} is not served here; the engine serves {conn.model_name!r}")

        parallel = kwargs.get("parallel_tool_calls", self.parallel_tool_calls)
        mode = tool_mode(kwargs.get("tools"), kwargs.get("tool_choice"), parallel)
        backend = conn.backend
        image_token = backend.chat_template.image_token if backend.supports_vision else None
        turns, images = template_messages(messages, image_token)
        prompt = conn.renderer.render(turns, mode.tools if mode.kind != "none" else None)

        params = GenParams(stop=list(stop if stop is not None else self.stop or []))
        for name in _SAMPLING:
            value = kwargs.get(name, getattr(self, name))
            if value is not None:
                setattr(params, name, value)
        max_tokens = kwargs.get("max_tokens", self.max_tokens)
        params.max_new_tokens = max_tokens if max_tokens is not None else self._room(conn, prompt, len(images))
        schema = _constraint(kwargs.get("response_format"), forced_schema(mode))
        if schema is not None:
            max_string = kwargs.get("max_string_length", self.max_string_length)
            params.json_schema = bound_strings(schema, max_string) if max_string else schema
        top_logprobs = None
        if kwargs.get("logprobs", self.logprobs):
            top_logprobs = kwargs.get("top_logprobs", self.top_logprobs) or 0
            params.return_logprob, params.top_logprobs_num = True, top_logprobs
        return ChatCall(prompt=prompt, params=params, mode=mode, model_name=model or conn.model_name,
                        top_logprobs=top_logprobs, images=tuple(images), image_token=image_token or "")

    @staticmethod
    def _room(conn: Connection, prompt: str, images: int) -> int:
        # The engine widens each image's placeholder token to one position per image feature row.
        widened = images * (conn.backend._image_width() - 1) if images else 0
        room = conn.context_len - conn.renderer.count_tokens(prompt) - widened
        if room < 1:
            raise ValueError(f"the prompt fills the model's context of {conn.context_len} tokens")
        return room

    def to_message(self, call: ChatCall, text: str, meta: dict[str, Any]) -> AIMessage:
        """The AIMessage for a call's reply."""
        logprobs = None
        if call.top_logprobs is not None:
            # OpenAI's chat shape, as ChatOpenAI puts it in response_metadata
            logprobs = chat_logprobs(meta, call.top_logprobs, self.connection().renderer.token_text)
        return ai_message(parse_reply(call.mode, text), meta, call.model_name, logprobs)

    def _wait_timeout(self) -> float | None:
        # A server call is bounded by the HTTP timeout; an in-process one by waiting at most this long.
        return self.timeout if self.connection().in_process else None

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        call = self.to_call(messages, stop, **kwargs)
        text, meta = run_call(self.connection().backend, call, self._wait_timeout())
        return ChatResult(generations=[ChatGeneration(message=self.to_message(call, text, meta))])

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        call = self.to_call(messages, stop, **kwargs)
        pieces, state = stream_call(self.connection().backend, call)
        held = []
        for piece in pieces:
            if call.parsed_whole:
                held.append(piece)  # tool calls are told from text only once the reply is complete
            else:
                yield ChatGenerationChunk(message=AIMessageChunk(content=piece))
        _, meta = result(state, self._wait_timeout())
        parsed = parse_reply(call.mode, "".join(held)) if call.parsed_whole else None
        yield ChatGenerationChunk(message=final_chunk(parsed, meta, call.model_name))

    # ----- batches: one shared-prefix program -----

    def _precache(self, inputs: list[LanguageModelInput], kwargs: dict[str, Any]) -> None:
        """Sends the prefix common to the batch's prompts once, before the calls run."""
        options = {k: v for k, v in kwargs.items() if k != "stop"}
        calls = []
        for item in inputs:
            try:
                calls.append(self.to_call(self._convert_input(item).to_messages(), kwargs.get("stop"), **options))
            except Exception:
                continue  # this input's own call reports the error
        precache(self.connection().backend, calls)

    def batch(self, inputs: list[LanguageModelInput], config: RunnableConfig | list[RunnableConfig] | None = None,
              *, return_exceptions: bool = False, **kwargs: Any) -> list[Any]:
        """Runs the batch as one program: the prompts' common prefix is computed once, then every call
        is in flight at once (unless max_concurrency says otherwise) so the engine's cache-aware
        scheduler orders them. Callbacks, caching and tracing work per call as in invoke()."""
        if len(inputs) > 1:
            self._precache(inputs, kwargs)
        return super().batch(inputs, _all_at_once(config, len(inputs)), return_exceptions=return_exceptions,
                             **kwargs)

    async def abatch(self, inputs: list[LanguageModelInput],
                     config: RunnableConfig | list[RunnableConfig] | None = None,
                     *, return_exceptions: bool = False, **kwargs: Any) -> list[Any]:
        if len(inputs) > 1:
            await run_in_executor(None, self._precache, inputs, kwargs)
        return await super().abatch(inputs, _all_at_once(config, len(inputs)),
                                    return_exceptions=return_exceptions, **kwargs)

    # ----- tools and structured output -----

    def bind_tools(self, tools: Sequence[dict[str, Any] | type | Callable | BaseTool], *,
                   tool_choice: dict | str | bool | None = None, parallel_tool_calls: bool | None = None,
                   strict: bool | None = None, **kwargs: Any) -> Runnable[LanguageModelInput, BaseMessage]:
        """Tools as OpenAI-style function definitions (any form `convert_to_openai_tool` takes).
        tool_choice: "auto" (default: the model decides; calls are parsed from its text), "none",
        "any"/"required"/True (at least one call, enforced), or a tool name / {"type": "function",
        "function": {"name": ...}} (that tool, enforced). `strict` is accepted for compatibility:
        enforced calls always follow the schema."""
        formatted = [convert_to_openai_tool(t, strict=strict) for t in tools]
        tool_mode(formatted, tool_choice, parallel_tool_calls)  # refuse a bad tool_choice now
        options: dict[str, Any] = {"tools": formatted}
        if tool_choice is not None:
            options["tool_choice"] = tool_choice
        if parallel_tool_calls is not None:
            options["parallel_tool_calls"] = parallel_tool_calls
        return super().bind(**options, **kwargs)

    def with_structured_output(self, schema: dict[str, Any] | type, *,
                               method: Literal["json_schema", "function_calling", "json_mode"] = "json_schema",
                               include_raw: bool = False, strict: bool | None = None,
                               **kwargs: Any) -> Runnable[LanguageModelInput, dict | Any]:
        """Replies parsed into `schema` (a pydantic class, a TypedDict, or a JSON schema / OpenAI tool dict).
        method: "json_schema" (default; the reply is constrained to the schema), "function_calling"
        (a forced call of a tool whose parameters are the schema) or "json_mode" (constrained to some
        JSON object; the prompt has to say which keys)."""
        if kwargs:
            raise ValueError(f"unsupported arguments {sorted(kwargs)}")
        is_pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        name = convert_to_openai_tool(schema)["function"]["name"]
        tracing = {"kwargs": {"method": method, "strict": strict}, "schema": schema}
        if method == "function_calling":
            llm = self.bind_tools([schema], tool_choice=name, strict=strict, ls_structured_output_format=tracing)
            parser: Runnable = (PydanticToolsParser(tools=[schema], first_tool_only=True) if is_pydantic
                                else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True))
        elif method in ("json_schema", "json_mode"):
            response_format = ({"type": "json_object"} if method == "json_mode" else
                               {"type": "json_schema",
                                "json_schema": {"name": name, "schema": convert_to_json_schema(schema), "strict": strict}})
            llm = self.bind(response_format=response_format, ls_structured_output_format=tracing)
            parser = PydanticOutputParser(pydantic_object=schema) if is_pydantic else JsonOutputParser()
        else:
            raise ValueError(f"method must be 'json_schema', 'function_calling' or 'json_mode', not {method!r}")
        if not include_raw:
            return llm | parser
        parse = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        no_parse = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parse.with_fallbacks([no_parse], exception_key="parsing_error")


def _constraint(response_format: Any, tool_schema: dict[str, Any] | None) -> dict[str, Any] | None:
    """The JSON schema the reply is constrained to (from response_format or a forced tool choice)."""
    schema = None
    if isinstance(response_format, type):  # a pydantic class or TypedDict
        schema = convert_to_json_schema(response_format)
    elif response_format is not None:
        kind = response_format.get("type")
        if kind == "json_object":
            schema = {"type": "object"}
        elif kind == "json_schema":
            spec = response_format.get("json_schema") or {}
            schema = spec.get("schema", spec.get("schema_"))
            if not isinstance(schema, dict):
                raise ValueError("response_format json_schema needs json_schema.schema (a JSON schema object)")
        elif kind != "text":
            raise ValueError(f"response_format type must be 'text', 'json_object' or 'json_schema', not {kind!r}")
    if schema is not None and tool_schema is not None:
        raise ValueError("a forced tool_choice cannot be combined with a JSON response_format")
    return schema if schema is not None else tool_schema


def _all_at_once(config: RunnableConfig | list[RunnableConfig] | None, size: int) -> list[RunnableConfig]:
    """Per-input configs whose max_concurrency, unless set, lets the whole batch be in flight together."""
    configs = get_config_list(config, size)
    if any(c.get("max_concurrency") is not None for c in configs):
        return configs
    return [{**c, "max_concurrency": size} for c in configs]
