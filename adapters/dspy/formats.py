"""The reply format a DSPy adapter expects, as a constraint for constrained decoding.

A DSPy adapter renders a signature into chat messages and parses the model's reply back into the
signature's output fields. A model that does not follow the format (a small or a random-weight one)
writes replies that do not parse. The format is a function of the adapter and the signature, and it is
a regular language, so generation can be constrained to it: the model still chooses every value, only
the format is enforced.

- ChatAdapter: `[[ ## field ## ]]\\n<value>` per output field, separated by blank lines, then
  `[[ ## completed ## ]]`. A str value is free text that cannot contain `[[` (so it cannot open a
  field of its own) and starts with a visible character; bool is True or False; a Literal or an Enum
  is one of its values as the prompt spells them; anything else is JSON valid under pydantic's schema
  for the annotation (numbers, lists, dicts, models), spaced as DSPy writes it or compact.
- JSONAdapter: one compact JSON object holding every output field, in signature order.
- ReAct's `next_tool_name` / `next_tool_args` pair is constrained jointly when the tools are known:
  the arguments follow the chosen tool's argument schema, so the tool can be called with them.

`max_field_chars` bounds the length of every value (free text, JSON strings, arrays, numbers: see
`bound_schema`), for a model that never ends one by itself (a random-weight one); None leaves it to the
model.

`format_for_call` finds the format of an LM call made by a dspy.Predict through ChatAdapter or
JSONAdapter: the calling Predict is the innermost module in `dspy.settings.caller_modules`, and the
format is used only if the call's last user message carries that adapter's own output instructions
for that Predict's signature, so a prompt rendered any other way is never constrained.
"""

from __future__ import annotations

import enum
import logging
import re
import types
from typing import Any, Literal, Union, get_args, get_origin

import pydantic

from radixlm.core.runtime.constrained import grammar_to_regex, json_schema_to_grammar

logger = logging.getLogger("radixlm")

# ReAct's output fields: the tool to call next and its arguments (dspy/predict/react.py).
TOOL_NAME_FIELD = "next_tool_name"
TOOL_ARGS_FIELD = "next_tool_args"


def _chat_header(name: str) -> str:
    return re.escape(f"[[ ## {name} ## ]]") + r"\n"


_CHAT_SEPARATOR = r"\n\n"
_CHAT_END = re.escape("[[ ## completed ## ]]")
# One unit of free text: any character but `[`, or `[` followed by anything but `[`.
_TEXT_UNIT = r"(?:[^\[]|\[[^\[])"
_TEXT_FIRST = r"(?:[^\[\s]|\[[^\[\s])"
# ChatAdapter writes JSON values with json.dumps's separators (", ", ": "): allow one optional space.
_JSON_SPACE = " ?"


def free_text_regex(max_chars: int | None) -> str:
    """Text that cannot contain `[[` and starts with a visible character; at most `max_chars` units."""
    if max_chars is None:
        return _TEXT_FIRST + _TEXT_UNIT + "*"
    if max_chars < 1:
        raise ValueError("max_field_chars must be at least 1")
    return _TEXT_FIRST + (_TEXT_UNIT + f"{{0,{max_chars - 1}}}" if max_chars > 1 else "")


def json_value_regex(schema: Any) -> str:
    """The JSON values valid under `schema`, spaced as DSPy writes them or compact, as one regex: the
    grammar engine's JSON grammar written out (recursion cut at grammar_to_regex's depth). ValueError for
    what the grammar refuses or cannot write as a regex."""
    return grammar_to_regex(json_schema_to_grammar(schema, whitespace_pattern=_JSON_SPACE))


def _is_text(annotation: Any) -> bool:
    """str, or a union of str with other types (`str | None`): DSPy takes the reply text as it is."""
    if annotation is str:
        return True
    return get_origin(annotation) in (Union, types.UnionType) and str in get_args(annotation)


def bound_schema(schema: Any, max_chars: int | None) -> Any:
    """A copy of a JSON schema where every value has a bounded length, for a model that would not end
    one by itself: free strings (no maxLength, enum, const, pattern or format) get at most `max_chars`
    characters, arrays at most `max_chars` items, unbounded integers at most `max_chars` digits (15 at
    most), unbounded numbers become such integers (a JSON number's fraction cannot be bounded), and
    open objects (no properties: any keys, any number of them) become empty objects. Every instance of
    the copy is an instance of the original."""
    if max_chars is None or not isinstance(schema, (dict, list)):
        return schema
    if isinstance(schema, list):
        return [bound_schema(s, max_chars) for s in schema]
    out = {key: bound_schema(value, max_chars) if key not in ("enum", "const", "default", "examples") else value
           for key, value in schema.items()}
    kind = schema.get("type")
    fixed = {"enum", "const"} & set(schema)
    if kind == "string" and not fixed | ({"maxLength", "pattern", "format"} & set(schema)):
        out["maxLength"] = max_chars
    elif kind == "array" and "maxItems" not in schema:
        out["maxItems"] = max(max_chars, schema.get("minItems", 0))
    elif kind in ("integer", "number") and not fixed | ({"minimum", "maximum", "exclusiveMinimum",
                                                         "exclusiveMaximum", "multipleOf"} & set(schema)):
        largest = 10 ** min(max_chars, 15) - 1
        out.update(type="integer", minimum=-largest, maximum=largest)
    elif kind == "object" and not schema.get("properties") and not schema.get("required"):
        out["additionalProperties"] = False
    return out


def _annotation_schema(annotation: Any, max_chars: int | None) -> dict[str, Any]:
    schema = pydantic.TypeAdapter(annotation).json_schema()
    return bound_schema(schema, max_chars)


def _tool_args_schema(tool: Any, max_chars: int | None) -> dict[str, Any]:
    """The JSON object of a dspy.Tool's arguments: every argument, as the tool declares it."""
    properties = dict(tool.args or {})
    return bound_schema({"type": "object", "properties": properties, "required": list(properties),
                         "additionalProperties": False}, max_chars)


def _chat_value_regex(annotation: Any, max_chars: int | None) -> str:
    if _is_text(annotation):
        return free_text_regex(max_chars)
    if annotation is bool:
        return "(?:True|False)"
    if get_origin(annotation) is Literal:
        return "(?:" + "|".join(re.escape(str(v)) for v in get_args(annotation)) + ")"
    if isinstance(annotation, enum.EnumMeta):
        return "(?:" + "|".join(re.escape(str(m.value)) for m in annotation) + ")"
    return json_value_regex(_annotation_schema(annotation, max_chars))


def _has_tool_pair(names: list[str], tools: dict[str, Any] | None) -> bool:
    if not tools or TOOL_NAME_FIELD not in names:
        return False
    i = names.index(TOOL_NAME_FIELD)
    return i + 1 < len(names) and names[i + 1] == TOOL_ARGS_FIELD


def chat_regex(signature: Any, max_field_chars: int | None = None, tools: dict[str, Any] | None = None) -> str:
    """The regex of a ChatAdapter reply for `signature` (see the module docstring). `tools`: ReAct's
    tools by name, to constrain the tool name and its arguments together."""
    fields = signature.output_fields
    names = list(fields)
    joint = _has_tool_pair(names, tools)
    parts = []
    i = 0
    while i < len(names):
        name = names[i]
        if joint and name == TOOL_NAME_FIELD:
            choices = [re.escape(tool_name) + _CHAT_SEPARATOR + _chat_header(TOOL_ARGS_FIELD)
                       + json_value_regex(_tool_args_schema(tool, max_field_chars))
                       for tool_name, tool in tools.items()]
            parts.append(_chat_header(name) + "(?:" + "|".join(choices) + ")")
            i += 2
            continue
        parts.append(_chat_header(name) + _chat_value_regex(fields[name].annotation, max_field_chars))
        i += 1
    return _CHAT_SEPARATOR.join(parts + [_CHAT_END])


def json_schema(signature: Any, max_field_chars: int | None = None,
                tools: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON schema of a JSONAdapter reply for `signature`: an object with every output field,
    in order, and nothing else. With `tools` (ReAct's), one alternative per tool."""
    fields = signature.output_fields
    model = pydantic.create_model(
        "DSPyOutputs", __config__=pydantic.ConfigDict(extra="forbid"),
        **{name: (field.annotation, ...) for name, field in fields.items()})
    schema = bound_schema(model.model_json_schema(), max_field_chars)
    schema["required"] = list(fields)
    schema["additionalProperties"] = False
    if not _has_tool_pair(list(fields), tools):
        return schema
    alternatives = []
    for tool_name, tool in tools.items():
        properties = dict(schema["properties"])
        properties[TOOL_NAME_FIELD] = {"const": tool_name}
        properties[TOOL_ARGS_FIELD] = _tool_args_schema(tool, max_field_chars)
        alternatives.append({**schema, "properties": properties})
    defs = {k: schema[k] for k in ("$defs",) if k in schema}
    return {"anyOf": [{k: v for k, v in alt.items() if k != "$defs"} for alt in alternatives], **defs}


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def format_for_call(messages: list[dict[str, Any]], max_field_chars: int | None = None) -> dict[str, Any] | None:
    """{'regex': ...} or {'json_schema': ...}: the reply format of this LM call, when it is made by a
    dspy.Predict through ChatAdapter or JSONAdapter; None otherwise (or when the signature has a type
    no constraint can express)."""
    import dspy

    settings = dspy.settings
    adapter = settings.adapter or dspy.ChatAdapter()
    callers = settings.caller_modules or []
    if type(adapter) not in (dspy.ChatAdapter, dspy.JSONAdapter) or not callers:
        return None
    predict = callers[-1]
    if not isinstance(predict, dspy.Predict):
        return None
    users = [m for m in messages if m.get("role") == "user"]
    if not users:
        return None
    request = _text_of(users[-1].get("content"))
    signature = predict.signature
    owner = callers[-2] if len(callers) > 1 else None
    tools = owner.tools if isinstance(owner, dspy.ReAct) and owner.react is predict else None
    # ChatAdapter falls back to JSONAdapter after a reply it cannot parse: try both renderings.
    for kind in (dspy.JSONAdapter, dspy.ChatAdapter):
        if kind().user_message_output_requirements(signature) not in request:
            continue
        try:
            if kind is dspy.JSONAdapter:
                return {"json_schema": json_schema(signature, max_field_chars, tools)}
            return {"regex": chat_regex(signature, max_field_chars, tools)}
        except (ValueError, pydantic.PydanticSchemaGenerationError, pydantic.PydanticInvalidForJsonSchema) as exc:
            logger.info("SGLangLM: no format constraint for %s: %s", signature.__name__, exc)
            return None
    return None
