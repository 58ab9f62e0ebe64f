"""Tool calling: which JSON schema forces a tool call, and how tool calls are read back from text.

- tool_choice named: the output is constrained to that function's `parameters` schema; the whole
  output is its arguments.
- tool_choice "required": the output is constrained to a JSON array of {"name", "arguments"} objects
  (at least one) whose names are the declared tools'.
- tool_choice "auto": the tools go into the chat template and the text is parsed afterwards, accepting
  the formats chat templates teach models: `<tool_call>{...}</tool_call>` blocks (Hermes, Qwen 2.5) or a
  bare JSON object / list of objects with "name" and "arguments" or "parameters" (Llama 3.x).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from radixlm.server.openai_protocol import Tool

_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def required_schema(tools: list[Tool], parallel: bool = True) -> dict[str, Any]:
    """Schema of a non-empty JSON array of calls to the declared tools (exactly one unless parallel)."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"enum": [t.function.name]}, "arguments": t.function.parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def tool_call(name: str, arguments: Any) -> dict[str, Any]:
    """One OpenAI tool_calls entry; arguments are serialized JSON, as OpenAI sends them."""
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def parse_required(text: str) -> list[dict[str, Any]]:
    """The calls of an output constrained by `required_schema` (unparseable text gives no calls)."""
    try:
        calls = json.loads(text)
    except ValueError:
        return []
    if not isinstance(calls, list):
        return []
    return [tool_call(c["name"], c["arguments"]) for c in calls
            if isinstance(c, dict) and isinstance(c.get("name"), str) and "arguments" in c]


def parse_auto(text: str, tools: list[Tool]) -> tuple[str | None, list[dict[str, Any]]]:
    """Splits free text into (remaining content, tool calls to declared tools)."""
    names = {t.function.name for t in tools}
    tagged = _TAGGED.findall(text)
    candidates: list[Any] = []
    if tagged:
        for block in tagged:
            try:
                candidates.append(json.loads(block))
            except ValueError:
                return text, []  # a malformed block: leave the text as the model wrote it
        content = _TAGGED.sub("", text).strip() or None
    else:
        stripped = text.strip()
        if not stripped.startswith(("{", "[")):
            return text, []
        try:
            parsed = json.loads(stripped)
        except ValueError:
            return text, []
        candidates = parsed if isinstance(parsed, list) else [parsed]
        content = None
    calls = []
    for c in candidates:
        if not isinstance(c, dict) or c.get("name") not in names:
            return text, []
        args = c.get("arguments", c.get("parameters", {}))
        calls.append(tool_call(c["name"], args))
    return content, calls


def template_tools(tools: list[Tool]) -> list[dict[str, Any]]:
    """The tools as chat templates expect them (OpenAI's JSON shape)."""
    return [t.model_dump(exclude_none=True) for t in tools]

