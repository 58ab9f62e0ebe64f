"""Tool-call formats, one definition for every front door (the OpenAI-compatible server and
ChatSGLang), so a model behaves the same behind either:

- a named tool: the output is constrained to that function's `parameters`; all of it is its arguments;
- "required": the output is constrained to a JSON array of {"name", "arguments"} objects naming
  declared tools, exactly one unless parallel calls are allowed (`call_array_schema`), and read back
  with `parse_call_array`;
- "auto": the tools are in the prompt and the text is read afterwards (`find_calls`) for
  `<tool_call>{...}</tool_call>` blocks (Hermes, Qwen 2.5) or a bare {"name", "arguments"|"parameters"}
  object or list of them (Llama 3).

Calls come back as `Call(name, arguments)` with the arguments as the model wrote them (a JSON value, or
a string); each front door decides how to present them (OpenAI's shape: core.chat.openai_output.tool_call).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection, Sequence
from typing import Any, NamedTuple

_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class Call(NamedTuple):
    name: str
    arguments: Any


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call_array_schema(tools: Sequence[tuple[str, dict[str, Any]]], parallel: bool = True) -> dict[str, Any]:
    """The JSON schema of a non-empty array of calls to the given (name, parameters schema) tools;
    exactly one call unless `parallel`."""
    calls = [{"type": "object", "properties": {"name": {"enum": [name]}, "arguments": parameters},
              "required": ["name", "arguments"], "additionalProperties": False}
             for name, parameters in tools]
    schema: dict[str, Any] = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
                              "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def parse_call_array(text: str) -> list[Call]:
    """The calls of an output constrained by `call_array_schema`. Raises ValueError, saying why, when
    the text is not such an array (an output cut short by max_tokens or a stop string)."""
    try:
        calls = json.loads(text)
    except ValueError as error:
        raise ValueError(f"not a complete JSON array of calls: {error}") from None
    if not isinstance(calls, list) or not all(
            isinstance(c, dict) and isinstance(c.get("name"), str) and "arguments" in c for c in calls):
        raise ValueError("not a JSON array of {name, arguments} calls")
    return [Call(c["name"], c["arguments"]) for c in calls]


def find_calls(text: str, names: Collection[str]) -> tuple[str, list[Call]] | None:
    """Free text read as calls to the tools named `names`: (the text around the calls, stripped; the
    calls), or None when the text is not calls to declared tools (then all of it is content). A
    malformed block or a call naming another tool makes the whole text content: it is left as the
    model wrote it."""
    tagged = _TAGGED.findall(text)
    if tagged:
        try:
            blocks = [json.loads(block) for block in tagged]
        except ValueError:
            return None
        content = _TAGGED.sub("", text).strip()
    else:
        stripped = text.strip()
        if not stripped.startswith(("{", "[")):
            return None
        try:
            parsed = json.loads(stripped)
        except ValueError:
            return None
        blocks, content = (parsed if isinstance(parsed, list) else [parsed]), ""
    # (A name that is not a string cannot be a declared tool's; checked first, as it may be unhashable.)
    if not all(isinstance(b, dict) and isinstance(b.get("name"), str) and b["name"] in names for b in blocks):
        return None
    return content, [Call(b["name"], b.get("arguments", b.get("parameters", {}))) for b in blocks]
