"""SGLang frontend programs on the in-process engine (the tiny default model, greedy decoding).

Oracles: the engine's own generate() on the prompt that the program must have built, the
tokenizer's Jinja chat template, logprobs recomputed from the engine for select, Python's `re` and
`json` for constrained output, and the engine's counters for prefix sharing.
"""

from __future__ import annotations

import json
import re
import runpy
from pathlib import Path
from typing import Any, Iterator

import pytest

import radixlm
import radixlm as sgl
from radixlm.core.lang.config import global_config

MAX = 8


@pytest.fixture(scope="module")
def engine() -> Iterator[radixlm.Engine]:
    with radixlm.Engine(random_seed=0) as engine:
        sgl.set_default_backend(engine)
        yield engine
        global_config.default_backend = None


def stops(engine: radixlm.Engine, *strings: str) -> dict[str, Any]:
    """The stops every gen carries: its own plus the chat template's end-of-turn marker."""
    template = global_config.default_backend.get_chat_template()
    return {"stop": [*strings, *template.stop_str], "stop_token_ids": list(template.stop_token_ids)}


def greedy(engine: radixlm.Engine, prompt: str, max_new_tokens: int = MAX, **params: Any) -> str:
    """What the engine writes after `prompt`: the oracle for a program's gen."""
    params = {**stops(engine), **params}
    return engine.generate(prompt, {"temperature": 0, "max_new_tokens": max_new_tokens, **params})["text"]


def encode(engine: radixlm.Engine, text: str) -> list[int]:
    return engine.tokenizer(text)["input_ids"]


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# ----- programs -----

FEW_SHOT = ("The following are questions with answers.\n\nQ: What is the capital of France?\nA: Paris\n"
            "Q: What is the capital of Germany?\nA: Berlin\n")


@sgl.function
def few_shot_qa(s, question, max_tokens=MAX):
    s += FEW_SHOT
    s += "Q: " + question + "\n"
    s += "A:" + sgl.gen("answer", stop="\n", max_tokens=max_tokens)


def test_few_shot_qa_with_stop(engine) -> None:
    state = few_shot_qa.run(question="What is the capital of Japan?", temperature=0)
    prompt = FEW_SHOT + "Q: What is the capital of Japan?\nA:"
    assert state["answer"] == greedy(engine, prompt, **stops(engine, "\n"))
    assert "\n" not in state["answer"]
    assert state.text() == prompt + state["answer"]
    assert state.get_meta_info("answer")["prompt_tokens"] == len(encode(engine, prompt))


def test_example_program_runs(engine) -> None:
    example = runpy.run_path(str(Path(__file__).parent.parent / "examples" / "few_shot_qa.py"))
    states = example["main"]([], backend=engine)
    assert len(states) == 4 and all(s.error() is None for s in states)
    assert all("\n" not in s["answer"] for s in states)


@sgl.function
def chat_with_functions(s, q1, q2):
    s += sgl.system("You are terse.")
    s += sgl.user(q1)
    s += sgl.assistant(sgl.gen("a1", max_tokens=MAX))
    s += sgl.user(q2)
    s += sgl.assistant(sgl.gen("a2", max_tokens=MAX))


@sgl.function
def chat_with_scopes(s, q1, q2):
    with s.system():
        s += "You are terse."
    with s.user():
        s += q1
    with s.assistant():
        s += sgl.gen("a1", max_tokens=MAX)
    s += sgl.user_begin() + q2 + sgl.user_end()
    s += sgl.assistant_begin() + sgl.gen("a2", max_tokens=MAX) + sgl.assistant_end()


def test_multi_turn_chat_both_styles(engine) -> None:
    tokenizer = engine.tokenizer
    results = []
    for program in (chat_with_functions, chat_with_scopes):
        state = program.run(q1="Name a color.", q2="Another one?", temperature=0)
        history = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
        first_prompt = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        assert state["a1"] == greedy(engine, first_prompt)
        history += [{"role": "assistant", "content": state["a1"]}, {"role": "user", "content": "Another one?"}]
        second_prompt = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        assert state["a2"] == greedy(engine, second_prompt)
        history.append({"role": "assistant", "content": state["a2"]})
        assert state.text() == tokenizer.apply_chat_template(history, tokenize=False)
        assert [m["role"] for m in state.messages()] == ["system", "user", "assistant", "user", "assistant"]
        assert state.messages()[2]["content"] == state["a1"].lstrip()
        results.append((state.text(), state.messages()))
    assert results[0] == results[1]


@sgl.function
def true_or_false(s, statement, method):
    s += "Determine whether the statement below is True, False, or Unknown.\n"
    s += "Statement: " + statement + "\n"
    s += "Answer:" + sgl.select("answer", ["True", "False", "Unknown", " It depends on the context"],
                                choices_method=method)


def _choice_logprobs(engine: radixlm.Engine, prefix: str, choice: str) -> tuple[list[float], list[int]]:
    """Logprobs of the choice's own tokens after `prefix`, from one whole-prompt engine request."""
    prefix_ids, full_ids = encode(engine, prefix), encode(engine, prefix + choice)
    start = max(1, min(common_prefix_len(prefix_ids, full_ids), len(full_ids) - 1))
    out = engine.generate(input_ids=full_ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                          logprob_start_len=0)
    return [lp for lp, *_ in out["meta_info"]["input_token_logprobs"][start:]], full_ids[start:]


def test_select_is_the_argmax_of_each_method(engine) -> None:
    choices = ["True", "False", "Unknown", " It depends on the context"]
    statement = "The capital of Germany is Berlin."
    for method in (sgl.token_length_normalized, sgl.greedy_token_selection,
                   sgl.unconditional_likelihood_normalized):
        state = true_or_false.run(statement=statement, method=method)
        prefix = state.text()[:len(state.text()) - len(state["answer"])]
        scored = [_choice_logprobs(engine, prefix, c) for c in choices]
        if method is sgl.token_length_normalized:
            scores = [sum(lps) / len(lps) for lps, _ in scored]
            expected = choices[scores.index(max(scores))]
        elif method is sgl.greedy_token_selection:
            width = max(len(lps) for lps, _ in scored)
            rows = [lps + [sum(lps) / len(lps)] * (width - len(lps)) for lps, _ in scored]
            expected = choices[rows.index(max(rows))]  # lexicographic: best first token, then the next, ...
        else:
            scores = []
            for lps, ids in scored:
                alone = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                                        logprob_start_len=0)["meta_info"]["input_token_logprobs"]
                scores.append(sum(c - (u or 0.0) for c, (u, *_) in zip(lps, alone)) / len(lps))
            expected = choices[scores.index(max(scores))]
        assert state["answer"] == expected, method
        assert state.text() == prefix + expected


def test_select_costs_one_prefix_prefill(engine) -> None:
    choices = ["True", "False", "Unknown", " It depends on the context"]
    statement = "The sky over the sea is green on most days of the year, say sailors."
    prefix = (f"Determine whether the statement below is True, False, or Unknown.\nStatement: {statement}\nAnswer:")
    assert engine.flush_cache()
    before = engine.get_stats()["prefill_tokens_total"]
    state = true_or_false.run(statement=statement, method=sgl.token_length_normalized)
    assert state["answer"] in choices
    computed = engine.get_stats()["prefill_tokens_total"] - before
    prefix_ids = encode(engine, prefix)
    own = sum(len(encode(engine, prefix + c)) - common_prefix_len(prefix_ids, encode(engine, prefix + c))
              for c in choices)
    # the prefix once, each choice's own tokens (+1 where a fully cached prompt recomputes its last token)
    assert computed <= len(prefix_ids) + own + len(choices)
    assert computed < 2 * len(prefix_ids)  # one full call per choice would be 4 prefixes


def calculate(expression: str) -> str:
    """The 'tool': host Python that runs between gens."""
    return f"{len(expression)} characters, {sum(c.isdigit() for c in expression)} digits"


@sgl.function
def tool_use(s, lhs, rhs):
    s += "Please perform computations using a calculator. You can use calculate(expression).\n"
    s += "Question: What is the product of " + str(lhs) + " and " + str(rhs) + "?\n"
    s += "Answer: The answer is calculate(" + sgl.gen("expression", stop=")", max_tokens=MAX) + ") = "
    with s.var_scope("answer"):
        s += calculate(s["expression"])
    s += "\nSo" + sgl.gen("final", max_tokens=MAX)


def test_tool_use_with_host_python(engine) -> None:
    state = tool_use.run(lhs=257, rhs=983, temperature=0)
    assert state["answer"] == calculate(state["expression"])
    before_final = state.text()[:len(state.text()) - len(state["final"])]
    assert before_final.endswith(") = " + state["answer"] + "\nSo")
    assert state["final"] == greedy(engine, before_final)


@sgl.function
def react(s, question):
    s += ("Question: Which country does the founder of Microsoft live in?\n"
          "Thought 1: I need to search for the founder of Microsoft.\nAction 1: Search [Founder of Microsoft].\n"
          "Observation 1: The founder of Microsoft is Bill Gates.\nThought 2: The answer is the United States.\n"
          "Action 2: Finish [United States].\n\n")
    s += "Question: " + question + "\n"
    for i in range(1, 4):
        s += f"Thought {i}:" + sgl.gen(f"thought_{i}", stop=[".", "\n"], max_tokens=MAX) + ".\n"
        s += f"Action {i}: " + sgl.select(f"action_{i}", ["Search", "Finish"])
        if s[f"action_{i}"] == "Search":
            s += " [" + sgl.gen(f"query_{i}", stop="]", max_tokens=MAX) + "].\n"
            s += f"Observation {i}:" + sgl.gen(f"observation_{i}", stop=[".", "\n"], max_tokens=MAX) + ".\n"
        else:
            s += " [" + sgl.gen("answer", stop="]", max_tokens=MAX) + "].\n"
            break


def test_react_loop_with_select_and_gen(engine) -> None:
    state = react.run(question="What country does the creator of Linux live in?", temperature=0)
    actions = [state[f"action_{i}"] for i in range(1, 4) if f"action_{i}" in state]
    assert actions and set(actions) <= {"Search", "Finish"}
    # the Python loop followed the model's choices: it stops at the first Finish
    assert "Finish" not in actions[:-1]
    assert ("answer" in state) == (actions[-1] == "Finish")
    assert len(actions) == 3 or actions[-1] == "Finish"
    text = state.text()
    for i, action in enumerate(actions, 1):
        assert f"Thought {i}:{state[f'thought_{i}']}.\nAction {i}: {action} [" in text


@sgl.function
def skeleton_of_thought(s, topic):
    s += "Act as a helpful assistant.\nUSER: Give some tips for " + topic + ".\n"
    s += "ASSISTANT: Okay. Here are 3 concise tips:\n"
    for i in range(1, 4):
        s += f"{i}." + sgl.gen(f"skeleton_{i}", max_tokens=MAX, stop=["\n"]) + "\n"
    forks = s.fork(3)
    for i in range(3):
        forks[i] += f"Now, I expand tip {i + 1} into a detailed paragraph:\nTip {i + 1}:"
        forks[i] += sgl.gen("detailed_tip", max_tokens=MAX, stop=["\n\n"])
    forks.join()
    s += "Here are these tips with detailed explanation:\n"
    for i in range(3):
        s += f"Tip {i + 1}:" + forks[i]["detailed_tip"] + "\n"
    s += "\nIn summary," + sgl.gen("summary", max_tokens=MAX)
    return forks


def test_skeleton_of_thought_fork_join(engine) -> None:
    state = skeleton_of_thought.run(topic="writing a good blog post", temperature=0)
    forks = state.ret_value
    text = state.text()
    parent = text[:text.index("Here are these tips")]
    tips = state["detailed_tip"]
    assert tips == [f["detailed_tip"] for f in forks]
    parent_ids = encode(engine, parent)
    for i, tip in enumerate(tips):
        branch = parent + f"Now, I expand tip {i + 1} into a detailed paragraph:\nTip {i + 1}:"
        assert tip == greedy(engine, branch, **stops(engine, "\n\n"))
        assert forks[i].text() == branch + tip
        shared = common_prefix_len(parent_ids, encode(engine, branch))
        assert forks[i].get_meta_info("detailed_tip")["cached_tokens"] >= shared - 1
    joined = "".join(f"Tip {i + 1}:{tip}\n" for i, tip in enumerate(tips))
    assert text == parent + "Here are these tips with detailed explanation:\n" + joined + "\nIn summary," + state["summary"]


def test_fork_prefills_the_shared_prefix_once(engine) -> None:
    @sgl.function
    def fan_out(s, context):
        s += "Context: " + context + "\n"
        forks = s.fork(4)
        forks += lambda i: f"Question {i}: why?\nAnswer:" + sgl.gen("answer", max_tokens=4)
        forks.join()
        return forks

    context = "A long shared document about radix trees and how they share prefixes. " * 4
    assert engine.flush_cache()
    state = fan_out.run(context=context, temperature=0)
    prefix_ids = encode(engine, "Context: " + context + "\n")
    for fork in state.ret_value:
        branch_ids = encode(engine, fork.text()[:len(fork.text()) - len(fork["answer"])])
        assert fork.get_meta_info("answer")["cached_tokens"] >= common_prefix_len(prefix_ids, branch_ids) - 1


@sgl.function
def parallel_encoding(s, question, contexts):
    s += "USER: I will ask a question based on some statements.\nASSISTANT: Sure.\n"
    s += "USER: Please memorize these statements.\n"
    forks = s.fork(len(contexts))
    forks += lambda i: f"Statement {i}: " + contexts[i] + "\n"
    forks.join(mode="concate_and_append")
    s += "Now, please answer the following question.\nQuestion: " + question + "\n"
    s += "ASSISTANT:" + sgl.gen("answer", max_tokens=MAX)


def test_parallel_encoding_concate_and_append(engine) -> None:
    contexts = ["Ethan is the father of Liam.", "Noah is the father of Julian.", "Oliver is the father of Carlos."]
    state = parallel_encoding.run(question="Who is the father of Julian?", contexts=contexts, temperature=0)
    prompt = ("USER: I will ask a question based on some statements.\nASSISTANT: Sure.\n"
              "USER: Please memorize these statements.\n"
              + "".join(f"Statement {i}: {c}\n" for i, c in enumerate(contexts))
              + "Now, please answer the following question.\nQuestion: Who is the father of Julian?\nASSISTANT:")
    assert state.text() == prompt + state["answer"]
    assert state["answer"] == greedy(engine, prompt)


@sgl.function
def chat_qa(s, question):
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=16))


def test_streaming_with_text_iter(engine) -> None:
    state = chat_qa.run(question="Tell me about Hawaii.", stream=True, temperature=0)
    chunks = list(state.text_iter())
    assert len(chunks) > 3 and "".join(chunks) == state.text()
    state = chat_qa.run(question="Tell me about Hawaii.", stream=True, temperature=0)
    answer_chunks = list(state.text_iter("answer"))
    assert len(answer_chunks) > 3 and "".join(answer_chunks) == state["answer"]
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": "You are a helpful assistant."},
         {"role": "user", "content": "Tell me about Hawaii."}], tokenize=False, add_generation_prompt=True)
    assert state["answer"] == greedy(engine, prompt, max_new_tokens=16)


def test_run_batch_of_64_with_threads(engine) -> None:
    questions = [f"What is {i} plus {i}?" for i in range(64)]
    batch = [{"question": q} for q in questions]
    batch[7]["max_tokens"] = -1  # the engine rejects this one program; the other 63 must not notice
    assert engine.flush_cache()
    states = few_shot_qa.run_batch(batch, num_threads=16, temperature=0)
    assert len(states) == 64
    assert isinstance(states[7].error(), ValueError)
    prompts = [FEW_SHOT + f"Q: {q}\nA:" for q in questions]
    params = {"temperature": 0, "max_new_tokens": MAX, **stops(engine, "\n")}
    expected = [out["text"] for out in engine.generate(prompts, params)]
    shared = len(encode(engine, FEW_SHOT)) - 1
    for i, state in enumerate(states):
        if i == 7:
            continue
        assert state.error() is None
        assert state["answer"] == expected[i]
        # run_batch prefilled the common prefix (found by tracing) before the programs ran
        assert state.get_meta_info("answer")["cached_tokens"] >= shared


def test_min_tokens(engine) -> None:
    prompt = "Count: one two three"
    free = greedy(engine, prompt, max_new_tokens=16)
    stop = free[0]  # the model's very first character: without min_tokens the gen ends at once

    @sgl.function
    def prog(s, min_tokens):
        s += prompt + sgl.gen("x", max_tokens=16, min_tokens=min_tokens, stop=stop)

    assert prog.run(min_tokens=None, temperature=0)["x"] == ""
    state = prog.run(min_tokens=6, temperature=0)
    assert state.get_meta_info("x")["completion_tokens"] >= 6
    assert state["x"] == greedy(engine, prompt, max_new_tokens=16, min_new_tokens=6, **stops(engine, stop))


def test_errors_land_on_the_state(engine) -> None:
    @sgl.function
    def bad(s):
        s += "Hello" + sgl.gen("x", max_tokens=4, temperature=-1.0)
        s += "never appended"

    state = bad.run()
    assert isinstance(state.error(), radixlm.core.errors.InvalidRequestError)
    with pytest.raises(sgl.ProgramError):
        state["x"]
    assert state.text() == "Hello"

    @sgl.function
    def with_image(s, path):
        s += sgl.user(sgl.image(path) + "What is this?")

    state = with_image.run(path="picture.png")
    assert "vision" in str(state.error())


# ----- constrained decoding (regex, dtype, JSON) -----

def _needs_constraints(engine: radixlm.Engine) -> None:
    try:
        engine.generate("x", {"max_new_tokens": 1, "regex": "a"})
    except radixlm.core.errors.InvalidRequestError as error:
        if "not available" in str(error):
            pytest.skip("constrained decoding has not landed in the engine yet")
        raise


IPV4 = r"((25[0-5]|2[0-4]\d|[01]?\d\d?)\.){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)"


def test_ipv4_regex(engine) -> None:
    _needs_constraints(engine)

    @sgl.function
    def regex_gen(s):
        s += "Q: What is the IP address of the Google DNS servers?\n"
        s += "A: " + sgl.gen("answer", temperature=0, regex=IPV4, max_tokens=24)

    assert re.fullmatch(IPV4, regex_gen.run()["answer"])


def test_gen_int_and_every_dtype(engine) -> None:
    _needs_constraints(engine)

    @sgl.function
    def dtypes(s):
        s += "Q: How many hours are in a day?\nA: " + sgl.gen_int("int_res", max_tokens=6) + "\n"
        s += "Q: What is pi?\nA: " + sgl.gen("float_res", dtype=float, max_tokens=8) + "\n"
        s += "Q: Is the sky blue?\nA: " + sgl.gen("bool_res", dtype=bool) + "\n"
        s += "Q: Name a city.\nA: " + sgl.gen_string("str_res", max_tokens=12) + "\n"

    state = dtypes.run(temperature=0)
    int(state["int_res"])
    float(state["float_res"])
    assert state["bool_res"] in ("True", "False")
    # a quoted string; cut short by max_tokens it is a prefix of one
    closed = state.get_meta_info("str_res")["finish_reason"]["type"] == "stop"
    assert re.fullmatch(r"\"[\w\d\s]*\"" if closed else r"\"[\w\d\s]*", state["str_res"])


def test_json_from_regex_gens(engine) -> None:
    _needs_constraints(engine)
    name, number = r"\"[A-Za-z ]{1,12}\"", r"(0|[1-9][0-9]{0,5})"

    @sgl.function
    def city(s):
        s += "Describe Paris as JSON.\n"
        with s.var_scope("json_output"):
            s += "{\n"
            s += '  "name": ' + sgl.gen("name", regex=name, max_tokens=16) + ",\n"
            s += '  "population": ' + sgl.gen("population", regex=number, max_tokens=8) + ",\n"
            s += '  "area": ' + sgl.gen("area", regex=number, max_tokens=8) + "\n"
            s += "}"

    state = city.run(temperature=0)
    obj = json.loads(state["json_output"])
    assert isinstance(obj["name"], str) and isinstance(obj["population"], int) and isinstance(obj["area"], int)


# ----- tracing compiler on the engine -----

def test_compiled_program_runs_like_the_interpreted_one(engine) -> None:
    compiled = skeleton_of_thought.compile()
    interpreted = skeleton_of_thought.run(topic="gardening", temperature=0)
    state = compiled.run(topic="gardening", temperature=0)
    assert state.text() == interpreted.text()
    assert state["detailed_tip"] == interpreted["detailed_tip"]
    batch = compiled.run_batch([{"topic": "gardening"}, {"topic": "cooking"}], temperature=0)
    assert batch[0].text() == interpreted.text()
    assert batch[1].text() == skeleton_of_thought.run(topic="cooking", temperature=0).text()


def test_cache_prefills_the_traced_prefix(engine) -> None:
    assert engine.flush_cache()
    prefix = few_shot_qa.cache()
    assert prefix == FEW_SHOT + "Q: "
    state = few_shot_qa.run(question="Where is Rome?", temperature=0)
    assert state.get_meta_info("answer")["cached_tokens"] >= len(encode(engine, FEW_SHOT)) - 1
    assert sgl.flush_cache() is True
