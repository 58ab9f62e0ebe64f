"""LangChain messages in, LangChain messages out.

In: messages become the dicts chat templates take (OpenAI's shape), and the model's own chat template
renders them, with the tools, into the prompt text, exactly as `radixlm serve` renders a
/v1/chat/completions request. Out: a reply (text and the engine's meta_info) becomes an AIMessage or
AIMessageChunk with tool calls, usage (cache reads included) and response metadata.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from langchain_core.messages import (
    AIMessage, AIMessageChunk, BaseMessage, ChatMessage, FunctionMessage, HumanMessage, SystemMessage,
    ToolMessage,
)
from langchain_core.messages.ai import InputTokenDetails, UsageMetadata

from radixlm.adapters.langchain.tools import ParsedCalls, template_tool_calls
from radixlm.core.chat.render import render_chat
from radixlm.core.chat.openai_output import TokenText, finish_reason, usage

# Content blocks of an assistant message that are not its text: the tool calls are rendered from
# `tool_calls`, reasoning is not part of the prompt.
_AI_NON_TEXT_BLOCKS = {"tool_use", "tool_call", "tool_call_chunk", "server_tool_call", "thinking",
                       "redacted_thinking", "reasoning"}


def _role(message: BaseMessage) -> str:
    if isinstance(message, SystemMessage):
        return "system"
    if isinstance(message, HumanMessage):
        return "user"
    if isinstance(message, AIMessage):
        return "assistant"
    if isinstance(message, (ToolMessage, FunctionMessage)):
        return "tool"
    if isinstance(message, ChatMessage):
        return {"human": "user", "ai": "assistant", "developer": "system"}.get(message.role, message.role)
    raise ValueError(f"unsupported message type {type(message).__name__}")


def _text(message: BaseMessage, role: str, image_token: str | None, images: list[str]) -> str:
    """The message's text, each image block replaced by image_token (its data URL appended to images);
    image_token None: the model takes no images."""
    if isinstance(message.content, str):
        return message.content
    parts = []
    for block in message.content:
        if isinstance(block, str):
            parts.append(block)
        elif block.get("type") == "text":
            parts.append(block.get("text", ""))
        elif block.get("type") in ("image", "image_url") and image_token is not None:
            images.append(_image_data_url(block))
            parts.append(image_token)
        elif not (role == "assistant" and block.get("type") in _AI_NON_TEXT_BLOCKS):
            kinds = "text and image blocks" if image_token is not None else "text blocks: the model is text-only"
            raise ValueError(f"content blocks of type {block.get('type')!r} are not supported (send {kinds})")
    return "".join(parts)


def _image_data_url(block: dict[str, Any]) -> str:
    """An image block as a data URL: OpenAI's image_url block, LangChain's standard image block (base64
    or url), or its older source_type form. Remote URLs are refused: the engine fetches nothing."""
    if block["type"] == "image_url":
        url = block.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
    elif block.get("base64") or block.get("source_type") == "base64":
        data = block.get("base64") or block.get("data")
        url = f"data:{block.get('mime_type') or 'image/png'};base64,{data}"
    else:
        url = block.get("url")
    if not isinstance(url, str) or not url.startswith("data:"):
        raise ValueError("image blocks must carry the image itself (base64 data, or a data: URL); radixlm does "
                         "not fetch image URLs")
    return url


def template_messages(messages: list[BaseMessage], image_token: str | None = None
                      ) -> tuple[list[dict[str, Any]], list[str]]:
    """LangChain messages as chat-template messages, and their images (data URLs) in prompt order;
    image_token: the model's image placeholder (None for a text-only model)."""
    out: list[dict[str, Any]] = []
    images: list[str] = []
    for message in messages:
        role = _role(message)
        entry: dict[str, Any] = {"role": role, "content": _text(message, role, image_token, images)}
        if isinstance(message, AIMessage) and message.tool_calls:
            entry["tool_calls"] = template_tool_calls(message.tool_calls)
        if isinstance(message, ToolMessage):
            entry["tool_call_id"] = message.tool_call_id
        if message.name:
            entry["name"] = message.name
        out.append(entry)
    return out, images


class ChatRenderer:
    """Renders conversations with a tokenizer's chat template into prompt text for the engine."""

    def __init__(self, tokenizer: Any, encode: Callable[[str], list[int]]) -> None:
        """encode: prompt text -> ids exactly as the engine tokenizes it (its backend's `_encode`)."""
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the model's tokenizer has no chat template, which ChatSGLang needs")
        self.tokenizer = tokenizer
        self.encode = encode
        self.token_text = TokenText(tokenizer)  # names the tokens of logprobs
        # The engine tokenizes prompt text with the tokenizer's special tokens; a template that writes
        # the BOS as text as well would double it.
        bos = tokenizer.bos_token
        ids = encode("a")
        self._bos_to_strip = bos if bos and ids and ids[0] == tokenizer.bos_token_id else None

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        text = render_chat(self.tokenizer, messages, tools, add_generation_prompt=True)
        if self._bos_to_strip:
            text = text.removeprefix(self._bos_to_strip)
        return text

    def count_tokens(self, text: str) -> int:
        return len(self.encode(text))


def usage_metadata(meta: dict[str, Any]) -> UsageMetadata:
    u = usage([meta])
    return UsageMetadata(input_tokens=u["prompt_tokens"], output_tokens=u["completion_tokens"],
                         total_tokens=u["total_tokens"],
                         input_token_details=InputTokenDetails(cache_read=u["prompt_tokens_details"]["cached_tokens"]))


def response_metadata(meta: dict[str, Any], model_name: str, parsed: ParsedCalls) -> dict[str, Any]:
    reason = finish_reason(meta, tool_calls=bool(parsed.calls))
    if reason == "abort":
        raise RuntimeError(f"the request was aborted: {meta.get('error', 'engine shutdown or abort')}")
    return {"model_name": model_name, "finish_reason": reason, "model_provider": "radixlm"}


def ai_message(parsed: ParsedCalls, meta: dict[str, Any], model_name: str,
               logprobs: dict[str, Any] | None = None) -> AIMessage:
    metadata = response_metadata(meta, model_name, parsed)
    if logprobs is not None:
        metadata["logprobs"] = logprobs
    return AIMessage(content=parsed.content, tool_calls=parsed.calls, invalid_tool_calls=parsed.invalid,
                     usage_metadata=usage_metadata(meta), response_metadata=metadata)


def final_chunk(parsed: ParsedCalls | None, meta: dict[str, Any], model_name: str) -> AIMessageChunk:
    """The last chunk of a stream: usage and response metadata (sent once, so that adding chunks up
    does not repeat them), and the tool calls of a reply that was held back to be parsed whole."""
    parsed = parsed or ParsedCalls("")
    chunks = [{"name": c["name"], "args": json.dumps(c["args"], ensure_ascii=False), "id": c["id"], "index": i, "type": "tool_call_chunk"}
              for i, c in enumerate(parsed.calls)]
    chunks += [{"name": c["name"], "args": c["args"], "id": c["id"], "index": len(chunks) + i,
                "type": "tool_call_chunk"} for i, c in enumerate(parsed.invalid)]
    return AIMessageChunk(content=parsed.content, tool_call_chunks=chunks, usage_metadata=usage_metadata(meta),
                          response_metadata=response_metadata(meta, model_name, parsed), chunk_position="last")
