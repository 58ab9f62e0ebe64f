"""Faults on a real server on loopback (issue 37): an abort touches only its own request, deadlines end
a request on time, and each ends with its cause named; KV accounting after each (free + cached = total).

The oracle for "nobody else was harmed" is the engine's own clean greedy output of the same prompt."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

import radixlm
from server_harness import LiveServer, wait_idle

POOL = 2000  # the pool of the schemathesis run that found the fan-out case
BYSTANDER = {"text": "The bystander asks about the lighthouse",
             "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}}


@pytest.fixture(scope="module")
def live(llama_ckpt):
    server = LiveServer(radixlm.Engine(llama_ckpt, max_total_tokens=POOL))
    yield server
    server.stop()
    server.engine.shutdown()


def assert_kv_accounted(live: LiveServer) -> dict:
    stats = wait_idle(live, timeout=60)
    assert stats["kv_slots_free"] + stats["kv_slots_cached"] == stats["kv_slots_total"], stats
    live.engine.check_invariants()
    return stats


class Bystanders:
    """`count` clients sending BYSTANDER over and over on their own connections until stopped; every
    answer is kept (status, body)."""

    def __init__(self, live: LiveServer, count: int = 3) -> None:
        self.live = live
        self.answers: list[tuple[int, dict]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(count)]

    def _run(self) -> None:
        with self.live.client() as c:
            while not self._stop.is_set():
                resp = c.post("/generate", json=BYSTANDER)
                self.answers.append((resp.status_code, resp.json()))

    def __enter__(self) -> "Bystanders":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)


def test_fan_out_disconnect_touches_no_other_request(live):
    """The schemathesis finding: an `n: 127` chat request whose client gives up and disconnects, beside
    other clients' requests. Only its own 127 branches are aborted; every other answer is the clean one."""
    expected = live.engine.generate(BYSTANDER["text"], BYSTANDER["sampling_params"])["output_ids"]
    before = live.engine.get_stats()["aborted_total"]
    body = {"messages": [{"role": "user", "content": "Tell me a long story"}], "n": 127, "max_tokens": 200,
            "temperature": 1.0}
    with Bystanders(live) as bystanders:
        time.sleep(0.3)
        for _ in range(2):
            with pytest.raises(httpx.TimeoutException), httpx.Client(base_url=live.url, timeout=0.5) as c:
                c.post("/v1/chat/completions", json=body)
            time.sleep(0.6)  # the issue saw the harm 0.4 s after the disconnect
    stats = assert_kv_accounted(live)
    assert stats["aborted_total"] - before >= 127  # the fan-out's own branches, aborted
    wrong = [(status, out) for status, out in bystanders.answers
             if status != 200 or out["output_ids"] != expected]
    assert len(bystanders.answers) >= 3 and not wrong, wrong[:3]


def test_abort_all_answers_finish_reason_abort_not_503(live):
    """/abort_request with abort_all ends every request in flight as an abort (SGLang's behaviour): 200
    with finish_reason "abort" on /generate and the OpenAI routes, never a 5xx blaming no one."""
    slow = {"text": "slow", "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1500, "ignore_eos": True}
    results: dict[str, httpx.Response] = {}

    def call(name: str, path: str, body: dict) -> None:
        with live.client() as c:
            results[name] = c.post(path, json=body)

    threads = [threading.Thread(target=call, args=("generate", "/generate", slow)),
               threading.Thread(target=call, args=("chat", "/v1/chat/completions", chat))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while live.engine.stats_snapshot()["running"] < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    with live.client() as c:
        assert c.post("/abort_request", json={"abort_all": True}).status_code == 200
    for t in threads:
        t.join(60)
    gen, chat_resp = results["generate"], results["chat"]
    assert gen.status_code == 200 and gen.json()["meta_info"]["finish_reason"]["type"] == "abort", gen.text
    assert chat_resp.status_code == 200, chat_resp.text
    assert chat_resp.json()["choices"][0]["finish_reason"] == "abort"
    assert_kv_accounted(live)


# ---- deadlines ------------------------------------------------------------------------------------

LONG = {"max_new_tokens": 1800, "ignore_eos": True, "temperature": 0}


def test_engine_timeout_ends_request_and_frees_kv(live):
    """Engine.generate(timeout=...): the request ends within 1 s of its limit, finish reason abort with
    status 408 and the cause; its KV comes back."""
    engine = live.engine
    t0 = time.monotonic()
    out = engine.generate("a long one", LONG, timeout=0.4)
    took = time.monotonic() - t0
    meta = out["meta_info"]
    assert 0.4 <= took < 1.4, took
    assert meta["finish_reason"]["type"] == "abort" and meta["finish_reason"]["status_code"] == 408, meta
    assert "time limit" in meta["error"] and 0 < meta["completion_tokens"] < LONG["max_new_tokens"]
    with pytest.raises(ValueError, match="timeout"):
        engine.generate("x", {"max_new_tokens": 1}, timeout=0)
    with pytest.raises(ValueError, match="timeout"):
        engine.generate("x", {"max_new_tokens": 1}, timeout=float("inf"))
    assert_kv_accounted(live)


def _sse_events(resp: httpx.Response) -> list:
    return [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]


def test_http_timeouts_under_load(live):
    """Deadlines under load (8 requests at once, native and OpenAI, streaming and not): each ends within
    1 s of its limit: a non-streaming call gets 408 code timeout, a stream one error event with that code
    at its end; a request within its limit is untouched; no KV slot leaks."""
    expected = live.engine.generate(BYSTANDER["text"], BYSTANDER["sampling_params"])["output_ids"]
    calls = {
        "native": ("/generate", {"text": "native", "sampling_params": LONG, "timeout": 0.5}),
        "native_stream": ("/generate", {"text": "stream", "sampling_params": LONG, "stream": True, "timeout": 0.5}),
        "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1800,
                                          "ignore_eos": True, "timeout": 0.7}),
        "chat_stream": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1800,
                                                 "ignore_eos": True, "stream": True, "timeout": 0.7}),
        "completion": ("/v1/completions", {"prompt": "once", "max_tokens": 1800, "ignore_eos": True, "timeout": 0.6}),
        "bystander": ("/generate", {**BYSTANDER, "timeout": 60}),
    }
    results: dict[str, tuple[httpx.Response, float]] = {}

    go = threading.Barrier(len(calls))

    def call(name: str) -> None:
        path, body = calls[name]
        with live.client() as c:
            c.get("/health")  # the connection is open before the clock starts
            go.wait()
            t0 = time.monotonic()
            resp = c.post(path, json=body)
        results[name] = (resp, time.monotonic() - t0)

    threads = [threading.Thread(target=call, args=(n,)) for n in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    # (Measured by the client, whose clock starts before the server's; the server runs in this test's
    # process, and shares its garbage collector's pauses.)
    for name in ("native", "chat", "completion"):
        resp, took = results[name]
        assert resp.status_code == 408 and resp.json()["error"]["code"] == "timeout", (name, resp.text[:200])
        assert took < calls[name][1]["timeout"] + 1.0, (name, took)
    for name in ("native_stream", "chat_stream"):
        resp, took = results[name]
        events = _sse_events(resp)
        assert resp.status_code == 200 and events[-1] == "[DONE]", (name, events[-3:])
        errors = [json.loads(e)["error"] for e in events[:-1] if "error" in json.loads(e)]
        assert [e["code"] for e in errors] == ["timeout"] and took < calls[name][1]["timeout"] + 1.0, (name, took)
    resp, _ = results["bystander"]
    assert resp.status_code == 200 and resp.json()["output_ids"] == expected
    assert_kv_accounted(live)


def test_request_timeout_option(llama_ckpt):
    """The engine's default (request_timeout, `--request-timeout`) applies to requests without their
    own; a request's own timeout wins."""
    with radixlm.Engine(llama_ckpt, max_total_tokens=POOL, request_timeout=0.4) as engine:
        t0 = time.monotonic()
        out = engine.generate("default limit", LONG)
        assert out["meta_info"]["finish_reason"]["status_code"] == 408 and time.monotonic() - t0 < 1.4
        out = engine.generate("own limit", {"max_new_tokens": 8}, timeout=30)
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        stats = engine.get_stats()
        assert stats["kv_slots_free"] + stats["kv_slots_cached"] == stats["kv_slots_total"]
    with pytest.raises(ValueError, match="request_timeout"):
        radixlm.Engine(llama_ckpt, request_timeout=-1)


def test_limit_counts_from_the_arrival_at_the_server():
    """A request's limit counts from its arrival (AdmissionMiddleware's stamp), not from the engine call
    that a busy event loop reaches later; with none of it left the engine gets a limit that ends it at once."""
    from types import SimpleNamespace

    from radixlm.server.generation import EngineClient

    client = EngineClient(SimpleNamespace(options=SimpleNamespace(request_timeout=5.0)), metrics=None)
    arrived = SimpleNamespace(scope={"state": {"arrival": time.time() - 0.3}})
    assert 0.6 < client.time_left(arrived, 1.0) <= 0.7
    assert 4.6 < client.time_left(arrived, None) <= 4.7  # the server's default limit
    assert client.time_left(arrived, 0.1) == pytest.approx(1e-3)
    assert client.time_left(SimpleNamespace(scope={}), 1.0) == 1.0  # not a counted request: from the call
    client.engine.options.request_timeout = None
    assert client.time_left(arrived, None) is None
