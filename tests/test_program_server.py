"""Programs through radixlm's own HTTP server, started by `sgl.Runtime` (`python -m radixlm.server`):
the native `/generate` backend (RuntimeEndpoint) and the OpenAI backend on the server's `/v1`, with
API speculative execution counted by the server itself."""

from __future__ import annotations

from typing import Any, Iterator

import httpx
import openai
import pytest

import radixlm as sgl

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def runtime() -> Iterator[sgl.Runtime]:
    runtime = sgl.Runtime()
    try:
        yield runtime
    finally:
        runtime.shutdown()
    assert runtime.pid is None


def native_greedy(runtime: sgl.Runtime, prompt: str, **params: Any) -> dict[str, Any]:
    """The server's own /generate: the oracle for the endpoint backend."""
    template = runtime.endpoint.get_chat_template()
    stop = params.pop("stop", []) + list(template.stop_str)
    response = httpx.post(runtime.url + "/generate", json={"text": prompt, "sampling_params": {
        "temperature": 0, "stop": stop, "stop_token_ids": list(template.stop_token_ids), **params}}, timeout=60)
    assert response.status_code == 200
    return response.json()


def server_counts(runtime: sgl.Runtime) -> tuple[int, int]:
    """(requests, prompt tokens) the server's engine has seen."""
    stats = runtime.endpoint.get_server_info()["internal_states"][0]
    return stats["requests_total"], stats["prompt_tokens_total"]


# ----- RuntimeEndpoint: native /generate -----

@sgl.function
def qa_and_pick(s, question):
    s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=8, stop="\n")
    s += "\nIs that right?" + sgl.select("verdict", ["yes", "no", "not sure"])


def test_runtime_endpoint_runs_programs(runtime) -> None:
    endpoint = runtime.endpoint
    state = qa_and_pick.run(question="What is 2+2?", temperature=0, backend=runtime)
    prompt = "Q: What is 2+2?\nA:"
    assert state["answer"] == native_greedy(runtime, prompt, max_new_tokens=8, stop=["\n"])["text"]
    assert state.text() == prompt + state["answer"] + "\nIs that right?" + state["verdict"]
    # select: the best mean logprob over each choice's tokens, recomputed from the server
    prefix = state.text()[:len(state.text()) - len(state["verdict"])]
    tokenizer = endpoint.tokenizer
    prefix_ids = tokenizer(prefix)["input_ids"]
    scores = []
    for choice in ["yes", "no", "not sure"]:
        ids = tokenizer(prefix + choice)["input_ids"]
        start = next(i for i, (a, b) in enumerate(zip(prefix_ids + [None], ids)) if a != b)
        out = httpx.post(runtime.url + "/generate", json={
            "input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
            "logprob_start_len": 0}, timeout=60).json()
        lps = [lp for lp, *_ in out["meta_info"]["input_token_logprobs"][max(start, 1):]]
        scores.append(sum(lps) / len(lps))
    assert state["verdict"] == ["yes", "no", "not sure"][scores.index(max(scores))]


def test_runtime_endpoint_streams_and_shares_prefixes(runtime) -> None:
    sgl.set_default_backend(runtime)
    try:
        state = qa_and_pick.run(question="Why?", temperature=0, stream=True)
        chunks = list(state.text_iter("answer"))
        assert len(chunks) > 1 and "".join(chunks) == state["answer"]
        state.sync()  # the select after the streamed answer must finish before the cache can be flushed

        @sgl.function
        def fan_out(s):
            s += "A shared context that every branch reads before answering its own question. " * 3
            forks = s.fork(3)
            forks += lambda i: f"Question {i}:" + sgl.gen("answer", max_tokens=4)
            forks.join()
            return forks

        assert sgl.flush_cache()
        state = fan_out.run(temperature=0)
        shared = len(runtime.endpoint.tokenizer(
            "A shared context that every branch reads before answering its own question. " * 3)["input_ids"])
        for fork in state.ret_value:
            assert fork.get_meta_info("answer")["cached_tokens"] >= shared - 1
    finally:
        sgl.global_config.default_backend = None


# ----- the OpenAI backend on the server's OpenAI-compatible API -----

def test_openai_backend_completion_and_chat(runtime) -> None:
    completion = sgl.OpenAI(MODEL, base_url=runtime.url + "/v1", is_chat_model=False)

    @sgl.function
    def few_shot(s, question):
        s += "Q: What is 1+1?\nA: 2\nQ: " + question + "\nA:" + sgl.gen("answer", max_tokens=8, stop="\n")

    state = few_shot.run(question="What is 2+2?", temperature=0, backend=completion)
    expected = native_greedy(runtime, "Q: What is 1+1?\nA: 2\nQ: What is 2+2?\nA:", max_new_tokens=8, stop=["\n"])
    # the OpenAI API sends no chat-template stops for completion models, so compare up to them
    assert expected["text"].startswith(state["answer"]) or state["answer"].startswith(expected["text"])
    assert completion.token_usage.requests == 1
    assert completion.token_usage.prompt_tokens == expected["meta_info"]["prompt_tokens"]

    # select on a completion model: one echo+logprobs call scores all choices; the decision agrees
    # with the native endpoint's, which scores token ids through /generate
    @sgl.function
    def verdict(s, statement):
        s += "Statement: " + statement + "\nAnswer:" + sgl.select("v", [" True", " False", " Unknown at all"])

    usage_before = completion.token_usage.requests
    picked = verdict.run(statement="Rome is in Italy.", backend=completion)["v"]
    assert completion.token_usage.requests == usage_before + 1
    assert picked == verdict.run(statement="Rome is in Italy.", backend=runtime)["v"]

    chat = sgl.OpenAI(MODEL, base_url=runtime.url + "/v1")

    @sgl.function
    def chat_qa(s, question):
        s += sgl.system("Be brief.")
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=8))

    state = chat_qa.run(question="Hi!", temperature=0, backend=chat)
    client = openai.OpenAI(base_url=runtime.url + "/v1", api_key="EMPTY")
    reference = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
        max_tokens=8, temperature=0)
    assert state["answer"] == reference.choices[0].message.content
    assert state.messages()[-1] == {"role": "assistant", "content": state["answer"].lstrip()}

    @sgl.function
    def outside_assistant(s):
        s += sgl.user("Hi") + sgl.gen("x", max_tokens=2)

    assert "assistant role" in str(outside_assistant.run(backend=chat).error())


def _separators(text: str, start: int, count: int) -> list[tuple[int, str]]:
    """`count` two-character separators in `text` after `start`, each at its first occurrence
    after the previous one, with at least 2 characters between them."""
    found, pos = [], start + 2
    while len(found) < count and pos + 2 <= len(text):
        sep = text[pos:pos + 2]
        if text.find(sep, found[-1][0] + 2 if found else start) == pos and sep.strip():
            found.append((pos, sep))
            pos += 4
        else:
            pos += 1
    assert len(found) == count, f"no separators in {text!r}"
    return found


def test_speculative_execution_completion_model(runtime) -> None:
    backend = sgl.OpenAI(MODEL, base_url=runtime.url + "/v1", is_chat_model=False)
    prompt = "Construct a character.\nName: Steve Jobs.\nBirthday: February 24, 1955.\nJob: Apple CEO.\n\nName:"
    client = openai.OpenAI(base_url=runtime.url + "/v1", api_key="EMPTY")
    spoken = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0).choices[0].text
    # Delimiters the model does write: a trained model follows the format; this one's output is
    # whatever the random weights give, so the format is taken from it.
    (p1, sep1), (p2, sep2) = _separators(spoken, 0, 2)

    def program(s):
        s += prompt + sgl.gen("name", stop=sep1) + sep1 + sgl.gen("birthday", stop=sep2) + sep2

    spec, plain = sgl.function(num_api_spec_tokens=32)(program), sgl.function(program)

    before = server_counts(runtime)
    state = spec.run(temperature=0, max_new_tokens=32, backend=backend)
    assert state.error() is None
    after_spec = server_counts(runtime)
    plain_state = plain.run(temperature=0, max_new_tokens=32, backend=backend)
    plain_state.sync()
    after_plain = server_counts(runtime)

    spec_calls, spec_prompt = after_spec[0] - before[0], after_spec[1] - before[1]
    plain_calls, plain_prompt = after_plain[0] - after_spec[0], after_plain[1] - after_spec[1]
    assert (spec_calls, plain_calls) == (1, 2)
    assert spec_prompt < plain_prompt
    assert state["name"] == spoken[:p1] and state["birthday"] == spoken[p1 + 2:p2]
    assert state.get_meta_info("birthday")["speculative"] is True
    assert state.text() == prompt + spoken[:p2 + 2]


def test_speculation_falls_back_when_the_text_does_not_match(runtime) -> None:
    backend = sgl.OpenAI(MODEL, base_url=runtime.url + "/v1", is_chat_model=False)
    prompt = "Construct a character.\nName:"
    client = openai.OpenAI(base_url=runtime.url + "/v1", api_key="EMPTY")
    spoken = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0).choices[0].text
    [(p1, sep1)] = _separators(spoken, 0, 1)

    def program(s):
        s += prompt + sgl.gen("name", stop=sep1) + "\u2603 not what the model says \u2603"
        s += sgl.gen("job", max_tokens=4)

    spec, plain = sgl.function(num_api_spec_tokens=16)(program), sgl.function(program)
    state = spec.run(temperature=0, max_new_tokens=16, backend=backend)
    reference = plain.run(temperature=0, max_new_tokens=16, backend=backend)
    assert state.error() is None
    assert state["name"] == spoken[:p1] == reference["name"]
    assert state["job"] == reference["job"] and state.text() == reference.text()
    assert "speculative" not in state.get_meta_info("job")


def test_speculative_execution_chat_model(runtime) -> None:
    backend = sgl.OpenAI(MODEL, base_url=runtime.url + "/v1")
    history = [{"role": "system", "content": "You are a helpful assistant."},
               {"role": "user", "content": "Construct a character: Name, Birthday, Job."}]
    client = openai.OpenAI(base_url=runtime.url + "/v1", api_key="EMPTY")
    spoken = client.chat.completions.create(model=MODEL, messages=history, max_tokens=32,
                                            temperature=0).choices[0].message.content
    head = spoken[:3]
    (p1, sep1), (p2, sep2) = _separators(spoken, 3, 2)

    @sgl.function(num_api_spec_tokens=32)
    def character(s):
        s += sgl.system("You are a helpful assistant.")
        s += sgl.user("Construct a character: Name, Birthday, Job.")
        s += sgl.assistant(head + sgl.gen("name", stop=sep1) + sep1 + sgl.gen("birthday", stop=sep2) + sep2)

    before = server_counts(runtime)
    backend.token_usage.reset()
    state = character.run(temperature=0, backend=backend)
    assert state.error() is None
    calls, prompt_tokens = (a - b for a, b in zip(server_counts(runtime), before))
    assert calls == 1 == backend.token_usage.requests  # three pieces of one turn, one API call
    assert prompt_tokens == backend.token_usage.prompt_tokens
    assert state["name"] == spoken[3:p1] and state["birthday"] == spoken[p1 + 2:p2]
    assert state.messages()[-1] == {"role": "assistant", "content": spoken[:p2 + 2].lstrip()}


def test_speculated_gens_keep_their_max_tokens(runtime) -> None:
    backend = sgl.OpenAI(MODEL, base_url=runtime.url + "/v1", is_chat_model=False)
    prompt = "Construct a character.\nName:"
    client = openai.OpenAI(base_url=runtime.url + "/v1", api_key="EMPTY")
    choice = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0, logprobs=0).choices[0]
    tokens = choice.logprobs.tokens
    assert "".join(tokens).startswith(choice.text)  # token texts spell the output: boundaries are known
    ends = [sum(len(t) for t in tokens[:i + 1]) for i in range(len(tokens))]
    [(p1, sep1)] = _separators(choice.text, ends[3], 1)  # a stop string the model writes after 4+ tokens

    def program(s):
        s += prompt + sgl.gen("name", stop=sep1, max_tokens=2) + sep1 + sgl.gen("job", max_tokens=4)

    spec, plain = sgl.function(num_api_spec_tokens=32)(program), sgl.function(program)
    state = spec.run(temperature=0, backend=backend)
    reference = plain.run(temperature=0, backend=backend)
    # a normal call stops after 2 tokens, before the stop string: so must the speculated gen
    assert state["name"] == reference["name"] == choice.text[:ends[1]]
    assert state.text() == reference.text()


def test_chat_speculation_falls_back_for_the_unmatched_pieces(runtime) -> None:
    backend = sgl.OpenAI(MODEL, base_url=runtime.url + "/v1")
    history = [{"role": "user", "content": "Construct a character: Name, Job."}]
    client = openai.OpenAI(base_url=runtime.url + "/v1", api_key="EMPTY")
    spoken = client.chat.completions.create(model=MODEL, messages=history, max_tokens=16,
                                            temperature=0).choices[0].message.content
    [(p1, sep1)] = _separators(spoken, 0, 1)
    odd = "\u2603 not what the model says \u2603"

    @sgl.function(num_api_spec_tokens=16)
    def character(s):
        s += sgl.user("Construct a character: Name, Job.")
        s += sgl.assistant(sgl.gen("name", stop=sep1) + odd + sgl.gen("job", stop="\n", max_tokens=4))

    state = character.run(temperature=0, backend=backend)
    assert state.error() is None
    assert backend.token_usage.requests == 2  # the speculative call, then a normal call for "job"
    assert state["name"] == spoken[:p1]
    # the normal call continues the turn: the text so far goes as a final assistant message
    partial = history + [{"role": "assistant", "content": spoken[:p1] + odd}]
    expected = client.chat.completions.create(model=MODEL, messages=partial, max_tokens=4, stop=["\n"],
                                              temperature=0).choices[0].message.content
    assert state["job"] == expected
