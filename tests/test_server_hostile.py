"""The hostile-input suite (issue 16), bounded to run in well under a minute on loopback: schemathesis over
/openapi.json, a hypothesis fuzzer of /generate's sampling_params, and a disconnect storm. Each asserts no
5xx, that a bystander request running throughout gets exactly its clean greedy output, and that afterwards
every KV slot is free or cached (free + cached = total, and all free after a flush)."""

from __future__ import annotations

import asyncio
import json
import math
import threading

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import radixlm
from radixlm.server.openapi import openapi_document
from server_harness import LiveServer, wait_idle

POOL = 64  # a small KV pool keeps every generation the fuzzers ask for short
BYSTANDER = {"text": "The bystander asks about the lighthouse", "sampling_params": {
    "max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}


@pytest.fixture(scope="module")
def live(llama_ckpt):
    # A fan-out cap of 4 (prompts x n) keeps each call the fuzzers make small.
    server = LiveServer(radixlm.Engine(llama_ckpt, max_total_tokens=POOL, max_running_requests=16,
                                       max_requests_per_call=4))
    yield server
    server.stop()
    server.engine.shutdown()


class Bystander:
    """Sends BYSTANDER over and over while the suite runs; each answer must be the clean one (or, when
    the suite itself called /abort_request with abort_all, a 200 with finish reason abort)."""

    def __init__(self, live: LiveServer) -> None:
        self.live = live
        self.expected = live.engine.generate(BYSTANDER["text"], BYSTANDER["sampling_params"])["output_ids"]
        self.answers: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.live.url, timeout=120) as c:
            while True:  # at least once, however short the test
                if self.answers and self._stop.is_set():
                    return
                resp = c.post("/generate", json=BYSTANDER)
                out = resp.json() if resp.status_code == 200 else {"meta_info": {"finish_reason": {}}}
                if out["meta_info"]["finish_reason"].get("type") != "abort":
                    self.answers.append(out.get("output_ids", resp.text))

    def __enter__(self) -> "Bystander":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(120)
        wrong = [a for a in self.answers if a != self.expected]
        assert self.answers and not wrong, (self.expected, wrong)


def assert_no_leak(live: LiveServer) -> None:
    stats = wait_idle(live, timeout=60)
    assert stats["kv_slots_free"] + stats["kv_slots_cached"] == stats["kv_slots_total"]
    assert live.engine.flush_cache()
    stats = live.engine.get_stats()
    assert stats["kv_slots_free"] == stats["kv_slots_total"]
    live.engine.check_invariants()


# ---- schemathesis over the OpenAPI document -----------------------------------------------------

SCHEMA = schemathesis.openapi.from_dict(openapi_document())


@pytest.fixture
def bystander_for_schema(live):
    with Bystander(live) as b:
        yield b
    assert_no_leak(live)


@SCHEMA.parametrize()
@settings(max_examples=3, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_openapi_operations_never_5xx(case, live, bystander_for_schema):
    response = case.call(base_url=live.url, timeout=60)
    assert response.status_code < 500, f"{case.method} {case.path} {json.dumps(case.body)} -> {response.text[:300]}"


# ---- hypothesis over /generate's sampling_params ---------------------------------------------------

NUMBERS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(2**70), 2**70),
                    st.sampled_from([0, 1, -1, 0.5, 2, 1e300]))
VALUES = st.one_of(NUMBERS, st.booleans(), st.none(), st.text(max_size=8), st.lists(st.integers(-5, 2**64), max_size=3))
PARAMS = st.fixed_dictionaries({}, optional={
    "max_new_tokens": st.one_of(st.integers(-3, 200), VALUES),
    "min_new_tokens": st.one_of(st.integers(-3, 20), VALUES),
    "temperature": NUMBERS, "top_p": NUMBERS, "top_k": st.one_of(st.integers(-3, 5000), VALUES),
    "min_p": NUMBERS, "frequency_penalty": NUMBERS, "presence_penalty": NUMBERS, "repetition_penalty": NUMBERS,
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3), VALUES),
    "stop_token_ids": st.one_of(st.lists(st.integers(-3, 2**64), max_size=3), VALUES),
    "ignore_eos": st.one_of(st.booleans(), VALUES), "n": st.one_of(st.integers(-1, 4), VALUES),
    "seed": st.one_of(st.integers(-(2**64), 2**64), VALUES),
    "logit_bias": st.one_of(st.dictionaries(st.one_of(st.integers(-5, 2**64).map(str), st.text(max_size=4)),
                                            NUMBERS, max_size=3), VALUES),
    "regex": st.one_of(st.sampled_from(["[a-z]{1,8}", "(a|b)+", "((", ".{0,3}x", "\\"]), VALUES),
    "choices": st.one_of(st.lists(st.text(max_size=4), max_size=3), VALUES),
    "json_schema": st.one_of(st.sampled_from(['{"type": "integer"}', "{", '{"type": 5}']), VALUES),
}) | st.dictionaries(st.text(max_size=6), VALUES, max_size=2)


@pytest.fixture
def fuzz_client(live):
    with httpx.Client(base_url=live.url, timeout=60) as c, Bystander(live):
        yield c
    assert_no_leak(live)


@given(params=PARAMS, stream=st.booleans())
@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_generate_sampling_params_fuzz(fuzz_client, params, stream):
    body = json.dumps({"text": "fuzz", "sampling_params": params, "stream": stream})  # NaN/Infinity as JSON5 does
    resp = fuzz_client.post("/generate", content=body, headers={"content-type": "application/json"})
    assert resp.status_code in (200, 400), resp.text
    if resp.status_code == 400:
        err = resp.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"]
        return
    events = [json.loads(line[5:]) for line in resp.text.splitlines()
              if line.startswith("data:") and line != "data: [DONE]"] if stream else [resp.json()]
    last = events[-1]
    outs = last if isinstance(last, list) else [last]
    for out in outs:
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] in ("length", "stop"), out["meta_info"]
        assert all(isinstance(t, int) and 0 <= t < fuzz_client_vocab(fuzz_client) for t in out["output_ids"])


def fuzz_client_vocab(client: httpx.Client) -> int:
    return client.get("/get_model_info").json()["vocab_size"]


# ---- disconnect storm -----------------------------------------------------------------------------


def test_disconnect_storm(live):
    before = wait_idle(live)
    storm = 120

    async def leave_after_first_chunk(client: httpx.AsyncClient, i: int) -> None:
        body = {"text": f"storm {i}", "stream": True, "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}
        async with client.stream("POST", "/generate", json=body) as resp:
            assert resp.status_code in (200, 503)  # 503: the bounded queue said "retry later"
            async for line in resp.aiter_lines():
                if line.startswith("data:"):
                    break

    async def run() -> None:
        limits = httpx.Limits(max_connections=storm + 5)
        async with httpx.AsyncClient(base_url=live.url, timeout=60, limits=limits) as client:
            await asyncio.gather(*(leave_after_first_chunk(client, i) for i in range(storm)))

    with Bystander(live):
        asyncio.run(run())
    assert_no_leak(live)
    after = live.engine.get_stats()
    assert after["aborted_total"] - before["aborted_total"] >= storm * 0.9
    assert not math.isnan(after["cache_hit_rate"])
