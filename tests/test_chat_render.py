"""Chat rendering for templates without tool support: the tools reach the model in its system turn,
calls and results become text that tool_calls.find_calls reads back; tool-aware templates are untouched."""

from __future__ import annotations

from transformers import AutoTokenizer

from radixlm.core.chat.render import render_chat, template_knows_tools
from radixlm.core.chat.tool_calls import Call, find_calls

# SmolLM2-135M-Instruct's template: role and content only.
PLAIN_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"},
]


def plain_tokenizer(tokenizer_path: str):
    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    tok.chat_template = PLAIN_TEMPLATE
    return tok


def test_tool_aware_template_renders_as_apply_chat_template(tokenizer_path):
    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    assert template_knows_tools(tok.chat_template)
    expected = tok.apply_chat_template(CONVERSATION, tools=[TOOL], tokenize=False, add_generation_prompt=True)
    assert render_chat(tok, CONVERSATION, [TOOL], add_generation_prompt=True) == expected


def test_plain_template_gets_tools_calls_and_results_as_text(tokenizer_path):
    tok = plain_tokenizer(tokenizer_path)
    assert not template_knows_tools(tok.chat_template)
    text = render_chat(tok, CONVERSATION, [TOOL], add_generation_prompt=True)
    system, user, assistant, result, prompt = text.split("<|im_start|>")[1:]
    assert system.startswith("system\n# Tools") and '"name": "get_weather"' in system
    assert "You are a helpful AI assistant" not in text  # the tools' system turn replaces the default one
    assert user == "user\nWeather in Paris?<|im_end|>\n"
    body = assistant.removeprefix("assistant\n").removesuffix("<|im_end|>\n")
    assert find_calls(body, {"get_weather"}) == ("", [Call("get_weather", {"city": "Paris"})])
    assert result == "user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>\n"
    assert prompt == "assistant\n"


def test_plain_template_keeps_a_system_message_and_renders_without_tools(tokenizer_path):
    tok = plain_tokenizer(tokenizer_path)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    with_tools = render_chat(tok, messages, [TOOL], add_generation_prompt=True)
    assert with_tools.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert render_chat(tok, messages, None, add_generation_prompt=True) == tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
