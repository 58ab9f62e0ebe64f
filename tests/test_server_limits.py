"""The server's limits and failure behaviour (issue 16, docs/server.md "Limits and failure behaviour"):
one validator for /generate and the OpenAI endpoints, raw-size and recursion checks, the fan-out cap,
the effective context in /v1/models, an event loop that keeps answering while a constraint compiles,
/health turning 503 when the scheduler loop is stuck, and metrics read without waiting for it."""

from __future__ import annotations

import json
import threading
import time
import uuid

import httpx
import pytest

import radixlm
from server_harness import LiveServer, wait_idle

POOL = 256  # KV slots: the effective context, below the tiny model's 2048


@pytest.fixture(scope="module")
def live(llama_ckpt):
    server = LiveServer(radixlm.Engine(llama_ckpt, max_total_tokens=POOL, stall_timeout=1.0, prepare_timeout=10.0))
    yield server
    server.stop()
    server.engine.shutdown()


def _error(resp: httpx.Response, status: int = 400) -> dict:
    assert resp.status_code == status, resp.text
    return resp.json()["error"]


def test_effective_context_in_models_and_admission(live):
    with live.client() as c:
        card = c.get("/v1/models").json()["data"][0]
        assert card["max_model_len"] == POOL
        assert c.get("/get_model_info").json()["context_len"] == POOL
        # A chat without max_tokens gets the room the pool has, and finishes (was a 500 after the work).
        reply = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                      "ignore_eos": True, "temperature": 0})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["finish_reason"] == "length"
        usage = reply.json()["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == POOL
        err = _error(c.post("/generate", json={"input_ids": list(range(1, 201)),
                                               "sampling_params": {"max_new_tokens": 100}}))
        assert err["param"] == "max_new_tokens"


@pytest.mark.parametrize("raw, param", [
    (b'{"text": "x", "sampling_params": {"temperature": Infinity}}', "temperature"),
    (b'{"text": "x", "sampling_params": {"temperature": 1e999}}', "temperature"),
    (b'{"text": "x", "sampling_params": {"top_p": NaN}}', "top_p"),
    (b'{"text": "x", "sampling_params": {"logit_bias": {"-5": 1}}}', "logit_bias"),
    (b'{"text": "x", "sampling_params": {"logit_bias": {"9223372036854775808": 1}}}', "logit_bias"),
    (b'{"text": "x", "sampling_params": {"logit_bias": {"5": 1e999}}}', "logit_bias"),
    (b'{"text": "x", "sampling_params": {"max_new_tokens": 100000}}', "max_new_tokens"),
    (b'{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"-5": 1}}', "logit_bias"),
    (b'{"prompt": "x", "logit_bias": {"9223372036854775808": 1}}', "logit_bias"),
])
def test_one_validator_everywhere(live, raw, param):
    path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions" if b"prompt" in raw else "/generate"
    with live.client() as c:
        err = _error(c.post(path, content=raw, headers={"content-type": "application/json"}))
    assert err["param"] == param
    assert "Traceback" not in err["message"] and "Error:" not in err["message"]


def test_duplicate_rid_is_refused_and_the_owner_finishes(live):
    body = {"text": "first", "rid": "dup-rid", "stream": True,
            "sampling_params": {"max_new_tokens": 60, "ignore_eos": True, "temperature": 0}}
    with live.client() as c, c.stream("POST", "/generate", json=body) as stream:
        events = stream.iter_lines()
        first = next(e for e in events if e.startswith("data:"))
        err = _error(c.post("/generate", json={"text": "intruder", "rid": "dup-rid"}))
        assert err["param"] == "rid"
        last = json.loads(first[5:])
        for line in events:
            if line.startswith("data:") and line != "data: [DONE]":
                last = json.loads(line[5:])
    assert last["meta_info"]["finish_reason"]["type"] == "length" and len(last["output_ids"]) == 60


def test_raw_size_recursion_and_fan_out_are_400s(live):
    deep_args = "[" * 5000 + "]" * 5000
    deep_schema = '{"type": "object", "properties": {"a": ' * 1200 + '{"type": "string"}' + "}}" * 1200
    with live.client() as c:
        err = _error(c.post("/generate", json={"text": "x" * (live.engine.max_prompt_bytes + 1)}))
        assert err["param"] == "prompt" and "bytes" in err["message"]
        err = _error(c.post("/v1/completions", json={"prompt": "x" * (live.engine.max_prompt_bytes + 1)}))
        assert err["param"] == "prompt"
        err = _error(c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x" * (live.engine.max_prompt_bytes + 1)}]}))
        assert err["param"] == "messages"
        err = _error(c.post("/generate", json={"text": "x", "sampling_params": {"regex": "(" * 3000 + ")" * 3000}}))
        assert err["param"] == "regex"
        err = _error(c.post("/generate", json={"text": "x", "sampling_params": {"json_schema": deep_schema}}))
        assert err["param"] == "json_schema"
        err = _error(c.post("/v1/chat/completions", json={"max_tokens": 2, "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                  "function": {"name": "f", "arguments": deep_args}}]},
            {"role": "user", "content": "y"}]}))
        assert err["param"] == "messages"
        err = _error(c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                          "json_schema": deep_schema}))
        assert err["param"] == "json_schema"
        many = {"text": ["a"] * 9, "sampling_params": {"n": 128, "max_new_tokens": 1}}
        assert "max_requests_per_call" in _error(c.post("/generate", json=many))["message"]
        assert "max_requests_per_call" in _error(c.post("/generate", json={**many, "stream": True}))["message"]
        assert "max_requests_per_call" in _error(c.post("/v1/completions", json={
            "prompt": ["a"] * 9, "n": 128, "max_tokens": 1}))["message"]
    assert wait_idle(live)["in_flight"] == 0


def test_health_answers_while_a_constraint_compiles(live):
    pattern = f".{{0,300}}{uuid.uuid4().hex[:6]}"  # about a second to compile; new to every cache
    result: dict = {}

    def compile_it() -> None:
        with live.client() as c:
            result["resp"] = c.post("/generate", json={"text": "x", "sampling_params": {
                "regex": pattern, "max_new_tokens": 1}})

    worker = threading.Thread(target=compile_it)
    latencies = []
    with live.client() as c:
        c.get("/health")  # connection open before timing
        worker.start()
        while worker.is_alive():
            start = time.monotonic()
            assert c.get("/health").status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.02)
    worker.join()
    # A loaded machine may reach the compile budget (2 s): then the compile ran that long, and its
    # answer is the budget's 400, which is as good for what this test measures.
    resp = result["resp"]
    assert resp.status_code == 200 or "max_compile_seconds" in resp.json()["error"]["message"], resp.text
    assert len(latencies) >= 10  # the compile really was in progress meanwhile
    # (On the event loop, as before, one /health call waited for the whole compile.) The compile thread
    # shares the GIL, and CI's 2 cores are shared: the 90th percentile is held to 100 ms, the slowest to 1 s.
    latencies.sort()
    p90 = latencies[int(len(latencies) * 0.9)]
    assert p90 < 0.1 and latencies[-1] < 1.0, f"/health during a compile: p90 {p90 * 1000:.0f} ms, max {latencies[-1] * 1000:.0f} ms"


def test_stuck_loop_makes_health_503_and_metrics_still_answer(live):
    runner = live.engine._runner
    release, entered = threading.Event(), threading.Event()
    real_forward = runner.forward

    def stuck_forward(batch):
        entered.set()
        release.wait(30)
        return real_forward(batch)

    runner.forward = stuck_forward
    try:
        with live.client() as c, httpx.Client(base_url=live.url, timeout=3) as quick:
            job = threading.Thread(target=lambda: c.post("/generate", json={
                "text": "stuck", "sampling_params": {"max_new_tokens": 2}}))
            job.start()
            assert entered.wait(30)
            time.sleep(live.engine.options.stall_timeout + 0.5)
            health = quick.get("/health")
            assert health.status_code == 503 and health.json()["error"]["code"] == "engine_stalled"
            # Neither waits for the stuck loop (they used to block until it came back).
            assert quick.get("/metrics").status_code == 200
            assert quick.get("/get_server_info").json()["internal_states"][0]["running"] >= 0
            release.set()
            job.join(30)
    finally:
        runner.forward = real_forward
        release.set()
    wait_idle(live)
    with httpx.Client(base_url=live.url, timeout=10) as c:
        assert c.get("/health").status_code == 200


def _metric(text: str, name: str) -> float:
    line = next(ln for ln in text.splitlines() if ln.startswith(name + "{"))
    return float(line.split()[-1])


def test_metrics_count_disconnects_and_retractions(live):
    with live.client() as c:
        before = c.get("/metrics").text
        with c.stream("POST", "/generate", json={"text": "leave", "stream": True, "sampling_params": {
                "max_new_tokens": 200, "ignore_eos": True}}) as stream:
            next(line for line in stream.iter_lines() if line.startswith("data:"))
        wait_idle(live)
        after = c.get("/metrics").text
    aborted = "radixlm:num_aborted_requests_total"
    assert _metric(after, aborted) == _metric(before, aborted) + 1  # the disconnect, counted by the engine
    assert _metric(after, "radixlm:num_retracted_requests_total") == live.engine.get_stats()["retractions_total"]
