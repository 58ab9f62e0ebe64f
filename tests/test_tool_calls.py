"""core/chat/tool_calls.py, the tool-call formats the server and ChatSGLang share: the schema that forces a
call array, reading replies back as calls, and OpenAI's shape of a call.

Oracles: `jsonschema` against each tool's own parameters (for outputs that constrained decoding of the
forced schema produces, walked at random through the token FSM), `json` for what a reply holds, and the
official `openai` package's tool-call type. Both front doors are checked to read the same text alike."""

from __future__ import annotations

import json

import hypothesis.strategies as st
import jsonschema
import numpy as np
import pytest
from hypothesis import given, settings
from openai.types.chat import ChatCompletionMessageFunctionToolCall
from transformers import PreTrainedTokenizerFast

from radixlm.adapters.langchain.tools import parse_reply, tool_mode
from radixlm.core.runtime.constrained import build_constraint
from radixlm.testing.constrained import random_walk
from radixlm.core.chat.openai_output import tool_call
from radixlm.core.chat.tool_calls import Call, call_array_schema, find_calls, parse_call_array
import radixlm.server.tools as server_tools
from radixlm.server.openai_protocol import Tool

PARAMETERS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                                     "unit": {"enum": ["C", "F"]}},
                    "required": ["city"], "additionalProperties": False},
    "add": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"], "additionalProperties": False},
    "now": {"type": "object", "properties": {}, "additionalProperties": False},
}
TOOLS = [{"type": "function", "function": {"name": name, "parameters": parameters}}
         for name, parameters in PARAMETERS.items()]


@pytest.mark.parametrize("parallel", [True, False])
def test_forced_call_arrays_are_calls_of_declared_tools(tokenizer_path, parallel):
    tiny_tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_path)  # the test checkpoints' byte BPE
    schema = call_array_schema(list(PARAMETERS.items()), parallel)
    jsonschema.validators.validator_for(schema).check_schema(schema)
    rng = np.random.default_rng(int(parallel))
    seen = set()
    for _ in range(40):
        constraint = build_constraint("json_schema", schema, tiny_tokenizer)
        text = tiny_tokenizer.decode(random_walk(constraint, rng, max_tokens=40), clean_up_tokenization_spaces=False)
        calls = json.loads(text)
        assert isinstance(calls, list) and 1 <= len(calls) and (parallel or len(calls) == 1)
        for call in calls:
            assert set(call) == {"name", "arguments"}
            jsonschema.validate(call["arguments"], PARAMETERS[call["name"]])
            seen.add(call["name"])
        assert parse_call_array(text) == [Call(c["name"], c["arguments"]) for c in calls]
    assert seen == set(PARAMETERS)  # the walks reached every tool


def test_forced_schema_refuses_what_is_not_a_call():
    schema = call_array_schema([("add", PARAMETERS["add"])], parallel=False)
    jsonschema.validate([{"name": "add", "arguments": {"a": 1, "b": 2}}], schema)
    for bad in ([], [{"name": "sub", "arguments": {"a": 1, "b": 2}}], [{"name": "add", "arguments": {"a": 1}}],
                [{"name": "add", "arguments": {"a": 1, "b": 2}, "x": 0}],
                [{"name": "add", "arguments": {"a": 1, "b": 2}}] * 2):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_cut_short_or_misshapen_arrays_are_refused_saying_why():
    whole = '[{"name": "add", "arguments": {"a": 1, "b": 2}}]'
    for cut in (whole[:-1], whole[:10], ""):
        with pytest.raises(ValueError, match="not a complete JSON array"):
            parse_call_array(cut)
    for shape in ('{"name": "add", "arguments": {}}', '[{"name": "add"}]', '[{"name": 3, "arguments": {}}]', "[1]"):
        with pytest.raises(ValueError, match=r"not a JSON array of \{name, arguments\} calls"):
            parse_call_array(shape)


def test_tool_call_has_openai_shape():
    call = tool_call("get_weather", {"city": "Zürich"})
    parsed = ChatCompletionMessageFunctionToolCall.model_validate(call)
    assert parsed.type == "function" and parsed.function.name == "get_weather"
    assert json.loads(parsed.function.arguments) == {"city": "Zürich"} and "Zürich" in parsed.function.arguments
    assert parsed.id.startswith("call_") and parsed.id != tool_call("now", {})["id"]
    assert tool_call("add", '{"a": 1,').get("function")["arguments"] == '{"a": 1,'  # text is kept as written


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.text(max_size=3), inner, max_size=2), max_leaves=4)
ARGUMENTS = st.dictionaries(st.text(max_size=4), JSON_VALUES, max_size=3)
CALLS = st.lists(st.tuples(st.sampled_from(sorted(PARAMETERS)), ARGUMENTS), min_size=1, max_size=3)


@settings(max_examples=60, deadline=None)
@given(calls=CALLS, before=st.text(st.characters(blacklist_characters="<"), max_size=8),
       layout=st.sampled_from(["hermes", "llama", "llama-list"]), key=st.sampled_from(["arguments", "parameters"]))
def test_replies_holding_calls_read_back_the_same_at_both_front_doors(calls, before, layout, key):
    objects = [{"name": name, key: args} for name, args in calls]
    if layout == "hermes":
        text = before + "".join(f"<tool_call>\n{json.dumps(o)}\n</tool_call>" for o in objects)
        content = before.strip()
    else:
        objects = objects[:1] if layout == "llama" else objects
        text = " " + json.dumps(objects[0] if layout == "llama" else objects)
        content = ""
    expected = [Call(o["name"], o[key]) for o in objects]
    assert find_calls(text, PARAMETERS) == (content, expected)
    # The server answers OpenAI tool calls, ChatSGLang LangChain ones: the same calls either way.
    server_content, server_calls = server_tools.parse_auto(text, [Tool.model_validate(t) for t in TOOLS])
    assert server_content == (content or None)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in server_calls] == expected
    langchain = parse_reply(tool_mode(TOOLS, "auto", None), text)
    assert langchain.content == content and [(c["name"], c["args"]) for c in langchain.calls] == expected


@pytest.mark.parametrize("text", [
    "plain words", "", '{"name": "unknown_tool", "arguments": {}}', '[{"name": "add"}, {"name": "sub"}]',
    "<tool_call>{not json</tool_call>", '<tool_call>{"name": "add"}</tool_call><tool_call>[1]</tool_call>',
    '{"name": ["add"], "arguments": {}}', '{"name": "add", "arguments": {}', "[1, 2]",
])
def test_replies_that_are_not_calls_of_declared_tools_are_text(text):
    assert find_calls(text, PARAMETERS) is None
    assert server_tools.parse_auto(text, [Tool.model_validate(t) for t in TOOLS]) == (text, [])
    langchain = parse_reply(tool_mode(TOOLS, "auto", None), text)
    assert langchain.content == text and langchain.calls == [] and langchain.invalid == []
