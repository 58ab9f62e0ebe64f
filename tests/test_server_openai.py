"""The OpenAI-compatible endpoints, driven by the official `openai` client against the real server.

Oracles: the engine itself called in-process on a prompt rendered independently with the tokenizer's
chat template (greedy outputs must match exactly), HF transformers for prompt logprobs, and the
sampling maths (a +100 logit bias must win every step; greedy picks the top logprob).
"""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
import torch

from server_harness import render_chat, shared_server
import radixlm.server.tools as toolcalls
from radixlm.server.openai_protocol import Tool

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def live(llama_ckpt):
    return shared_server(llama_ckpt)


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


def engine_greedy(live, ids, max_new_tokens, **params):
    return live.engine.generate(input_ids=ids, sampling_params={"max_new_tokens": max_new_tokens,
                                                                 "temperature": 0.0, **params})


def test_models(client, live):
    models = client.models.list()
    assert [m.id for m in models.data] == [live.model]
    assert client.models.retrieve(live.model).id == live.model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_chat_greedy_matches_engine(client, live):
    ids = render_chat(live.engine, MESSAGES)
    expected = engine_greedy(live, ids, 12, ignore_eos=True)
    resp = client.chat.completions.create(model=live.model, messages=MESSAGES, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected["text"]
    assert choice.finish_reason == "length"
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.usage.completion_tokens == 12
    assert resp.usage.total_tokens == len(ids) + 12
    # The same prompt was just computed by the engine call above: the radix cache serves it.
    assert resp.usage.prompt_tokens_details.cached_tokens >= len(ids) - 1


def test_chat_stream_matches_non_stream(client, live):
    kwargs = dict(model=live.model, messages=MESSAGES, max_completion_tokens=10, temperature=0,
                  extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_async_client_concurrent(live):
    async def run():
        aclient = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        prompts = [[{"role": "user", "content": f"Count to {i}."}] for i in range(6)]
        resps = await asyncio.gather(*(aclient.chat.completions.create(
            model=live.model, messages=m, max_tokens=6, temperature=0) for m in prompts))
        stream = await aclient.chat.completions.create(model=live.model, messages=prompts[0], max_tokens=6,
                                                        temperature=0, stream=True)
        streamed = "".join([c.choices[0].delta.content or "" async for c in stream])
        await aclient.close()
        return prompts, resps, streamed

    prompts, resps, streamed = asyncio.run(run())
    for m, resp in zip(prompts, resps):
        assert resp.choices[0].message.content == engine_greedy(live, render_chat(live.engine, m), 6)["text"]
    assert streamed == resps[0].choices[0].message.content


def test_n_choices_seeded_stream_equals_non_stream(client, live):
    kwargs = dict(model=live.model, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=7, n=3,
                  extra_body={"ignore_eos": True})
    resp = client.chat.completions.create(**kwargs)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert resp.usage.completion_tokens == 24
    assert resp.usage.prompt_tokens == len(render_chat(live.engine, MESSAGES))  # counted once, not 3 times
    again = client.chat.completions.create(**kwargs)
    assert [c.message.content for c in again.choices] == [c.message.content for c in resp.choices]
    texts = ["", "", ""]
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in resp.choices]
    assert len(set(texts)) > 1  # different seeds per branch


def test_stop_string_and_stop_token(client, live):
    ids = render_chat(live.engine, MESSAGES)
    free = engine_greedy(live, ids, 16, ignore_eos=True)
    stop = free["text"][6:9]
    cut = free["text"].find(stop)
    resp = client.chat.completions.create(model=live.model, messages=MESSAGES, max_tokens=16, temperature=0,
                                          stop=[stop], extra_body={"ignore_eos": True})
    assert resp.choices[0].message.content == free["text"][:cut]
    assert resp.choices[0].finish_reason == "stop"
    stop_id = free["output_ids"][3]
    first = free["output_ids"].index(stop_id)
    resp = client.chat.completions.create(model=live.model, messages=MESSAGES, max_tokens=16, temperature=0,
                                          extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]})
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens == first + 1


def test_logit_bias_forces_token(client, live):
    token = live.engine.tokenizer.encode("blue", add_special_tokens=False)[0]
    resp = client.chat.completions.create(model=live.model, messages=MESSAGES, max_tokens=5, temperature=0.8,
                                          seed=3, logit_bias={str(token): 100}, extra_body={"ignore_eos": True})
    assert resp.choices[0].message.content == live.engine.tokenizer.decode([token] * 5)


def test_chat_logprobs(client, live):
    resp = client.chat.completions.create(model=live.model, messages=MESSAGES, max_tokens=6, temperature=0,
                                          logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens == 6
    assert "".join(e.token for e in content) == resp.choices[0].message.content
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry.logprob == pytest.approx(tops[0], abs=1e-5)  # greedy takes the most likely token
        assert entry.logprob <= 0 and bytes(entry.bytes).decode() == entry.token
    streamed = []
    for chunk in client.chat.completions.create(model=live.model, messages=MESSAGES, max_tokens=6, temperature=0,
                                                logprobs=True, top_logprobs=3, stream=True,
                                                extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]


def test_sampling_extras_accepted(client, live):
    resp = client.chat.completions.create(
        model=live.model, messages=MESSAGES, max_tokens=6, temperature=0.7, top_p=0.9, presence_penalty=0.5,
        frequency_penalty=0.3, seed=1,
        extra_body={"top_k": 20, "min_p": 0.01, "repetition_penalty": 1.1, "min_tokens": 4, "ignore_eos": False,
                    "skip_special_tokens": True, "chat_template_kwargs": {"custom_flag": True}})
    assert resp.usage.completion_tokens >= 4


def test_continue_final_message(client, live):
    messages = [{"role": "user", "content": "Finish my sentence."}, {"role": "assistant", "content": "The sky is"}]
    text = live.engine.tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    ids = live.engine.tokenizer.encode(text, add_special_tokens=False)
    assert text.endswith("The sky is")
    resp = client.chat.completions.create(model=live.model, messages=messages, max_tokens=5, temperature=0,
                                          extra_body={"continue_final_message": True, "add_generation_prompt": False,
                                                      "ignore_eos": True})
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.choices[0].message.content == engine_greedy(live, ids, 5, ignore_eos=True)["text"]


def test_completions_prompt_forms(client, live):
    tok = live.engine.tokenizer
    texts = ["The quick brown fox", "A small model"]
    ids = [tok(t)["input_ids"] for t in texts]
    expected = [engine_greedy(live, i, 5, ignore_eos=True)["text"] for i in ids]
    common = dict(model=live.model, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert client.completions.create(prompt=texts[0], **common).choices[0].text == expected[0]
    assert [c.text for c in client.completions.create(prompt=texts, **common).choices] == expected
    assert client.completions.create(prompt=ids[0], **common).choices[0].text == expected[0]
    batch = client.completions.create(prompt=ids, n=2, **common)
    assert [c.text for c in batch.choices] == [expected[0], expected[0], expected[1], expected[1]]
    assert batch.usage.prompt_tokens == len(ids[0]) + len(ids[1])
    assert batch.usage.completion_tokens == 20
    streamed = {}
    for chunk in client.completions.create(prompt=texts, stream=True, **common):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[0], streamed[1]] == expected


def test_completions_echo_logprobs_match_transformers(client, live, llama_ckpt):
    from transformers import AutoModelForCausalLM

    prompt = "When many requests share a prefix"
    ids = live.engine.tokenizer(prompt)["input_ids"]
    resp = client.completions.create(model=live.model, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    choice = resp.choices[0]
    assert choice.text == prompt
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    model = AutoModelForCausalLM.from_pretrained(llama_ckpt, torch_dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    oracle = torch.log_softmax(logits, dim=-1)
    for pos in range(1, len(ids)):
        assert lp.token_logprobs[pos] == pytest.approx(oracle[pos - 1, ids[pos]].item(), abs=2e-3)
        assert len(lp.top_logprobs[pos]) <= 2
        assert max(lp.top_logprobs[pos].values()) == pytest.approx(oracle[pos - 1].max().item(), abs=2e-3)
    gen = client.completions.create(model=live.model, prompt=prompt, max_tokens=4, echo=True, logprobs=1,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert gen.choices[0].text.startswith(prompt)
    assert len(gen.choices[0].logprobs.tokens) == len(ids) + 4


def test_json_schema_response_format(client, live):
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 12}},
              "required": ["colour"], "additionalProperties": False}
    kwargs = dict(model=live.model, messages=MESSAGES, max_tokens=60, temperature=0,
                  response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema,
                                                                          "strict": True}})
    content = client.chat.completions.create(**kwargs).choices[0].message.content
    jsonschema.validate(json.loads(content), schema)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kwargs, stream=True)
                       if c.choices)
    jsonschema.validate(json.loads(streamed), schema)
    regex = client.chat.completions.create(model=live.model, messages=MESSAGES, max_tokens=20, temperature=0.9,
                                           seed=5, extra_body={"regex": "(red|green|blue)!"})
    assert regex.choices[0].message.content in ("red!", "green!", "blue!")


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"]}}},
]


def streamed_tool_calls(stream):
    calls, finish = {}, None
    for chunk in stream:
        for c in chunk.choices:
            for delta in c.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
            finish = c.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish


def test_forced_tool_choice_named(client, live):
    kwargs = dict(model=live.model, messages=MESSAGES, max_tokens=60, temperature=0, tools=TOOLS,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    resp = client.chat.completions.create(**kwargs)
    msg = resp.choices[0].message
    assert msg.content is None and resp.choices[0].finish_reason == "tool_calls"
    assert len(msg.tool_calls) == 1 and msg.tool_calls[0].function.name == "get_weather"
    assert msg.tool_calls[0].id.startswith("call_") and msg.tool_calls[0].type == "function"
    jsonschema.validate(json.loads(msg.tool_calls[0].function.arguments), TOOLS[0]["function"]["parameters"])
    calls, finish = streamed_tool_calls(client.chat.completions.create(**kwargs, stream=True))
    assert finish == "tool_calls"
    assert calls == [{"name": "get_weather", "arguments": msg.tool_calls[0].function.arguments}]


def test_forced_tool_choice_required(client, live):
    kwargs = dict(model=live.model, messages=MESSAGES, max_tokens=80, temperature=0.7, seed=2, tools=TOOLS,
                  tool_choice="required", parallel_tool_calls=False)
    resp = client.chat.completions.create(**kwargs)
    msg = resp.choices[0].message
    assert resp.choices[0].finish_reason == "tool_calls" and len(msg.tool_calls) == 1
    call = msg.tool_calls[0].function
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.name)
    jsonschema.validate(json.loads(call.arguments), schema)
    calls, finish = streamed_tool_calls(client.chat.completions.create(**kwargs, stream=True))
    assert finish == "tool_calls" and calls == [{"name": call.name, "arguments": call.arguments}]


def test_auto_tools_render_into_prompt(client, live):
    tools = [{"type": "function", "function": {"name": "lookup", "description": "Looks up a word",
                                               "parameters": {"type": "object", "properties": {}}}}]
    ids = render_chat(live.engine, MESSAGES, tools=tools)
    resp = client.chat.completions.create(model=live.model, messages=MESSAGES, tools=tools, max_tokens=4,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert resp.usage.prompt_tokens == len(ids)
    none = client.chat.completions.create(model=live.model, messages=MESSAGES, tools=tools, tool_choice="none",
                                          max_tokens=4, temperature=0)
    assert none.usage.prompt_tokens == len(render_chat(live.engine, MESSAGES))


def test_tool_call_parsing():
    tools = [Tool.model_validate({"type": "function", "function": {"name": "get_weather"}})]
    content, calls = toolcalls.parse_auto(
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', tools)
    assert content == "Sure." and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    content, calls = toolcalls.parse_auto('{"name": "get_weather", "parameters": {"city": "Oslo"}}', tools)
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    unknown = '{"name": "other", "arguments": {}}'
    assert toolcalls.parse_auto(unknown, tools) == (unknown, [])
    assert toolcalls.parse_auto("plain text", tools) == ("plain text", [])
    calls = toolcalls.parse_required('[{"name": "get_weather", "arguments": {"city": "Rome"}}]')
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome"}
    schema = toolcalls.required_schema(tools)
    jsonschema.validate([{"name": "get_weather", "arguments": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], schema)


@pytest.mark.parametrize("stream", [False, True])
def test_n_branches_share_prompt_kv(client, live, stream):
    messages = [{"role": "user", "content": f"stream={stream} " + "tokens to share " * 40}]
    prompt_len = len(render_chat(live.engine, messages))
    before = live.engine.get_stats()
    reply = client.chat.completions.create(model=live.model, messages=messages, max_tokens=3, n=4, stream=stream)
    if stream:
        list(reply)
    after = live.engine.get_stats()
    assert after["prefill_tokens_total"] - before["prefill_tokens_total"] < 2 * prompt_len  # computed once
    assert after["cached_tokens_total"] - before["cached_tokens_total"] >= 3 * (prompt_len - 1)
