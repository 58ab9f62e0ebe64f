"""Tool calling on the server's pydantic request models, in the formats of core/chat/tool_calls.py (shared
with ChatSGLang): the schema that forces a "required" call, and replies read back as OpenAI tool_calls
entries (arguments serialized as JSON strings).
"""

from __future__ import annotations

from typing import Any

from radixlm.core.chat.openai_output import tool_call
from radixlm.core.chat.tool_calls import call_array_schema, find_calls, parse_call_array
from radixlm.server.openai_protocol import Tool

__all__ = ["parse_auto", "parse_required", "required_schema", "template_tools", "tool_call"]


def required_schema(tools: list[Tool], parallel: bool = True) -> dict[str, Any]:
    """Schema of a non-empty JSON array of calls to the declared tools (exactly one unless parallel)."""
    return call_array_schema([(t.function.name, t.function.parameters) for t in tools], parallel)


def parse_required(text: str) -> list[dict[str, Any]]:
    """The calls of an output constrained by `required_schema` (text cut short gives no calls)."""
    try:
        calls = parse_call_array(text)
    except ValueError:
        return []
    return [tool_call(c.name, c.arguments) for c in calls]


def parse_auto(text: str, tools: list[Tool]) -> tuple[str | None, list[dict[str, Any]]]:
    """Splits free text into (remaining content, tool calls to declared tools)."""
    found = find_calls(text, {t.function.name for t in tools})
    if found is None:
        return text, []
    content, calls = found
    return content or None, [tool_call(c.name, c.arguments) for c in calls]


def template_tools(tools: list[Tool]) -> list[dict[str, Any]]:
    """The tools as chat templates expect them (OpenAI's JSON shape)."""
    return [t.model_dump(exclude_none=True) for t in tools]
