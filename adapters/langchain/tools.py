"""Tool calling for ChatSGLang: what `tool_choice` asks for, the JSON schema that constrained decoding
enforces for it, and how the generated text becomes LangChain tool calls.

The formats are core/chat/tool_calls.py's, which radixlm's OpenAI-compatible server uses too, so a model
behaves the same behind ChatSGLang and behind ChatOpenAI pointed at `radixlm serve`. What is LangChain's
own is here: tool_choice as LangChain users give it ("any", True, a name), arguments closed to the
declared properties, and calls as LangChain tool calls (arguments decoded, bad ones in invalid_tool_calls).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

from radixlm.core.chat.tool_calls import Call, call_array_schema, find_calls, new_call_id, parse_call_array

# Keywords whose value maps names to subschemas, and keywords whose value holds no subschema.
_SCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
_NOT_SCHEMAS = {"enum", "const", "default", "examples", "required", "title", "description"}


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
    return call_array_schema([(t["function"]["name"], _parameters(t)) for t in mode.tools], mode.parallel)


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


@dataclass
class ParsedCalls:
    """What a reply amounts to: text content, well-formed tool calls, and calls that did not parse
    (LangChain's invalid_tool_calls: name, raw args, error)."""

    content: str
    calls: list[dict[str, Any]] = field(default_factory=list)
    invalid: list[dict[str, Any]] = field(default_factory=list)


def parse_reply(mode: ToolMode, text: str) -> ParsedCalls:
    if mode.kind == "named":
        return _collect("", [Call(mode.name or "", text)])
    if mode.kind == "required":
        try:
            calls = parse_call_array(text)
        except ValueError as error:
            return ParsedCalls("", invalid=[_invalid(None, text, str(error))])
        return _collect("", calls)
    if mode.kind == "auto":
        found = find_calls(text, mode.names)
        return ParsedCalls(text) if found is None else _collect(*found)
    return ParsedCalls(text)


def _collect(content: str, calls: list[Call]) -> ParsedCalls:
    """LangChain tool calls; arguments given as text (a constrained output, or a model that writes them
    as a JSON string) must be a complete JSON object."""
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
