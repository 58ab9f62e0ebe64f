"""Renders a conversation with the model's own chat template, for every front door (the OpenAI-compatible
server and ChatSGLang). Many small instruct models (SmolLM2 among them) have templates that know only
`role` and `content`: they drop `tools`, and fail on or lose assistant tool calls and tool results. For
those, the tools go into the system turn and calls and results become text, in the Hermes format that
`core.chat.tool_calls.find_calls` reads back, so the model sees what a tool-aware template would show it."""

from __future__ import annotations

import json
from typing import Any

TOOLS_PREAMBLE = ("# Tools\n\nYou may call one or more functions to answer. Their signatures are within "
                  "<tools></tools>:\n<tools>\n{tools}\n</tools>\n\nTo call a function, reply with a JSON "
                  "object inside <tool_call></tool_call>:\n<tool_call>\n{{\"name\": <function-name>, "
                  "\"arguments\": <args-json-object>}}\n</tool_call>")


def template_knows_tools(template: str) -> bool:
    """Whether a chat template reads `tools` (and so renders tool calls and results itself)."""
    return "tools" in template


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                **template_kwargs: Any) -> str:
    """The prompt text of `messages` (OpenAI-shaped dicts) and `tools` (OpenAI function specs)."""
    if not template_knows_tools(tokenizer.chat_template or ""):
        messages = _as_plain_turns(messages, tools)
        tools = None
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False, **template_kwargs)


def _as_plain_turns(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    out = []
    for message in messages:
        message = dict(message)
        calls = message.pop("tool_calls", None)
        if calls:
            blocks = [f"<tool_call>\n{json.dumps(_call_json(c), ensure_ascii=False)}\n</tool_call>" for c in calls]
            message["content"] = "\n".join(filter(None, [message.get("content") or "", *blocks]))
        if message["role"] == "tool":
            message = {"role": "user", "content": f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"}
        message["content"] = message.get("content") or ""
        out.append(message)
    if tools:
        preamble = TOOLS_PREAMBLE.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{preamble}"}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out


def _call_json(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function", call)
    return {"name": function["name"], "arguments": function.get("arguments", {})}
