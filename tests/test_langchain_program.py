"""Runnable translation: a chain's batch() is one shared-prefix program, a RunnableParallel runs as fork/join
(to_program), and the shared prefix shows up as cached tokens. Oracles: the engine's greedy output on each
prompt rendered independently with the chat template, its token counters, and the tokenizer (how many
tokens the shared prefix has)."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnableLambda, RunnableParallel
from pydantic import BaseModel

from radixlm.adapters.langchain import ChatSGLang, LangChainProgram, to_program
from radixlm.testing.checkpoints import tiny_model_path
from server_harness import render_chat, shared_server, wait_idle

SYSTEM = "You are a careful assistant who explains how a radix-tree KV cache shares prompt prefixes. " * 4
MAX = 6


@pytest.fixture(scope="module")
def live() -> Any:
    return shared_server(tiny_model_path())


@pytest.fixture
def llm(live: Any) -> ChatSGLang:
    return ChatSGLang(engine=live.engine, temperature=0, max_tokens=MAX)


def prompt(human: str) -> ChatPromptTemplate:
    return ChatPromptTemplate.from_messages([("system", SYSTEM), ("human", human)])


def oracle_text(engine: Any, human: str, max_new_tokens: int = MAX) -> str:
    ids = render_chat(engine, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": human}])
    return engine.generate(input_ids=ids, sampling_params={"max_new_tokens": max_new_tokens, "temperature": 0})["text"]


def shared_tokens(engine: Any, humans: list[str]) -> int:
    """Tokens of the prompts' common prefix (rendered independently)."""
    texts = [engine.tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM},
                                                   {"role": "user", "content": h}],
                                                  tokenize=False, add_generation_prompt=True) for h in humans]
    return len(engine.tokenizer.encode(os.path.commonprefix(texts), add_special_tokens=False))


def fresh_cache(live: Any) -> dict[str, Any]:
    wait_idle(live)
    assert live.engine.flush_cache()
    return live.engine.get_stats()


def computed_prompt_tokens(before: dict[str, Any], after: dict[str, Any]) -> int:
    """Prompt tokens the engine had to compute (not found in the radix cache) between two stats."""
    prompt = after["prompt_tokens_total"] - before["prompt_tokens_total"]
    return prompt - (after["cached_tokens_total"] - before["cached_tokens_total"])


QUESTIONS = ["What is a radix tree?", "Why share prefixes?", "What is LRU eviction?", "Define a KV slot."]


def test_chain_batch_computes_the_shared_prefix_once(llm: ChatSGLang, live: Any) -> None:
    chain = prompt("{question}") | llm | StrOutputParser()
    humans = QUESTIONS
    shared = shared_tokens(live.engine, humans)
    assert shared > 80  # the system prompt and the template around it
    own = [len(render_chat(live.engine, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": h}]))
           - shared for h in humans]

    before = fresh_cache(live)
    replies = chain.batch([{"question": q} for q in QUESTIONS])
    after = live.engine.get_stats()
    assert replies == [oracle_text(live.engine, h) for h in humans]
    # The shared prefix was computed once (a token at its boundary may be recomputed per prompt), not per prompt.
    assert computed_prompt_tokens(before, after) <= shared + sum(own) + 2 * len(humans)

    # Through ChatSGLang's own messages: every reply's cache reads cover the shared prefix.
    fresh_cache(live)
    messages = (prompt("{question}") | llm).batch([{"question": q} for q in QUESTIONS])
    for message in messages:
        assert message.usage_metadata["input_token_details"]["cache_read"] >= shared - 1


def test_parallel_branches_run_as_fork_join(llm: ChatSGLang, live: Any) -> None:
    joke = prompt("Tell a joke about {topic}.") | llm | StrOutputParser()
    poem = prompt("Write a poem about {topic}.") | llm.bind(max_tokens=3)
    program = to_program(RunnableParallel(joke=joke, poem=poem))
    shown = str(program)
    assert "forks = s.fork(2)" in shown and "def program(s, topic):" in shown
    assert "'Tell a joke about ' + topic + " in shown and "gen('poem', max_new_tokens=3" in shown
    assert "forks.join()" in shown

    humans = ["Tell a joke about cats.", "Write a poem about cats."]
    shared = shared_tokens(live.engine, humans)
    calls = program.calls({"topic": "cats"})
    assert calls["joke"].prompt.startswith(os.path.commonprefix([c.prompt for c in calls.values()]))

    before = fresh_cache(live)
    out = program.invoke({"topic": "cats"})
    after = live.engine.get_stats()
    assert out["joke"] == oracle_text(live.engine, humans[0])
    assert out["poem"].content == oracle_text(live.engine, humans[1], 3)
    # The fork prefilled the shared prefix before the branches started: the branch's reads cover it.
    assert out["poem"].usage_metadata["input_token_details"]["cache_read"] >= shared - 1
    own = sum(len(render_chat(live.engine, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": h}]))
              - shared for h in humans)
    assert computed_prompt_tokens(before, after) <= shared + own + 4


def test_parallel_batch_and_async(llm: ChatSGLang, live: Any) -> None:
    program = to_program(RunnableParallel(a=prompt("Say {word} once.") | llm,
                                          b=prompt("Say {word} twice.") | llm))
    words = ["red", "green", "blue"]
    fresh_cache(live)
    outs = program.batch([{"word": w} for w in words])
    for word, out in zip(words, outs):
        assert out["a"].content == oracle_text(live.engine, f"Say {word} once.")
        assert out["b"].content == oracle_text(live.engine, f"Say {word} twice.")
    shared = shared_tokens(live.engine, [f"Say {w} {n}." for w in words for n in ("once", "twice")])
    assert all(out[k].usage_metadata["input_token_details"]["cache_read"] >= shared - 1 for out in outs for k in "ab")

    async def run() -> tuple[Any, list[Any]]:
        return await program.ainvoke({"word": "red"}), await program.abatch([{"word": "red"}])

    one, many = asyncio.run(run())
    assert one["a"].content == outs[0]["a"].content and many[0]["b"].content == outs[0]["b"].content


def test_branches_keep_their_bindings(llm: ChatSGLang, live: Any) -> None:
    class Topic(BaseModel):
        name: str

    structured = ChatSGLang(engine=live.engine, temperature=0, max_tokens=24, max_string_length=5)
    program = to_program({"topic": prompt("Name a topic about {x}.") | structured.with_structured_output(Topic),
                          "echo": RunnableLambda(lambda d: d["x"].upper()),
                          "call": prompt("Use the tool on {x}.")
                          | structured.bind_tools([Topic], tool_choice="Topic")})
    out = program.invoke({"x": "cats"})
    assert isinstance(out["topic"], Topic) and len(out["topic"].name) <= 5
    assert out["echo"] == "CATS"
    assert out["call"].tool_calls[0]["name"] == "Topic" and set(out["call"].tool_calls[0]["args"]) == {"name"}


def test_single_chain_program(llm: ChatSGLang, live: Any) -> None:
    chain = prompt("Answer: {question}") | llm | StrOutputParser()
    program = to_program(chain)
    assert isinstance(program, LangChainProgram)
    shown = str(program)
    assert "s += gen('output', max_new_tokens=6, temperature=0.0, stop=['<|im_end|>'])" in shown
    assert "Answer: ' + question + '<|im_end|>" in shown and "StrOutputParser" in shown
    assert program.invoke({"question": "hi"}) == chain.invoke({"question": "hi"})
    assert program.batch([{"question": q} for q in QUESTIONS[:2]]) == chain.batch([{"question": q} for q in QUESTIONS[:2]])


def test_parallel_through_the_server(llm: ChatSGLang, live: Any) -> None:
    remote = ChatSGLang(base_url=live.url, temperature=0, max_tokens=MAX)
    branches = {"a": prompt("First: {q}") | remote, "b": prompt("Second: {q}") | remote}
    fresh_cache(live)
    out = to_program(RunnableParallel(**branches)).invoke({"q": "why?"})
    assert out["a"].content == oracle_text(live.engine, "First: why?")
    shared = shared_tokens(live.engine, ["First: why?", "Second: why?"])
    assert min(out[k].usage_metadata["input_token_details"]["cache_read"] for k in "ab") >= shared - 1


def test_what_cannot_be_translated(llm: ChatSGLang, live: Any) -> None:
    with pytest.raises(ValueError, match="no ChatSGLang call"):
        to_program(prompt("{q}") | StrOutputParser())
    remote = ChatSGLang(base_url=live.url, max_tokens=2)
    mixed = to_program(RunnableParallel(a=prompt("{q}") | llm, b=prompt("{q}") | remote))
    with pytest.raises(ValueError, match="share one engine or server"):
        mixed.invoke({"q": "x"})


def test_example_chain(live: Any) -> None:
    import runpy
    from pathlib import Path

    example = runpy.run_path(str(Path(__file__).parent.parent / "examples" / "langchain_chain.py"))
    fresh_cache(live)
    out = example["main"]([], engine=live.engine)
    system_tokens = len(live.engine.tokenizer.encode(
        live.engine.tokenizer.apply_chat_template([{"role": "system", "content": example["SYSTEM"]}], tokenize=False),
        add_special_tokens=False))
    for reply in out["replies"]:
        assert reply.usage_metadata["input_token_details"]["cache_read"] >= system_tokens
    assert "forks = s.fork(2)" in str(out["program"])
    assert set(out["parallel"]) == {"answer", "rating"}
    assert out["parallel"]["answer"] == out["replies"][0].content  # the same greedy call, inside the fork
