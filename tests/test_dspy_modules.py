"""DSPy modules end to end on the tiny random-weight model through SGLangLM: Predict, ChainOfThought,
ReAct with a tool, dspy.Parallel, Module.batch and n samples, with ChatAdapter and JSONAdapter; the
reply-format constraints; calls translated into one fork/join program; the example.

Oracles: DSPy's own parsers (a reply that does not parse raises, or makes ChatAdapter retry with
JSONAdapter, which the LM history would show), DSPy's own rendering of outputs (it must lie in the
format constraint's language, checked with Python `re`), `jsonschema`, `json`, the tokenizer's chat
template for the shared prefix's token count, and the engine's counters."""

from __future__ import annotations

import json
import os
import re
import runpy
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import jsonschema
import pydantic
import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # LiteLLM (under DSPy): no network at import

import dspy  # noqa: E402

from radixlm import Engine  # noqa: E402
from radixlm.adapters.dspy import (  # noqa: E402
    LMCall, SGLangLM, build_tree, chat_regex, format_for_call, json_schema, run_program,
)
from radixlm.adapters.dspy.program import CallBatcher, Sample  # noqa: E402
from radixlm.core.lang.backends.resolve import resolve_backend  # noqa: E402
from radixlm.core.lang.ir import GenParams  # noqa: E402

ADAPTERS = [pytest.param(dspy.ChatAdapter, id="chat"), pytest.param(dspy.JSONAdapter, id="json")]


@pytest.fixture(scope="module", autouse=True)
def _no_dspy_cache():
    dspy.configure_cache(enable_disk_cache=False, enable_memory_cache=False)


@pytest.fixture(scope="module")
def engine(llama_ckpt):
    with Engine(llama_ckpt) as eng:
        yield eng


@pytest.fixture()
def lm(engine):
    # The random model never ends a field by itself: bound each free-text value.
    return SGLangLM(engine=engine, temperature=0.0, max_tokens=160, max_field_chars=16, batch_window_s=0.2)


class Item(pydantic.BaseModel):
    name: str
    qty: int


class Everything(dspy.Signature):
    """Fill every field."""

    question: str = dspy.InputField()
    text: str = dspy.OutputField()
    count: int = dspy.OutputField()
    ok: bool = dspy.OutputField()
    label: Literal["yes", "no"] = dspy.OutputField()
    tags: list[str] = dspy.OutputField()
    item: Item = dspy.OutputField()
    score: float = dspy.OutputField()


SAMPLE = dict(text="hello world\nsecond [line]", count=12, ok=True, label="no", tags=["a", "b"],
              item=Item(name="x", qty=3), score=2.5)


def raw_reply(entry: dict[str, Any]) -> str:
    return entry["response"].text


def assert_reply_format(adapter: type, signature: Any, reply: str) -> None:
    """The reply in the adapter's format, checked independently of the constraint that produced it."""
    names = list(signature.output_fields)
    if adapter is dspy.JSONAdapter:
        assert list(json.loads(reply)) == names
    else:
        assert re.findall(r"^\[\[ ## (\w+) ## \]\]$", reply, flags=re.M) == [*names, "completed"]


# ----- the format constraints -----------------------------------------------------------------------


def test_chat_regex_accepts_what_dspy_itself_writes():
    rendered = dspy.ChatAdapter().format_assistant_message_content(Everything, SAMPLE)
    assert re.fullmatch(chat_regex(Everything), rendered.rstrip("\n"))
    # A free-text value cannot open a field of its own, and values follow their types.
    header = "[[ ## text ## ]]\n"
    regex = chat_regex(dspy.Signature("question -> text"))
    assert re.fullmatch(regex, header + "a\nb\n\n[[ ## completed ## ]]")
    assert not re.fullmatch(regex, header + "a\n[[ ## text ## ]]\nb\n\n[[ ## completed ## ]]")
    assert not re.fullmatch(regex, header + " \n\n[[ ## completed ## ]]")
    bounded = chat_regex(Everything, max_field_chars=4)
    assert re.fullmatch(bounded, rendered.rstrip("\n").replace("hello world\nsecond [line]", "hey").replace("2.5", "2"))
    assert not re.fullmatch(bounded, rendered.rstrip("\n").replace("2.5", "2"))  # text longer than 4


def test_json_schema_accepts_what_dspy_itself_writes():
    outputs = json.loads(dspy.JSONAdapter().format_assistant_message_content(Everything, SAMPLE))
    jsonschema.validate(outputs, json_schema(Everything))
    bounded = json_schema(Everything, max_field_chars=3)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(outputs, bounded)  # "hello world..." is longer than 3
    short = {**outputs, "text": "hi", "tags": ["a"], "item": {"name": "x", "qty": 3}, "score": 7}
    jsonschema.validate(short, bounded)
    jsonschema.validate(short, json_schema(Everything))  # bounded instances are instances of the original


def test_format_is_used_only_for_the_adapters_own_rendering():
    predict = dspy.Predict("question -> answer: int")
    chat = dspy.ChatAdapter().format(predict.signature, [], {"question": "q"})
    as_json = dspy.JSONAdapter().format(predict.signature, [], {"question": "q"})
    with dspy.context(caller_modules=[predict]):
        assert "regex" in format_for_call(chat)
        assert "json_schema" in format_for_call(as_json)  # ChatAdapter's fallback to JSON is recognized too
        assert format_for_call([{"role": "user", "content": "q"}]) is None
    with dspy.context(caller_modules=[predict], adapter=dspy.XMLAdapter()):
        assert format_for_call(chat) is None  # a format SGLangLM does not know is left alone
    assert format_for_call(chat) is None  # not called by a Predict


# ----- modules end to end -----------------------------------------------------------------------------


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_predict_and_chain_of_thought(lm, adapter):
    class Answer(dspy.Signature):
        """Answer the question."""

        question: str = dspy.InputField()
        answer: int = dspy.OutputField()
        sure: Literal["yes", "no"] = dspy.OutputField()

    with dspy.context(lm=lm, adapter=adapter()):
        before = len(lm.history)
        prediction = dspy.Predict("question -> answer")(question="What is 2 + 2?")
        assert isinstance(prediction.answer, str) and prediction.answer.strip()
        thought = dspy.ChainOfThought(Answer)(question="How many legs has a cat?")
        assert isinstance(thought.reasoning, str) and thought.reasoning.strip()
        assert isinstance(thought.answer, int) and thought.sure in ("yes", "no")
        entries = lm.history[before:]
    # One LM call per module call: every reply parsed the first time (no JSON fallback retry).
    assert len(entries) == 2
    assert_reply_format(adapter, dspy.Signature("question -> answer"), raw_reply(entries[0]))
    assert_reply_format(adapter, dspy.ChainOfThought(Answer).predict.signature, raw_reply(entries[1]))


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_react_calls_its_tool_with_valid_arguments(lm, adapter):
    calls = []

    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    agent = dspy.ReAct("question -> answer", tools=[get_weather], max_iters=2)
    with dspy.context(lm=lm, adapter=adapter()):
        result = agent(question="What is the weather in Paris?")
    assert isinstance(result.answer, str) and result.answer.strip()
    steps = [k for k in result.trajectory if k.startswith("tool_name_")]
    assert steps
    for i in range(len(steps)):
        name, args = result.trajectory[f"tool_name_{i}"], result.trajectory[f"tool_args_{i}"]
        assert name in ("get_weather", "finish")
        if name == "get_weather":
            # The arguments follow the tool's schema, so the tool really ran with them.
            assert set(args) == {"city"} and isinstance(args["city"], str)
            assert result.trajectory[f"observation_{i}"] == f"sunny in {args['city']}"
        else:
            assert args == {}
    assert len(calls) == sum(result.trajectory[f"tool_name_{i}"] == "get_weather" for i in range(len(steps)))


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_parallel_and_batch_share_the_instructions_and_demos(lm, engine, adapter):
    qa = dspy.Predict("question -> answer")
    qa.demos = [dspy.Example(question="What is 1 + 1?", answer="2"), dspy.Example(question="Capital of Peru?",
                                                                               answer="Lima")]
    questions = [f"What is {i} times {i + 3}?" for i in range(4)]
    with dspy.context(lm=lm, adapter=adapter()):
        before = len(lm.history)
        batch = qa.batch([dspy.Example(question=q).with_inputs("question") for q in questions],
                         num_threads=4, disable_progress_bar=True)
        program = lm.last_program
        parallel = dspy.Parallel(num_threads=4, disable_progress_bar=True)(
            [(qa, {"question": q + " Again."}) for q in questions])
        entries = lm.history[before:]
    assert len(entries) == 8  # one call per example: every reply parsed the first time
    for prediction in [*batch, *parallel]:
        assert isinstance(prediction.answer, str) and prediction.answer.strip()
    # The instructions and demos: the messages every call starts with, rendered by the chat template.
    shared = entries[0]["messages"][:-1]
    assert all(e["messages"][:-1] == shared for e in entries)
    prefix = engine.tokenizer.apply_chat_template(shared, tokenize=False)
    prefix_tokens = len(engine.tokenizer.encode(prefix, add_special_tokens=False))
    assert prefix_tokens > 100
    assert all(e["usage"]["prompt_tokens_details"]["cached_tokens"] >= prefix_tokens for e in entries)
    assert "fork(" in program and "gen(call" in program


def test_n_completions_with_both_adapters(lm):
    for adapter in (dspy.ChatAdapter, dspy.JSONAdapter):
        with dspy.context(lm=lm, adapter=adapter()):
            prediction = dspy.Predict("question -> answer: int", n=3)(question="Pick a number.")
        assert len(prediction.completions.answer) == 3
        assert all(isinstance(a, int) for a in prediction.completions.answer)


# ----- the program translation ------------------------------------------------------------------------


def test_build_tree_is_the_prefix_tree_of_the_messages():
    system, demo = ("system", "S"), ("user", "D")
    calls = [LMCall([system, demo, ("user", "a")], GenParams()), LMCall([system, demo, ("user", "b")], GenParams()),
             LMCall([system, ("user", "c")], GenParams(), n=2), LMCall([system, demo, ("user", "a")], GenParams()),
             LMCall([("system", "other")], GenParams())]
    tree = build_tree(calls)

    def paths(node, before):
        here = before + node.messages
        if node.call is not None:
            return {node.call: here}
        assert len(node.children) >= 2  # a stream that does not fork would have been merged upward
        out = {}
        for child in node.children:
            assert not set(out) & set(paths(child, here))
            out.update(paths(child, here))
        return out

    assert paths(tree, []) == {i: c.messages for i, c in enumerate(calls)}
    assert tree.messages == []  # the calls share no first message
    assert [c.messages for c in tree.children[0].children][:1] == [[demo]]
    text = tree.describe(calls)
    assert "fork(2)" in text and "assistant: fork(2) -> gen(call 2" in text


def test_call_batcher_groups_concurrent_calls_and_keeps_errors_apart():
    groups = []

    def run(calls):  # echoes each call's text; a call saying "bad" fails alone
        groups.append(len(calls))
        return [ValueError("bad call") if c.messages[0][1] == "bad" else [Sample(c.messages[0][1], {})]
                for c in calls]

    batcher = CallBatcher(run, window_s=0.2)
    assert batcher.submit(LMCall([("user", "alone")], GenParams()))[0].text == "alone"
    assert groups == [1]  # the main thread, nothing in flight: it ran at once
    start = threading.Barrier(6)

    def call(text):
        start.wait()
        try:
            return batcher.submit(LMCall([("user", text)], GenParams()))[0].text
        except ValueError as error:
            return str(error)

    texts = ["a", "b", "bad", "c", "d", "e"]
    with ThreadPoolExecutor(6) as pool:
        assert list(pool.map(call, texts)) == ["a", "b", "bad call", "c", "d", "e"]
    assert groups == [1, 6]  # the six concurrent calls ran as one group


def test_program_computes_the_shared_prefix_once(engine):
    system = ("system", "You are a careful assistant. " * 30)
    calls = [LMCall([system, ("user", f"Question {i}: {'why ' * i}?")],
                    GenParams(max_new_tokens=3, temperature=0.0)) for i in range(4)]
    assert engine.flush_cache()
    tok = engine.tokenizer
    prefix = len(tok.encode(tok.apply_chat_template([{"role": "system", "content": system[1]}], tokenize=False),
                            add_special_tokens=False))
    prompts = [len(tok.encode(tok.apply_chat_template([{"role": r, "content": c} for r, c in call.messages],
                                                      tokenize=False, add_generation_prompt=True),
                              add_special_tokens=False)) for call in calls]
    before = engine.get_stats()["prefill_tokens_total"]
    results = run_program(resolve_backend(engine), calls, build_tree(calls))
    computed = engine.get_stats()["prefill_tokens_total"] - before
    for result, prompt_tokens in zip(results, prompts):
        (sample,) = result
        assert sample.meta_info["prompt_tokens"] == prompt_tokens
        assert sample.meta_info["cached_tokens"] >= prefix
    # The prefix once, plus each call's own part; sending the calls alone would compute sum(prompts).
    assert computed <= prefix + sum(p - prefix for p in prompts)
    assert sum(prompts) - computed >= 3 * prefix


def test_example_program_runs(engine, capsys):
    example = runpy.run_path(str(Path(__file__).parent.parent / "examples" / "dspy_program.py"))
    results = example["main"](["--max-field-chars", "32"], engine=engine)  # a random model's fields, bounded
    assert len(results) == 5
    assert all(r.team in ("billing", "bugs", "accounts") and r.reply.strip() for r in results)
    out = capsys.readouterr().out
    assert "prompt tokens cached" in out and "fork(" in out
