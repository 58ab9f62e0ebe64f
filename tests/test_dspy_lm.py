"""SGLangLM as a dspy.LM with a custom engine (DSPy 3.4's contract, no deprecation warning): lm15
responses, usage with cached tokens, n, sampling parameters, constrained structured outputs, logprobs,
async and threaded calls, history, and the server (base_url) path.

Oracles: the engine's own greedy output on the prompt rendered independently with the tokenizer's chat
template; `jsonschema` and `re` for constrained output; the engine's own logprobs."""

from __future__ import annotations

import asyncio
import json
import os
import re
import warnings
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pydantic
import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # LiteLLM (under DSPy): no network at import

import dspy  # noqa: E402

from dspy.lm15 import Config, Message, Request, Response  # noqa: E402

from radixlm import Engine  # noqa: E402
from radixlm.adapters.dspy import SGLangLM  # noqa: E402
from server_harness import shared_server  # noqa: E402

# DSPy 3.4 deprecates passing OpenAI-style messages= dicts to any LM; these tests still call lm(messages=...).
pytestmark = pytest.mark.filterwarnings("ignore:Passing OpenAI-style message:DeprecationWarning")


@pytest.fixture(scope="module", autouse=True)
def _no_dspy_cache():
    dspy.configure_cache(enable_disk_cache=False, enable_memory_cache=False)


@pytest.fixture(scope="module")
def engine(llama_ckpt):
    with Engine(llama_ckpt) as eng:
        yield eng


def render(engine, messages) -> list[int]:
    text = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return engine.tokenizer.encode(text, add_special_tokens=False)


def greedy(engine, messages, max_new_tokens, **params) -> str:
    return engine.generate(input_ids=render(engine, messages),
                           sampling_params={"max_new_tokens": max_new_tokens, "temperature": 0.0, **params})["text"]


def test_prompt_call_is_the_engine_greedy_output_as_an_lm15_response(engine):
    lm = SGLangLM(engine=engine, temperature=0.0, max_tokens=8)
    assert lm.model == engine.served_model_name and lm.model_type == "chat"
    expected = greedy(engine, [{"role": "user", "content": "Hello there"}], 8)
    assert lm("Hello there") == [expected]
    entry = lm.history[-1]
    response = entry["response"]  # what the engine answered, as DSPy records it
    assert isinstance(response, Response) and response.model == lm.model
    assert response.message.role == "assistant" and response.text == expected
    assert response.finish_reason == "length"
    usage = entry["usage"]
    prompt_tokens = len(render(engine, [{"role": "user", "content": "Hello there"}]))
    assert usage["prompt_tokens"] == prompt_tokens and usage["completion_tokens"] == 8
    assert usage["total_tokens"] == prompt_tokens + 8
    assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] < prompt_tokens
    # The same prompt again: everything but the last prompt token comes from the radix cache.
    lm("Hello there")
    assert lm.history[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= prompt_tokens - 1


def test_no_deprecation_warning_on_any_path(engine):
    # DSPy 3.4 warns on every call of an LM that implements BaseLM.forward/aforward; SGLangLM gives
    # dspy.LM an engine instead, on the direct, async and module paths alike.
    lm = SGLangLM(engine=engine, temperature=0.0, max_tokens=80, max_field_chars=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lm("Hello")
        asyncio.run(lm.acall("Hello"))
        with dspy.context(lm=lm):
            assert dspy.Predict("question -> answer")(question="Why?").answer
    assert [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)] == []


def test_messages_and_per_call_parameters(engine):
    lm = SGLangLM(engine=engine, temperature=0.7, max_tokens=4)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "KV?"}]}]
    plain = [*messages[:3], {"role": "user", "content": "What is KV?"}]
    first = greedy(engine, plain, 12)
    stop = first[3:5]  # a stop string the greedy text contains: the reply ends just before it
    out = lm(messages=messages, temperature=0.0, max_tokens=12, stop=[stop])
    assert out == [greedy(engine, plain, 12, stop=[stop])]
    assert out[0] == first[:first.index(stop)]
    assert lm.history[-1]["response"].finish_reason == "stop"


def test_n_samples_share_the_prompt(engine):
    lm = SGLangLM(engine=engine, max_tokens=6)
    messages = [{"role": "user", "content": "Tell me three things"}]
    outs = lm(messages=messages, n=3, temperature=1.0)
    assert len(outs) == 3 and all(isinstance(o, str) for o in outs)
    assert len(set(outs)) > 1  # three samples, not one answer thrice
    usage = lm.history[-1]["usage"]
    prompt_tokens = len(render(engine, messages))
    # DSPy 3.4 asks a custom engine for n answers as n requests, one after another, and sums their usage.
    assert usage["prompt_tokens"] == 3 * prompt_tokens
    assert 3 <= usage["completion_tokens"] <= 18  # a sample may end early, on the end-of-turn token
    # The second and third requests found the whole prompt in the radix cache.
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 2 * (prompt_tokens - 1)
    with pytest.raises(ValueError, match="n must be a positive integer"):
        lm("x", n=0)


def test_structured_outputs_by_constrained_decoding(engine):
    lm = SGLangLM(engine=engine, temperature=0.0, max_tokens=120, max_field_chars=12)
    assert lm.supports_response_schema and "response_format" in lm.supported_params
    assert not {"regex", "json_schema"} & lm.supported_params  # Request extensions, not call parameters

    class City(pydantic.BaseModel):
        name: str
        population: int
        coastal: bool

    out = lm("Describe a city.", response_format=City)[0]
    City.model_validate_json(out)
    jsonschema.validate(json.loads(out), City.model_json_schema())

    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                        "minItems": 1, "maxItems": 3}},
              "required": ["tags"], "additionalProperties": False}
    out = lm("Tag it.", response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}})[0]
    jsonschema.validate(json.loads(out), schema)
    assert isinstance(json.loads(lm("Any object.", response_format={"type": "json_object"})[0]), dict)
    # The engine's own regex / json_schema: DSPy carries them only in an explicit Request's extensions.
    request = Request(model=lm.model, messages=(Message.user("An id."),),
                      config=Config(max_tokens=20, extensions={"regex": r"[a-z]{2,6}-[0-9]{3}"}))
    assert re.fullmatch(r"[a-z]{2,6}-[0-9]{3}", lm(request).text)
    request = Request(model=lm.model, messages=(Message.user("Tag it."),),
                      config=Config(max_tokens=120, extensions={"json_schema": schema}))
    jsonschema.validate(json.loads(lm(request).text), schema)
    assert lm("Plain.", response_format={"type": "text"}, max_tokens=3) == [
        greedy(engine, [{"role": "user", "content": "Plain."}], 3)]


def test_unsupported_requests_are_refused(engine):
    lm = SGLangLM(engine=engine, max_tokens=4)

    def request(**extensions):
        return Request(model=lm.model, messages=(Message.user("x"),), config=Config(extensions=extensions))

    # Refused by the engine: DSPy raises them as its LMError kinds, the engine's error as the cause.
    with pytest.raises(dspy.LMUnsupportedFeatureError, match="does not support"):
        lm("x", tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    with pytest.raises(dspy.LMUnsupportedFeatureError, match="does not support"):
        lm("x", seed=3)
    with pytest.raises(dspy.LMUnsupportedFeatureError, match="does not fetch image URLs"):
        lm(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}])
    with pytest.raises(dspy.LMInvalidRequestError, match="at most one of"):
        lm(request(regex="a", json_schema={"type": "string"}))
    with pytest.raises(dspy.LMInvalidRequestError, match="invalid regex"):  # the engine's own validation
        lm(request(regex="(unclosed"))
    # Refused by DSPy before the engine is asked, or by the constructor.
    with pytest.raises(dspy.LMUnsupportedFeatureError, match="'regex' cannot be carried"):
        lm("x", regex="a")
    with pytest.raises(ValueError, match="requires logprobs"):
        lm("x", top_logprobs=2)
    with pytest.raises(ValueError, match="temperature"):
        lm("x", temperature=-1.0)
    with pytest.raises(ValueError, match="does not support"):
        SGLangLM(engine=engine, seed=3)
    with pytest.raises(ValueError, match="explicit dspy.lm15.Request"):
        SGLangLM(engine=engine, regex="a")
    with pytest.raises(ValueError, match="exactly one of"):
        SGLangLM()
    with pytest.raises(ValueError, match="not served here"):
        SGLangLM(engine=engine, model="some-other-model")
    assert lm("still serving", temperature=0.0) == [greedy(engine, [{"role": "user", "content": "still serving"}], 4)]


def test_logprobs_are_the_engines(engine):
    lm = SGLangLM(engine=engine, temperature=0.0, max_tokens=5)
    out = lm("Score me", logprobs=True, top_logprobs=2)[0]
    ids = render(engine, [{"role": "user", "content": "Score me"}])
    ref = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 5, "temperature": 0.0},
                          return_logprob=True, top_logprobs_num=2)
    assert out["text"] == ref["text"]
    content = out["logprobs"]["content"]
    expected = ref["meta_info"]["output_token_logprobs"]
    assert [e["logprob"] for e in content] == pytest.approx([lp for lp, _, _ in expected])
    assert [e["token"] for e in content] == [engine.tokenizer.decode([t]) for _, t, _ in expected]
    for entry, top in zip(content, ref["meta_info"]["output_top_logprobs"]):
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx([lp for lp, _, _ in top[:2]])


def test_async_and_threaded_calls_with_history(engine):
    lm = SGLangLM(engine=engine, temperature=0.0, max_tokens=6)
    prompts = [f"Question {i}: what is {i} squared?" for i in range(6)]
    expected = {p: greedy(engine, [{"role": "user", "content": p}], 6) for p in prompts}

    async def run_all():
        return await asyncio.gather(*[lm.acall(p) for p in prompts])

    assert [out[0] for out in asyncio.run(run_all())] == [expected[p] for p in prompts]
    before = len(lm.history)
    with ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(lambda p: lm(p)[0], prompts))
    assert outs == [expected[p] for p in prompts]
    # Every call has its own history entry, holding its own prompt and reply.
    entries = lm.history[before:]
    assert len(entries) == 6
    assert {e["prompt"]: e["outputs"][0] for e in entries} == expected


def test_server_base_url(llama_ckpt):
    live = shared_server(llama_ckpt)
    lm = SGLangLM(base_url=live.url + "/v1", model=live.model, temperature=0.0, max_tokens=8)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello over HTTP"}]
    assert lm(messages=messages) == [greedy(live.engine, messages, 8)]
    usage = lm.history[-1]["usage"]
    assert usage["prompt_tokens"] == len(render(live.engine, messages))
    out = lm("Give JSON.", response_format={"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {"k": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["k"], "additionalProperties": False}}}, max_tokens=20)[0]
    assert 0 <= json.loads(out)["k"] <= 99
    outs = lm(messages=messages, n=2, temperature=1.0)
    assert len(outs) == 2
    assert lm.history[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 1
    with pytest.raises(ValueError, match="not served here"):
        SGLangLM(base_url=live.url, model="nope")
    # The saved state rebuilds an LM on the same server.
    state = lm.dump_state()
    again = dspy.BaseLM.load_state(state, allow_custom_lm_class=True)
    assert isinstance(again, SGLangLM) and again.base_url == live.url and again.kwargs["max_tokens"] == 8
