"""Third-party clients against the real server: LangChain's ChatOpenAI (invoke, stream, batch) and DSPy's
dspy.LM("openai/<model>", api_base=...) with dspy.Predict. The oracle is the engine's own greedy output
on the prompt rendered independently with the chat template. The tiny model's weights are random, so
DSPy's field-marker format is forced with the server's `regex` extra (constrained decoding)."""

from __future__ import annotations

import os
import re

import pytest

from server_harness import render_chat, shared_server

# LiteLLM (under DSPy) would otherwise fetch its model price list from the network at import.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


@pytest.fixture(scope="module")
def live(llama_ckpt):
    return shared_server(llama_ckpt)


def greedy(live, messages, max_new_tokens):
    ids = render_chat(live.engine, messages)
    return live.engine.generate(input_ids=ids, sampling_params={"max_new_tokens": max_new_tokens,
                                                                 "temperature": 0.0})["text"]


def test_langchain_chat_openai(live):
    from langchain_core.messages import HumanMessage, SystemMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=live.url + "/v1", api_key="unused", model=live.model, temperature=0, max_tokens=8,
                     max_retries=0)
    conversation = [SystemMessage("Be brief."), HumanMessage("What is a radix tree?")]
    oracle = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a radix tree?"}]
    expected = greedy(live, oracle, 8)
    reply = llm.invoke(conversation)
    assert reply.content == expected
    assert reply.usage_metadata["output_tokens"] == reply.response_metadata["token_usage"]["completion_tokens"]
    assert reply.usage_metadata["input_tokens"] == len(render_chat(live.engine, oracle))
    assert "".join(chunk.content for chunk in llm.stream(conversation)) == expected
    get_weather = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                   "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                                  "required": ["city"], "additionalProperties": False}}}
    call = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Paris?").tool_calls[0]
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    questions = ["One", "Two", "Three"]
    replies = llm.batch(questions)
    assert [r.content for r in replies] == [greedy(live, [{"role": "user", "content": q}], 8) for q in questions]


def test_dspy_lm(live):
    import dspy

    lm = dspy.LM(f"openai/{live.model}", api_base=live.url + "/v1", api_key="unused", cache=False,
                 temperature=0.0, max_tokens=8, num_retries=0)
    expected = greedy(live, [{"role": "user", "content": "Hello there"}], 8)
    assert lm("Hello there") == [expected]


def test_dspy_predict_with_chat_adapter_and_regex(live):
    """DSPy's own ChatAdapter, its output format forced by the server's `regex` extra (constrained decoding)."""
    import dspy

    answer_format = r"\[\[ ## answer ## \]\]\n[a-z]{1,12}\n\n\[\[ ## completed ## \]\]"
    lm = dspy.LM(f"openai/{live.model}", api_base=live.url + "/v1", api_key="unused", cache=False,
                 temperature=0.0, max_tokens=60, num_retries=0, extra_body={"regex": answer_format})
    with dspy.context(lm=lm, adapter=dspy.ChatAdapter()):
        prediction = dspy.Predict("question -> answer")(question="What is 2 + 2?")
    assert re.fullmatch("[a-z]{1,12}", prediction.answer)
    assert "What is 2 + 2?" in lm.history[-1]["messages"][-1]["content"]
