"""Tool calling for ChatSGLang: what `tool_choice` asks for, the JSON schema that constrained decoding
enforces for it, and how the generated text becomes LangChain tool calls.

The formats are the ones radixlm's OpenAI-compatible server uses (server/tools.py), so a model behaves
the same behind ChatSGLang and behind ChatOpenAI pointed at `radixlm serve`:
- a named tool: the output is constrained to that function's `parameters`; all of it is its arguments;
- "any"/"required": the output is constrained to a JSON array of {"name", "arguments"} objects naming
  declared tools (exactly one unless parallel calls are allowed);
- "auto": the tools are in the prompt and the text is parsed afterwards for `<tool_call>{...}</tool_call>`
  blocks (Hermes, Qwen 2.5) or a bare {"name", "arguments"|"parameters"} object or list (Llama 3).
(The server's module works on its pydantic request models; this one on LangChain's OpenAI-style dicts.)
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

# Keywords whose value maps names to subschemas, and keywords whose value holds no subschema.
_SCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
_NOT_SCHEMAS = {"enum", "const", "default", "examples", "required", "title", "description"}
_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass
class ToolMode:
    """kind: 'none' (no tools in play), 'auto', 'required' or 'named' (then `name` is the tool)."""

    kind: str = "none"
    tools: list[dict[str, Any]] = field(default_factory=list)
    name: str | None = None
    parallel: bool = True

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]


def tool_mode(tools: list[dict[str, Any]] | None, tool_choice: Any, parallel_tool_calls: bool | None) -> ToolMode:
    """The mode for OpenAI-style tool dicts and a tool_choice given the way LangChain users give it:
    None, "auto", "none", "any", "required", True, a tool name, or {"type": "function", "function": {"name"}}."""
    tools = list(tools or [])
    parallel = parallel_tool_calls is not False
    if tool_choice is None:
        return ToolMode("auto" if tools else "none", tools, parallel=parallel)
    if tool_choice == "none" or tool_choice is False:
        return ToolMode("none", tools)
    if not tools:
        raise ValueError(f"tool_choice={tool_choice!r} needs tools")
    if tool_choice == "auto":
        return ToolMode("auto", tools, parallel=parallel)
    if tool_choice in ("any", "required") or tool_choice is True:
        return ToolMode("required", tools, parallel=parallel)
    if isinstance(tool_choice, dict):
        tool_choice = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
    mode = ToolMode("named", tools, name=tool_choice, parallel=False)
    if tool_choice not in mode.names:
        raise ValueError(f"tool_choice names {tool_choice!r}, which is not among the tools {mode.names}")
    return mode


def forced_schema(mode: ToolMode) -> dict[str, Any] | None:
    """The JSON schema the output must follow in this mode (None when the model chooses freely)."""
    if mode.kind == "named":
        return _parameters(next(t for t in mode.tools if t["function"]["name"] == mode.name))
    if mode.kind != "required":
        return None
    calls = [{"type": "object",
              "properties": {"name": {"enum": [t["function"]["name"]]}, "arguments": _parameters(t)},
              "required": ["name", "arguments"], "additionalProperties": False}
             for t in mode.tools]
    schema: dict[str, Any] = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
                              "minItems": 1}
    if not mode.parallel:
        schema["maxItems"] = 1
    return schema


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters as its arguments must follow them: objects hold only the declared properties
    (as in OpenAI's strict mode; otherwise a no-argument tool, `"properties": {}`, would accept any keys)."""
    def close(node: dict[str, Any]) -> None:
        if "properties" in node and "additionalProperties" not in node:
            node["additionalProperties"] = False

    return _rewrite(tool["function"].get("parameters") or {"type": "object", "properties": {}}, close)


def bound_strings(schema: Any, max_length: int) -> Any:
    """A copy of `schema` where every string without its own length, pattern, format or enum gets
    maxLength `max_length`. Every output the bounded schema allows is valid under the original one; it
    keeps constrained output short enough to finish within max_tokens on models that rarely close a
    string by themselves (small or random-weight ones)."""
    def bound(node: dict[str, Any]) -> None:
        types = node.get("type")
        is_string = types == "string" or (isinstance(types, list) and "string" in types)
        if is_string and not {"maxLength", "pattern", "format", "enum", "const"} & set(node):
            node["maxLength"] = max_length

    return _rewrite(schema, bound)


def _rewrite(schema: Any, change: Any) -> Any:
    """A deep copy of a JSON schema with `change` applied to every subschema (dict) in it."""
    schema = copy.deepcopy(schema)

    def visit(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                visit(item)
        elif isinstance(node, dict):
            change(node)
            for key, value in node.items():
                if key in _SCHEMA_MAPS and isinstance(value, dict):
                    for subschema in value.values():
                        visit(subschema)
                elif key not in _NOT_SCHEMAS:
                    visit(value)

    visit(schema)
    return schema


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedCalls:
    """What a reply amounts to: text content, well-formed tool calls, and calls that did not parse
    (LangChain's invalid_tool_calls: name, raw args, error)."""

    content: str
    calls: list[dict[str, Any]] = field(default_factory=list)
    invalid: list[dict[str, Any]] = field(default_factory=list)


def parse_reply(mode: ToolMode, text: str) -> ParsedCalls:
    if mode.kind == "named":
        return _parse_arguments(mode.name or "", text)
    if mode.kind == "required":
        try:
            calls = json.loads(text)
        except ValueError as error:
            return ParsedCalls("", invalid=[_invalid(None, text, f"not a complete JSON array of calls: {error}")])
        if not isinstance(calls, list) or not all(isinstance(c, dict) and "name" in c for c in calls):
            return ParsedCalls("", invalid=[_invalid(None, text, "not a JSON array of {name, arguments} calls")])
        return _collect("", [(c["name"], c.get("arguments", {})) for c in calls])
    if mode.kind == "auto":
        return _parse_auto(text, set(mode.names))
    return ParsedCalls(text)


def _parse_arguments(name: str, text: str) -> ParsedCalls:
    return _collect("", [(name, text)])


def _parse_auto(text: str, names: set[str]) -> ParsedCalls:
    tagged = _TAGGED.findall(text)
    if tagged:
        content = _TAGGED.sub("", text).strip()
        blocks = []
        for block in tagged:
            try:
                blocks.append(json.loads(block))
            except ValueError:
                return ParsedCalls(text)  # a malformed block: leave the text as the model wrote it
    else:
        stripped = text.strip()
        if not stripped.startswith(("{", "[")):
            return ParsedCalls(text)
        try:
            parsed = json.loads(stripped)
        except ValueError:
            return ParsedCalls(text)
        blocks, content = (parsed if isinstance(parsed, list) else [parsed]), ""
    if not all(isinstance(b, dict) and b.get("name") in names for b in blocks):
        return ParsedCalls(text)
    return _collect(content, [(b["name"], b.get("arguments", b.get("parameters", {}))) for b in blocks])


def _collect(content: str, calls: list[tuple[str, Any]]) -> ParsedCalls:
    """Tool calls from (name, arguments) pairs; arguments given as text (a constrained output, or a
    model that writes them as a JSON string) must be a complete JSON object."""
    parsed = ParsedCalls(content)
    for name, args in calls:
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError as error:
                parsed.invalid.append(_invalid(name, args, f"arguments are not complete JSON: {error}"))
                continue
        if not isinstance(args, dict):
            parsed.invalid.append(_invalid(name, json.dumps(args), "arguments are not a JSON object"))
            continue
        parsed.calls.append({"name": name, "args": args, "id": new_call_id(), "type": "tool_call"})
    return parsed


def _invalid(name: str | None, args: str, error: str) -> dict[str, Any]:
    return {"name": name, "args": args, "id": new_call_id(), "error": error, "type": "invalid_tool_call"}


def template_tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """LangChain tool calls as chat templates expect them in an assistant message (OpenAI's shape,
    arguments as an object: templates render them with tojson)."""
    return [{"id": c.get("id"), "type": "function", "function": {"name": c["name"], "arguments": c.get("args", {})}}
            for c in calls]
