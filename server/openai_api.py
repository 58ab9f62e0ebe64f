"""OpenAI-compatible endpoints: /v1/chat/completions, /v1/completions, /v1/models.

Each handler validates the body (openai_protocol), turns it into engine arguments (token ids and a
sampling-params dict with SGLang's names), runs it through EngineClient, and shapes the outputs as
OpenAI's responses or server-sent chunks.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

import jinja2
import jsonschema
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from radixlm.core.chat.render import render_chat
from radixlm.core.runtime.branches import branch_dicts
from radixlm.core.chat.openai_output import (TokenText, chat_logprobs, completion_logprobs, finish_reason, tool_call,
                                        usage)
from radixlm.core.runtime.sampling_params import SamplingParams
import radixlm.server.tools as toolcalls
from radixlm.server.body import parse_body
from radixlm.server.errors import APIError, bad_request, error_body
from radixlm.server.generation import (Branch, EngineClient, EventStreamResponse, MergedStream, as_list,
                                       failure_event, raise_if_failed, sse)
from radixlm.server.openai_protocol import (ChatCompletionRequest, CompletionRequest, Message,
                                            NamedToolChoice, SamplingFields)

logger = logging.getLogger("radixlm.server")
# chat_template_kwargs may not override what the server itself passes to the template.
_RESERVED_TEMPLATE_ARGS = {"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                           "add_generation_prompt", "continue_final_message", "return_dict", "padding",
                           "truncation", "max_length", "return_tensors", "return_assistant_tokens_mask",
                           "tokenizer_kwargs"}


@dataclass
class ToolMode:
    """How a chat request's output becomes tool calls: kind is 'none', 'auto', 'required' or 'named'."""

    kind: str
    tools: list
    name: str | None = None


def check_aborted(meta: dict[str, Any]) -> None:
    """A failed output becomes its HTTP error; one aborted on request (/abort_request) is answered with
    finish_reason "abort", as SGLang does."""
    raise_if_failed(meta)


class OpenAIAPI:
    def __init__(self, engine: Any, client: EngineClient) -> None:
        self.engine = engine
        self.client = client
        self.tokenizer = engine.tokenizer
        self.token_text = TokenText(engine.tokenizer)
        self._warned_model = False

    # ---- /v1/models -------------------------------------------------------------------------

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.engine.served_model_name, "object": "model", "created": 0, "owned_by": "radixlm",
                "root": self.engine.model_path, "max_model_len": self.engine.context_len}

    async def list_models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def retrieve_model(self, request: Request) -> Response:
        if request.path_params["model"] != self.engine.served_model_name:
            raise APIError(404, f"The model `{request.path_params['model']}` does not exist.", "model",
                           "model_not_found")
        return JSONResponse(self._model_card())

    # ---- shared request translation ---------------------------------------------------------------

    def _check_common(self, req: SamplingFields) -> None:
        if req.model not in (None, self.engine.served_model_name, self.engine.model_path) and not self._warned_model:
            # As SGLang does: one model is served whatever name the client sends (ChatOpenAI's default
            # "gpt-3.5-turbo", say); the responses carry the served name.
            self._warned_model = True
            logger.warning("request for model %r answered by the served model %r (logged once)", req.model,
                           self.engine.served_model_name)
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")

    def _sampling_params(self, req: SamplingFields, max_new_tokens: int) -> dict[str, Any]:
        params: dict[str, Any] = {"max_new_tokens": max_new_tokens, "n": req.n}
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens",
                     "no_stop_trim", "seed", "regex"):
            value = getattr(req, name)
            if value is not None:
                params[name] = value
        if req.min_tokens is not None:
            params["min_new_tokens"] = req.min_tokens
        if req.logit_bias:
            params["logit_bias"] = req.logit_bias  # the engine checks keys and values, as for /generate
        if req.json_schema is not None:
            params["json_schema"] = self._checked_schema(req.json_schema, "json_schema")
        return params

    @staticmethod
    def _checked_schema(schema: str | dict[str, Any], param: str) -> dict[str, Any]:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise bad_request(f"{param} is not valid JSON: {exc}", param) from None
            except RecursionError:
                raise bad_request(f"{param} is nested too deeply", param) from None
        if not isinstance(schema, dict):
            raise bad_request(f"{param} must be a JSON object", param)
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as exc:
            raise bad_request(f"{param} is not a valid JSON schema: {exc.message}", param) from None
        except RecursionError:
            raise bad_request(f"{param} is nested too deeply", param) from None
        return schema

    def _max_new_tokens(self, requested: int | None, prompt_len: int, prompt_param: str) -> int:
        room = self.engine.context_len - prompt_len
        if room < 1:
            raise bad_request(f"This model's maximum context length is {self.engine.context_len} tokens; "
                              f"the prompt has {prompt_len} tokens.", prompt_param, "context_length_exceeded")
        if requested is None:
            return room
        if requested > room:
            raise bad_request(f"This model's maximum context length is {self.engine.context_len} tokens; "
                              f"you requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
                              f"{requested} for the completion).", "max_tokens", "context_length_exceeded")
        return requested

    # ---- /v1/chat/completions -----------------------------------------------------------------

    async def prepare_chat(self, req: ChatCompletionRequest
                           ) -> tuple[ToolMode, list[int], dict[str, Any], list[str] | None]:
        """A chat request's tool mode, prompt token ids, sampling params and images (data URLs, or None
        without any) (the Responses API's too)."""
        self._check_common(req)
        mode = self._tool_mode(req)
        input_ids, images = await self.engine.offload(self._render_chat, req, mode)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        # Each image's placeholder token becomes one position per image feature row in the engine.
        prompt_len = len(input_ids) + len(images) * (self._image_width() - 1)
        params = self._sampling_params(req, self._max_new_tokens(requested, prompt_len, "messages"))
        self._add_chat_constraint(req, mode, params)
        SamplingParams.from_dict(params)  # fail with a 400 here rather than per branch
        return mode, input_ids, params, images or None

    def _image_width(self) -> int:
        images = self.engine.images
        # Qwen2-VL's images take as many positions as their size gives: counted as one here, the
        # engine checks the expanded prompt's length.
        return (images.vision.tokens_per_image or 1) if images is not None else 1

    async def chat_completions(self, request: Request) -> Response:
        req = await parse_body(request, ChatCompletionRequest)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        mode, input_ids, params, images = await self.prepare_chat(req)
        top_n = req.top_logprobs or 0
        if req.stream:
            branches = [Branch(sp, input_ids=input_ids, rid=f"chatcmpl-{uuid.uuid4().hex}", timeout=req.timeout,
                               return_logprob=req.logprobs, top_logprobs_num=top_n, image_data=images)
                        for sp in branch_dicts(params)]
            stream = await self.client.open_stream(request, branches)
            return EventStreamResponse(self._chat_events(req, mode, stream, top_n), stream.close)
        outputs = as_list(await self.client.generate(request, input_ids=input_ids, sampling_params=params,
                                                     return_logprob=req.logprobs, top_logprobs_num=top_n,
                                                     image_data=images, timeout=req.timeout))
        choices = []
        for i, out in enumerate(outputs):
            meta = out["meta_info"]
            check_aborted(meta)
            content, calls = self.tool_calls(mode, out["text"])
            finish = finish_reason(meta, tool_calls=bool(calls))
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            choice = {"index": i, "message": message, "finish_reason": finish,
                      "matched_stop": meta["finish_reason"].get("matched"), "logprobs": None}
            if req.logprobs:
                choice["logprobs"] = chat_logprobs(meta, top_n, self.token_text)
            choices.append(choice)
        return JSONResponse({
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": self.engine.served_model_name, "choices": choices,
            "usage": usage([o["meta_info"] for o in outputs], req.n), "system_fingerprint": None,
        })

    def _tool_mode(self, req: ChatCompletionRequest) -> ToolMode:
        choice = req.tool_choice
        tools = req.tools or []
        if choice is None:
            return ToolMode("auto" if tools else "none", tools)
        if choice == "none":
            return ToolMode("none", tools)
        if not tools:
            raise bad_request("tool_choice is only allowed when tools are specified", "tool_choice")
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in {t.function.name for t in tools}:
                raise bad_request(f"tool_choice names the function {choice.function.name!r}, which is not "
                                  f"among the tools", "tool_choice")
            return ToolMode("named", tools, choice.function.name)
        return ToolMode(choice, tools)

    def _add_chat_constraint(self, req: ChatCompletionRequest, mode: ToolMode, params: dict[str, Any]) -> None:
        schema = None
        fmt = req.response_format
        if fmt is not None and fmt.type == "json_object":
            schema = {"type": "object"}
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise bad_request("response_format of type json_schema needs a json_schema", "response_format")
            schema = self._checked_schema(fmt.json_schema.schema_, "response_format")
        if mode.kind in ("named", "required"):
            if schema is not None:
                raise bad_request("a forced tool_choice cannot be combined with a JSON response_format",
                                  "tool_choice")
            if mode.kind == "named":
                tool = next(t for t in mode.tools if t.function.name == mode.name)
                schema = self._checked_schema(tool.function.parameters, "tools")
            else:
                for tool in mode.tools:
                    self._checked_schema(tool.function.parameters, "tools")
                schema = toolcalls.required_schema(mode.tools, parallel=req.parallel_tool_calls is not False)
        if schema is not None:
            if "json_schema" in params or "regex" in params:
                raise bad_request("give at most one of response_format, a forced tool_choice, regex and "
                                  "json_schema", "response_format")
            params["json_schema"] = schema

    def _render_chat(self, req: ChatCompletionRequest, mode: ToolMode) -> tuple[list[int], list[str]]:
        if self.tokenizer.chat_template is None:
            raise bad_request("this model has no chat template; use /v1/completions", "messages")
        if req.continue_final_message and req.add_generation_prompt:
            raise bad_request("continue_final_message needs add_generation_prompt set to false",
                              "continue_final_message")
        if req.continue_final_message and req.messages[-1].role != "assistant":
            raise bad_request("continue_final_message needs the last message to be an assistant message",
                              "continue_final_message")
        self.engine.check_prompt_size(sum(_content_bytes(m) for m in req.messages), "messages")
        extra = dict(req.chat_template_kwargs or {})
        clash = sorted(_RESERVED_TEMPLATE_ARGS & set(extra))
        if clash:
            raise bad_request(f"chat_template_kwargs may not set {clash}", "chat_template_kwargs")
        tools = toolcalls.template_tools(mode.tools) if mode.kind != "none" and mode.tools else None
        images = self.engine.images
        messages, image_urls = _template_messages(
            req.messages, None if images is None else images.placeholder(self.tokenizer))
        try:
            text = render_chat(
                self.tokenizer, messages, tools,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message, **extra)
        except (jinja2.TemplateError, ValueError, TypeError) as exc:
            raise bad_request(f"could not render the chat template: {exc}", "messages") from None
        except RecursionError:
            raise bad_request("could not render the chat template: the messages are nested too deeply",
                              "messages") from None
        return self.engine.encode(text, add_special_tokens=False), image_urls

    def tool_calls(self, mode: ToolMode, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        if mode.kind == "named":
            return None, [tool_call(mode.name, text)]
        if mode.kind == "required":
            calls = toolcalls.parse_required(text)
            return (None, calls) if calls else (text, [])
        if mode.kind == "auto":
            return toolcalls.parse_auto(text, mode.tools)
        return text, []

    async def _chat_events(self, req: ChatCompletionRequest, mode: ToolMode, stream: MergedStream,
                           top_n: int) -> AsyncIterator[bytes]:
        rid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.engine.served_model_name
        include_usage = req.stream_options is not None and req.stream_options.include_usage

        def chunk(index: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> bytes:
            body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
            if include_usage:
                body["usage"] = None
            return sse(json.dumps(body))

        # Tool-call modes other than 'named' need the whole text to decide what it is: buffer it.
        buffered = mode.kind in ("auto", "required") and bool(mode.tools)
        texts = [""] * len(stream.branches)
        finals: list[dict[str, Any] | None] = [None] * len(stream.branches)
        for i in range(len(stream.branches)):
            yield chunk(i, {"role": "assistant", "content": ""})
            if mode.kind == "named":
                call = tool_call(mode.name, "")
                yield chunk(i, {"tool_calls": [{"index": 0, **call}]})
        async for i, out in stream:
            meta = out["meta_info"]
            logprobs = chat_logprobs(meta, top_n, self.token_text) if req.logprobs else None
            if out["text"] or (logprobs and logprobs["content"]):
                if buffered:
                    texts[i] += out["text"]
                elif mode.kind == "named":
                    yield chunk(i, {"tool_calls": [{"index": 0, "function": {"arguments": out["text"]}}]},
                                logprobs=logprobs)
                else:
                    yield chunk(i, {"content": out["text"]}, logprobs=logprobs)
            if meta["finish_reason"] is None:
                continue
            finals[i] = meta
            called = mode.kind == "named"
            if buffered:
                content, calls = self.tool_calls(mode, texts[i])
                called = bool(calls)
                if calls:
                    yield chunk(i, {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]})
                elif content:
                    yield chunk(i, {"content": content})
            finish = finish_reason(meta, tool_calls=called)
            failure = failure_event(meta) if finish is not None else None
            if failure is not None:
                yield failure
            yield chunk(i, {}, finish)
        if include_usage:
            yield sse(json.dumps({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                                  "choices": [], "usage": usage(finals, req.n)}))
        yield sse("[DONE]")

    # ---- /v1/completions ----------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        req = await parse_body(request, CompletionRequest)
        self._check_common(req)
        if req.suffix is not None:
            raise bad_request("suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of must equal n (best-of ranking is not supported)", "best_of")
        prompts = await self.engine.offload(self._completion_prompts, req.prompt)
        self.engine.check_fan_out(len(prompts) * req.n)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        if max_tokens == 0 and not req.echo:
            raise bad_request("max_tokens may be 0 only with echo", "max_tokens")
        longest = max(len(ids) for _, ids in prompts)
        params = self._sampling_params(req, self._max_new_tokens(max_tokens, longest, "prompt"))
        SamplingParams.from_dict(params)
        want_logprobs = req.logprobs is not None
        logprob_args = {"return_logprob": want_logprobs, "top_logprobs_num": req.logprobs or 0,
                        "logprob_start_len": 0 if (want_logprobs and req.echo) else None}
        if req.stream:
            branches = [Branch(sp, input_ids=ids, rid=f"cmpl-{uuid.uuid4().hex}", timeout=req.timeout, **logprob_args)
                        for _, ids in prompts for sp in branch_dicts(params)]
            stream = await self.client.open_stream(request, branches)
            return EventStreamResponse(self._completion_events(req, prompts, stream), stream.close)
        outputs = as_list(await self.client.generate(request, input_ids=[ids for _, ids in prompts],
                                                     sampling_params=params, timeout=req.timeout, **logprob_args))
        choices = []
        for i, out in enumerate(outputs):
            meta = out["meta_info"]
            check_aborted(meta)
            prompt_text = prompts[i // req.n][0]
            text = prompt_text + out["text"] if req.echo else out["text"]
            logprobs = completion_logprobs(meta, req.echo, 0, self.token_text) if want_logprobs else None
            choices.append({"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(meta),
                            "matched_stop": meta["finish_reason"].get("matched")})
        return JSONResponse({
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": self.engine.served_model_name, "choices": choices,
            "usage": usage([o["meta_info"] for o in outputs], req.n), "system_fingerprint": None,
        })

    def _completion_prompts(self, prompt: str | list) -> list[tuple[str, list[int]]]:
        """(text, token ids) per prompt, whichever of the four forms it came in."""
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise bad_request("prompt is empty", "prompt")
        if isinstance(prompt[0], int):
            prompt = [prompt]
        out = []
        self.engine.check_fan_out(len(prompt))
        for p in prompt:
            if isinstance(p, str):
                ids = self.engine.encode_prompt(p)
                text = p
            else:
                if not all(0 <= t < self.engine.vocab_size for t in p):
                    raise bad_request(f"prompt token ids must be in [0, {self.engine.vocab_size})", "prompt")
                ids, text = p, self.tokenizer.decode(p)
            if not ids:
                raise bad_request("prompt is empty (no tokens)", "prompt")
            out.append((text, ids))
        return out

    async def _completion_events(self, req: CompletionRequest, prompts: list[tuple[str, list[int]]],
                                 stream: MergedStream) -> AsyncIterator[bytes]:
        rid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), self.engine.served_model_name
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        offsets = [0] * len(stream.branches)
        started = [False] * len(stream.branches)
        finals: list[dict[str, Any] | None] = [None] * len(stream.branches)
        async for i, out in stream:
            meta = out["meta_info"]
            text = out["text"]
            with_input = req.echo and not started[i]
            if with_input:
                text = prompts[i // req.n][0] + text
            started[i] = True
            logprobs = None
            if req.logprobs is not None:
                logprobs = completion_logprobs(meta, with_input, offsets[i], self.token_text)
                offsets[i] += sum(len(t) for t in logprobs["tokens"])
            finish = finish_reason(meta)
            if finish is not None:
                finals[i] = meta
            if text or logprobs and logprobs["tokens"] or finish is not None:
                body = {"id": rid, "object": "text_completion", "created": created, "model": model,
                        "choices": [{"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}]}
                if include_usage:
                    body["usage"] = None
                yield sse(json.dumps(body))
            failure = failure_event(meta) if finish is not None else None
            if failure is not None:
                yield failure
        if include_usage:
            yield sse(json.dumps({"id": rid, "object": "text_completion", "created": created, "model": model,
                                  "choices": [], "usage": usage(finals, req.n)}))
        yield sse("[DONE]")


def _content_bytes(message: Message) -> int:
    """UTF-8 bytes of a message's text, which the rendered prompt holds at least once."""
    parts = [message.content] if isinstance(message.content, str) else [p.text for p in message.content or []]
    return sum(len(p.encode("utf-8", "surrogatepass")) for p in parts if p)


def _template_messages(messages: list[Message], image_token: str | None
                       ) -> tuple[list[dict[str, Any]], list[str]]:
    """Messages as chat templates expect them: text parts joined, each image part replaced by the
    model's image placeholder (image_token; None: the model takes no images), tool-call arguments as
    objects (most templates render `arguments` with tojson, which would double-encode a JSON string);
    and the image URLs in prompt order."""
    out, images = [], []
    for i, m in enumerate(messages):
        msg = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            texts = []
            for part in m.content:
                if part.type == "image_url" and image_token is not None:
                    images.append(_image_url(part, i))
                    texts.append(image_token)
                elif part.type != "text" or part.text is None:
                    kinds = "'text' and 'image_url'" if image_token is not None else "'text' (text-only model)"
                    raise bad_request(f"messages[{i}]: content parts of type {part.type!r} are not supported; "
                                      f"send parts of type {kinds}", "messages")
                else:
                    texts.append(part.text)
            msg["content"] = "".join(texts)
        for call in msg.get("tool_calls", []):
            try:
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
            except ValueError:
                pass  # not JSON: the template gets the string as sent
            except RecursionError:
                raise bad_request(f"messages[{i}]: tool call arguments are nested too deeply", "messages") from None
        out.append(msg)
    return out, images


def _image_url(part: Any, i: int) -> str:
    """The data URL of an image_url part; remote URLs are refused (the server fetches nothing)."""
    url = part.image_url.url if part.image_url is not None else None
    if not url:
        raise bad_request(f"messages[{i}]: an image_url part needs an image_url with a url", "messages")
    if not url.startswith("data:"):
        raise bad_request(f"messages[{i}]: only data URLs are accepted for images (data:image/png;base64,...); "
                          "this server does not fetch remote URLs", "messages")
    return url
