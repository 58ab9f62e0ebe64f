"""SGLang-native endpoints against the real server: /generate (single, batch, input_ids, logprobs, stream),
service endpoints and /openapi.json (/metrics: test_server_metrics.py; the command line: test_cli.py)."""

from __future__ import annotations

import json
import threading

import pytest

from server_harness import shared_server, wait_idle


@pytest.fixture(scope="module")
def live(llama_ckpt):
    return shared_server(llama_ckpt)


@pytest.fixture(scope="module")
def client(live):
    with live.client() as c:
        yield c


GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


def events(response):
    """The JSON payloads of an SSE response, and whether it ended with [DONE]."""
    payloads = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    done = bool(payloads) and payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads if p != "[DONE]"], done


def test_generate_single_and_batch_match_engine(client, live):
    expected = live.engine.generate(["The fox", "A cache"], GREEDY)
    single = client.post("/generate", json={"text": "The fox", "sampling_params": GREEDY}).json()
    assert single["text"] == expected[0]["text"] and single["output_ids"] == expected[0]["output_ids"]
    meta = single["meta_info"]
    assert meta["completion_tokens"] == 6 and meta["finish_reason"]["type"] == "length"
    assert meta["prompt_tokens"] == len(live.engine.tokenizer("The fox")["input_ids"])
    batch = client.post("/generate", json={"text": ["The fox", "A cache"], "sampling_params": GREEDY}).json()
    assert [b["text"] for b in batch] == [e["text"] for e in expected]
    ids = [live.engine.tokenizer(t)["input_ids"] for t in ("The fox", "A cache")]
    by_ids = client.post("/generate", json={"input_ids": ids,
                                            "sampling_params": [GREEDY, {**GREEDY, "max_new_tokens": 3}]}).json()
    assert by_ids[0]["text"] == expected[0]["text"]
    assert by_ids[1]["output_ids"] == expected[1]["output_ids"][:3]
    one = client.post("/generate", json={"input_ids": ids[0], "sampling_params": GREEDY}).json()
    assert one["output_ids"] == expected[0]["output_ids"]


def test_generate_n_samples(client):
    out = client.post("/generate", json={"text": "The fox", "sampling_params": {
        "max_new_tokens": 5, "n": 3, "temperature": 1.0, "seed": 11, "ignore_eos": True}}).json()
    assert isinstance(out, list) and len(out) == 3 and all(o["meta_info"]["completion_tokens"] == 5 for o in out)


def test_generate_logprobs(client, live):
    text = "The quick brown fox"
    n_prompt = len(live.engine.tokenizer(text)["input_ids"])
    out = client.post("/generate", json={"text": text, "sampling_params": GREEDY, "return_logprob": True,
                                         "logprob_start_len": 0, "top_logprobs_num": 2,
                                         "return_text_in_logprobs": True}).json()
    meta = out["meta_info"]
    assert len(meta["input_token_logprobs"]) == n_prompt and meta["input_token_logprobs"][0][0] is None
    assert len(meta["output_token_logprobs"]) == 6
    assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
    assert "".join(e[2] for e in meta["output_token_logprobs"]) == out["text"]
    for (lp, _, _), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
        assert len(top) == 2 and lp == pytest.approx(top[0][0], abs=1e-5)  # greedy = top-1


def test_generate_stream_is_cumulative(client, live):
    full = live.engine.generate("The fox", {**GREEDY, "max_new_tokens": 8})
    with client.stream("POST", "/generate", json={"text": "The fox", "stream": True, "return_logprob": True,
                                                  "sampling_params": {**GREEDY, "max_new_tokens": 8}}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        chunks, done = events(r)
    assert done and len(chunks) > 1
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert texts[-1] == full["text"] and chunks[-1]["output_ids"] == full["output_ids"]
    assert len(chunks[-1]["meta_info"]["output_token_logprobs"]) == 8
    assert [c["meta_info"]["finish_reason"] is None for c in chunks] == [True] * (len(chunks) - 1) + [False]
    assert "index" not in chunks[0]


def test_generate_batch_stream_indices(client, live):
    expected = live.engine.generate(["a b", "c d"], GREEDY)
    with client.stream("POST", "/generate", json={"text": ["a b", "c d"], "stream": True,
                                                  "sampling_params": GREEDY}) as r:
        chunks, done = events(r)
    assert done
    last = {c["index"]: c["text"] for c in chunks}
    assert last == {0: expected[0]["text"], 1: expected[1]["text"]}


def test_abort_request_by_rid(client, live):
    lines: list[str] = []
    started = threading.Event()

    def hold():
        with live.client() as c, c.stream("POST", "/generate", json={
                "text": "long", "rid": "to-abort", "stream": True,
                "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    started.set()

    t = threading.Thread(target=hold, daemon=True)
    t.start()
    assert started.wait(60)
    assert client.post("/abort_request", json={"rid": "to-abort"}).status_code == 200
    t.join(30)
    assert not t.is_alive() and lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2].removeprefix("data: "))
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert last["meta_info"]["completion_tokens"] < 1500


def test_service_endpoints(client, live):
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200
    info = client.get("/get_model_info").json()
    assert info["model_path"] == live.engine.model_path and info["is_generation"] is True
    assert info["context_len"] == live.engine.context_len
    wait_idle(live)
    assert client.post("/flush_cache").status_code == 200
    server = client.get("/get_server_info").json()
    state = server["internal_states"][0]
    assert state["kv_slots_free"] == state["kv_slots_total"] == live.engine.kv_pool_size
    assert server["schedule_policy"] == live.engine.options.schedule_policy
    assert server["port"] == int(live.url.rsplit(":", 1)[1])


def test_openapi_lists_every_route(client, live):
    spec = client.get("/openapi.json").json()
    assert spec["openapi"].startswith("3.")
    routes = {r.path.replace("{model:path}", "{model}") for r in live.app.routes}
    assert set(spec["paths"]) == routes
    chat = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert "messages" in spec["components"]["schemas"][chat["$ref"].rsplit("/", 1)[1]]["properties"]
