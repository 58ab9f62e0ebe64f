"""OpenAI's Responses API: POST /v1/responses and GET /v1/responses/{id}.

A request is translated into a chat completion request (input items become chat messages, function
tools and `text.format` become chat tools and `response_format`) and generated through the chat
endpoint's own preparation, so templates, tool calls and constrained decoding behave identically.
`previous_response_id` continues a stored conversation: the server keeps the messages of its last
`max_stored_responses` responses in memory (oldest dropped first; `store: false` keeps none).
Streams send OpenAI's typed events; text streams token by token, while a reply that may hold tool calls
is sent whole at its end (the server must see all of it to tell a call from text).
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from radixlm.core.chat.openai_output import finish_reason, responses_usage
from radixlm.server.body import parse_body
from radixlm.server.errors import APIError, bad_request
from radixlm.server.generation import Branch, EngineClient, EventStreamResponse, MergedStream
from radixlm.server.openai_api import OpenAIAPI, ToolMode, check_aborted
from radixlm.server.openai_protocol import ChatCompletionRequest, ResponsesRequest

_TEXT_PARTS = ("input_text", "output_text", "text")


@dataclass
class _Stored:
    response: dict[str, Any]
    messages: list[dict[str, Any]]  # the conversation so far, without instructions (OpenAI drops them)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of content parts", "input")
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}: only text content parts ({', '.join(_TEXT_PARTS)}) are supported "
                              "(text-only model)", "input")
    return "".join(part["text"] for part in content)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input items as chat messages: function calls join the assistant message before them,
    their outputs become tool messages; reasoning items are dropped."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        try:
            if kind == "message":
                messages.append({"role": item["role"], "content": _text_of(item["content"], f"input[{i}]")})
            elif kind == "function_call":
                call = {"id": item["call_id"], "type": "function",
                        "function": {"name": item["name"], "arguments": item["arguments"]}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                    last["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                output = item["output"]
                messages.append({"role": "tool", "tool_call_id": item["call_id"],
                                 "content": output if isinstance(output, str) else _text_of(output, f"input[{i}]")})
            elif kind != "reasoning":
                raise bad_request(f"input[{i}]: items of type {kind!r} are not supported", "input")
        except KeyError as exc:
            raise bad_request(f"input[{i}] ({kind}) lacks the field {exc.args[0]!r}", "input") from None
    return messages


def _chat_request(body: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    chat: dict[str, Any] = {
        "model": body.model, "messages": messages, "max_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "seed": body.seed, "top_k": body.top_k,
        "min_p": body.min_p, "repetition_penalty": body.repetition_penalty, "stop": body.stop,
        "parallel_tool_calls": body.parallel_tool_calls,
    }
    if body.tools:
        chat["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in body.tools]
    choice = body.tool_choice
    if choice is not None:
        chat["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                     "function": {"name": choice.name}}
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise bad_request("text.format of type json_schema needs a schema", "text.format.schema")
        chat["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}}
    elif fmt is not None and fmt.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _call_item(call: dict[str, Any]) -> dict[str, Any]:
    fn = call["function"]
    return {"type": "function_call", "id": _new_id("fc"), "call_id": call["id"], "name": fn["name"],
            "arguments": fn["arguments"], "status": "completed"}


class ResponsesAPI:
    def __init__(self, openai: OpenAIAPI, client: EngineClient, max_stored: int) -> None:
        self.openai = openai
        self.client = client
        self.max_stored = max_stored
        self._stored: OrderedDict[str, _Stored] = OrderedDict()

    async def create(self, request: Request) -> Response:
        body = await parse_body(request, ResponsesRequest)
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            stored = self._stored.get(body.previous_response_id)
            if stored is None:
                raise bad_request(f"Previous response with id '{body.previous_response_id}' not found (this "
                                  f"server keeps the last {self.max_stored} stored responses).",
                                  "previous_response_id", "previous_response_not_found")
            history = stored.messages
        conversation = history + input_messages(body.input)
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        mode, input_ids, params, images = await self.openai.prepare_chat(_chat_request(body, system + conversation))
        resp_id = _new_id("resp")
        if body.stream:
            stream = await self.client.open_stream(
                request, [Branch(params, input_ids=input_ids, rid=resp_id, image_data=images)])
            return EventStreamResponse(self._events(body, resp_id, mode, conversation, stream), stream.close)
        out = await self.client.generate(request, input_ids=input_ids, sampling_params=params, rid=resp_id,
                                         image_data=images)
        meta = out["meta_info"]
        check_aborted(meta)
        content, calls = self.openai.tool_calls(mode, out["text"])
        items = ([_message_item(_new_id("msg"), content)] if content else []) + [_call_item(c) for c in calls]
        return JSONResponse(self._finish(body, resp_id, conversation, items, meta))

    async def retrieve(self, request: Request) -> Response:
        stored = self._stored.get(request.path_params["response_id"])
        if stored is None:
            raise APIError(404, f"No response with id '{request.path_params['response_id']}' is stored.",
                           "response_id", "not_found")
        return JSONResponse(stored.response)

    def _response(self, body: ResponsesRequest, resp_id: str, items: list[dict[str, Any]],
                  meta: dict[str, Any] | None) -> dict[str, Any]:
        """The Response object; in progress while `meta` (the final output's) is None."""
        finish = None if meta is None else finish_reason(meta)
        usage = None if meta is None else responses_usage(meta)
        choice = body.tool_choice
        return {
            "id": resp_id, "object": "response", "created_at": int(time.time()),
            "status": "in_progress" if meta is None else "incomplete" if finish == "length" else "completed",
            "model": self.openai.engine.served_model_name, "output": items, "usage": usage, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "previous_response_id": body.previous_response_id, "temperature": body.temperature,
            "top_p": body.top_p, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "tool_choice": (choice if isinstance(choice, str) else choice.model_dump()) if choice else "auto",
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "text": {"format": (body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text
                                else {"type": "text"})},
            "metadata": body.metadata or {}, "store": body.store, "truncation": "disabled", "user": body.user,
        }

    def _finish(self, body: ResponsesRequest, resp_id: str, conversation: list[dict[str, Any]],
                items: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
        """The completed Response, remembered for previous_response_id unless store is false."""
        response = self._response(body, resp_id, items, meta)
        if body.store:
            reply: dict[str, Any] = {"role": "assistant", "content": None}
            for item in items:
                if item["type"] == "message":
                    reply["content"] = item["content"][0]["text"]
                else:
                    reply.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                        "name": item["name"], "arguments": item["arguments"]}})
            self._stored[resp_id] = _Stored(response, conversation + [reply])
            while len(self._stored) > self.max_stored:
                self._stored.popitem(last=False)
        return response

    async def _events(self, body: ResponsesRequest, resp_id: str, mode: ToolMode,
                      conversation: list[dict[str, Any]], stream: MergedStream) -> AsyncIterator[bytes]:
        sequence = itertools.count()

        def event(kind: str, **fields: Any) -> bytes:
            payload = json.dumps({"type": kind, "sequence_number": next(sequence), **fields})
            return f"event: {kind}\ndata: {payload}\n\n".encode()

        shell = self._response(body, resp_id, [], None)
        yield event("response.created", response=shell)
        yield event("response.in_progress", response=shell)
        live = mode.kind == "none"  # no tools: the text is the message, streamed as it comes
        msg_id, text, meta = _new_id("msg"), "", None
        async for _, chunk in stream:
            meta = chunk["meta_info"]
            if live and chunk["text"]:
                if not text:
                    yield event("response.output_item.added", output_index=0,
                                item=_message_item(msg_id, "", "in_progress"))
                    yield event("response.content_part.added", item_id=msg_id, output_index=0, content_index=0,
                                part={"type": "output_text", "text": "", "annotations": []})
                yield event("response.output_text.delta", item_id=msg_id, output_index=0, content_index=0,
                            delta=chunk["text"], logprobs=[])
            text += chunk["text"]
        if meta is None or meta["finish_reason"]["type"] == "abort":
            reason = "no output" if meta is None else meta.get("error", "aborted")
            yield event("error", code="aborted", message=f"The request was aborted: {reason}", param=None)
            return
        content, calls = self.openai.tool_calls(mode, text)
        items = ([_message_item(msg_id, content)] if content else []) + [_call_item(c) for c in calls]
        for index, item in enumerate(items):
            if item["type"] == "message":
                done_text = item["content"][0]["text"]
                if not (live and text):  # not announced yet: the whole text as one delta
                    yield event("response.output_item.added", output_index=index,
                                item=_message_item(msg_id, "", "in_progress"))
                    yield event("response.content_part.added", item_id=msg_id, output_index=index,
                                content_index=0, part={"type": "output_text", "text": "", "annotations": []})
                    yield event("response.output_text.delta", item_id=msg_id, output_index=index,
                                content_index=0, delta=done_text, logprobs=[])
                yield event("response.output_text.done", item_id=msg_id, output_index=index, content_index=0,
                            text=done_text, logprobs=[])
                yield event("response.content_part.done", item_id=msg_id, output_index=index, content_index=0,
                            part=item["content"][0])
            else:
                yield event("response.output_item.added", output_index=index, item={**item, "arguments": "",
                                                                                   "status": "in_progress"})
                yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                            delta=item["arguments"])
                yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            name=item["name"], arguments=item["arguments"])
            yield event("response.output_item.done", output_index=index, item=item)
        final = self._finish(body, resp_id, conversation, items, meta)
        yield event("response.incomplete" if final["status"] == "incomplete" else "response.completed",
                    response=final)
