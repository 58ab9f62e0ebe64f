"""Malformed and hostile requests: each gets the right 4xx with an OpenAI-shaped error body, and the
server keeps answering correctly (same greedy text, no KV slot leaked) afterwards. Also the API key
(401), the bounded queue (503 + retry-after) and a clean SIGTERM, on `radixlm serve` in a subprocess."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from radixlm.testing.servers import ServerProcess
from server_harness import shared_server, wait_idle

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
GEN = "/generate"
MSG = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return {"messages": MSG, "max_tokens": 4, **fields}


def comp(**fields):
    return {"prompt": "hello", "max_tokens": 4, **fields}


# (name, method, path, body: dict -> JSON, bytes -> raw, None -> no body, expected status, expected param)
CASES = [
    ("malformed json", "POST", CHAT, b'{"messages": [', 400, None),
    ("json array body", "POST", CHAT, b"[1, 2]", 400, None),
    ("json string body", "POST", CHAT, b'"hello"', 400, None),
    ("empty body", "POST", CHAT, None, 400, None),
    ("invalid utf-8", "POST", CHAT, b'{"messages": "\xff\xfe"}', 400, None),
    ("NaN temperature", "POST", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400,
     "temperature"),
    ("deeply nested json", "POST", CHAT, b"[" * 100_000 + b"]" * 100_000, 400, None),
    ("missing messages", "POST", CHAT, {"max_tokens": 4}, 400, "messages"),
    ("empty messages", "POST", CHAT, chat(messages=[]), 400, "messages"),
    ("messages not a list", "POST", CHAT, chat(messages="hi"), 400, "messages"),
    ("unknown role", "POST", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages"),
    ("content is a number", "POST", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "messages"),
    ("image content part", "POST", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), 400, "messages"),
    ("temperature as string", "POST", CHAT, chat(temperature="hot"), 400, "temperature"),
    ("temperature too high", "POST", CHAT, chat(temperature=3), 400, "temperature"),
    ("top_p zero", "POST", CHAT, chat(top_p=0), 400, "top_p"),
    ("n zero", "POST", CHAT, chat(n=0), 400, "n"),
    ("n too large", "POST", CHAT, chat(n=1000), 400, "n"),
    ("n as bool", "POST", CHAT, chat(n=True), 400, "n"),
    ("negative max_tokens", "POST", CHAT, chat(max_tokens=-5), 400, "max_tokens"),
    ("max_completion_tokens zero", "POST", CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    ("max_tokens beyond context", "POST", CHAT, chat(max_tokens=10**6), 400, "max_tokens"),
    ("frequency penalty out of range", "POST", CHAT, chat(frequency_penalty=5), 400, "frequency_penalty"),
    ("seed as string", "POST", CHAT, chat(seed="42"), 400, "seed"),
    ("model as number", "POST", CHAT, chat(model=3), 400, "model"),
    ("stream as string", "POST", CHAT, chat(stream="yes"), 400, "stream"),
    ("stream_options without stream", "POST", CHAT, chat(stream_options={"include_usage": True}), 400,
     "stream_options"),
    ("top_logprobs without logprobs", "POST", CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    ("top_logprobs too many", "POST", CHAT, chat(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    ("logit_bias key not a token", "POST", CHAT, chat(logit_bias={"abc": 1}), 400, "logit_bias"),
    ("logit_bias token out of vocab", "POST", CHAT, chat(logit_bias={"99999999": 1}), 400, "logit_bias"),
    ("logit_bias value out of range", "POST", CHAT, chat(logit_bias={"5": 500}), 400, "logit_bias"),
    ("empty stop string", "POST", CHAT, chat(stop=[""]), 400, "stop"),
    ("negative stop token id", "POST", CHAT, chat(stop_token_ids=[-1]), 400, "stop_token_ids"),
    ("top_k zero", "POST", CHAT, chat(top_k=0), 400, "top_k"),
    ("min_p above one", "POST", CHAT, chat(min_p=2.0), 400, "min_p"),
    ("repetition_penalty zero", "POST", CHAT, chat(repetition_penalty=0), 400, "repetition_penalty"),
    ("min_tokens above max_tokens", "POST", CHAT, chat(min_tokens=10), 400, "min_new_tokens"),
    ("unknown response_format", "POST", CHAT, chat(response_format={"type": "xml"}), 400, "response_format"),
    ("json_schema format without schema", "POST", CHAT, chat(response_format={"type": "json_schema"}), 400,
     "response_format"),
    ("invalid json schema", "POST", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": 12}}}), 400, "response_format"),
    ("json_schema extra not json", "POST", CHAT, chat(json_schema="{nope"), 400, "json_schema"),
    ("invalid regex", "POST", CHAT, chat(regex="(["), 400, "regex"),
    ("unsupported schema keyword", "POST", CHAT, chat(json_schema={"type": "object", "not": {}}), 400, "json_schema"),
    ("regex and json_schema together", "POST", CHAT, chat(regex="a", json_schema={"type": "object"}), 400,
     "json_schema"),
    ("forced tool with json response_format", "POST", CHAT, chat(
        tools=[{"type": "function", "function": {"name": "a"}}], tool_choice="required",
        response_format={"type": "json_object"}), 400, "tool_choice"),
    ("generate invalid regex", "POST", GEN, {"text": "a", "sampling_params": {"regex": "a{2,1}"}}, 400, "regex"),
    ("tool_choice without tools", "POST", CHAT, chat(tool_choice="required"), 400, "tool_choice"),
    ("tool_choice names a missing tool", "POST", CHAT, chat(
        tools=[{"type": "function", "function": {"name": "a"}}],
        tool_choice={"type": "function", "function": {"name": "b"}}), 400, "tool_choice"),
    ("tool with invalid name", "POST", CHAT, chat(tools=[{"type": "function", "function": {"name": "a b!"}}]),
     400, "tools"),
    ("tool of unknown type", "POST", CHAT, chat(tools=[{"type": "retrieval"}]), 400, "tools"),
    ("continue_final_message after user", "POST", CHAT, chat(continue_final_message=True,
                                                              add_generation_prompt=False), 400,
     "continue_final_message"),
    ("chat_template_kwargs overrides tokenize", "POST", CHAT, chat(chat_template_kwargs={"tokenize": True}), 400,
     "chat_template_kwargs"),
    ("prompt longer than context", "POST", COMP, comp(prompt=[5] * 5000), 400, "prompt"),
    ("empty prompt list", "POST", COMP, comp(prompt=[]), 400, "prompt"),
    ("empty token list in batch", "POST", COMP, comp(prompt=[[]]), 400, "prompt"),
    ("token id out of vocab", "POST", COMP, comp(prompt=[10**9]), 400, "prompt"),
    ("negative token id", "POST", COMP, comp(prompt=[-3, 4]), 400, "prompt"),
    ("mixed prompt list", "POST", COMP, comp(prompt=["a", 1]), 400, "prompt"),
    ("completions logprobs too many", "POST", COMP, comp(logprobs=50), 400, "logprobs"),
    ("max_tokens zero without echo", "POST", COMP, comp(max_tokens=0), 400, "max_tokens"),
    ("suffix", "POST", COMP, comp(suffix="end"), 400, "suffix"),
    ("best_of differs from n", "POST", COMP, comp(best_of=3), 400, "best_of"),
    ("missing prompt", "POST", COMP, {"max_tokens": 3}, 400, "prompt"),
    ("generate with text and input_ids", "POST", GEN, {"text": "a", "input_ids": [1]}, 400, "text"),
    ("generate with neither", "POST", GEN, {"sampling_params": {}}, 400, "text"),
    ("generate unknown sampling param", "POST", GEN, {"text": "a", "sampling_params": {"temprature": 1}}, 400,
     "temprature"),
    ("generate sampling_params count mismatch", "POST", GEN, {"text": ["a", "b"], "sampling_params": [{}]}, 400,
     "sampling_params"),
    ("generate top_logprobs_num too many", "POST", GEN, {"text": "a", "top_logprobs_num": 99}, 400,
     "top_logprobs_num"),
    ("generate negative max_new_tokens", "POST", GEN, {"text": "a", "sampling_params": {"max_new_tokens": -1}},
     400, "max_new_tokens"),
    ("generate input_ids of strings", "POST", GEN, {"input_ids": ["a"]}, 400, "input_ids"),
    ("generate stream n mismatch rid", "POST", GEN, {"text": ["a", "b"], "rid": ["x"], "stream": True}, 400, "rid"),
    ("abort without rid", "POST", "/abort_request", {}, 400, "rid"),
    ("unknown route", "GET", "/v2/everything", None, 404, None),
    ("unknown model route", "GET", "/v1/models/nope", None, 404, "model"),
    ("wrong method", "GET", CHAT, None, 405, None),
    ("body too large", "POST", CHAT, b"x" * (33 * 1024 * 1024), 413, None),
]


@pytest.fixture(scope="module")
def live(llama_ckpt):
    return shared_server(llama_ckpt)


def greedy_answer(client):
    r = client.post(CHAT, json=chat(temperature=0, max_tokens=8, ignore_eos=True))
    assert r.status_code == 200
    return r.json()["choices"][0]["message"]["content"]


def assert_openai_error(r, status, param=None):
    assert r.status_code == status, r.text[:300]
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param is not None:
        assert err["param"] == param, err


def test_enough_kinds():
    assert len({name for name, *_ in CASES}) == len(CASES) >= 40


def test_hostile_requests_then_still_serving(live):
    with live.client() as client:
        before = greedy_answer(client)
        failures = []
        for name, method, path, body, status, param in CASES:
            kwargs = {"json": body} if isinstance(body, dict) else {"content": body} if body is not None else {}
            r = client.request(method, path, **kwargs)
            try:
                assert_openai_error(r, status, param)
            except AssertionError as exc:
                failures.append(f"{name}: {exc}")
        assert not failures, "\n".join(failures)
        assert greedy_answer(client) == before
        wait_idle(live)
        assert client.post("/flush_cache").status_code == 200
        stats = live.engine.get_stats()
        assert stats["kv_slots_free"] == stats["kv_slots_total"]


def test_stream_error_is_an_http_error_not_a_broken_stream(live):
    with live.client() as client:
        r = client.post(CHAT, json=chat(stream=True, temperature=-1))
        assert_openai_error(r, 400, "temperature")
        assert r.headers["content-type"].startswith("application/json")


@pytest.fixture(scope="module")
def proc(llama_ckpt):
    # max_queued_requests 0 and one running request: a second concurrent request overflows the queue.
    p = ServerProcess("--model-path", llama_ckpt, "--api-key", "sekret", "--max-queued-requests", "0",
                      "--max-running-requests", "1", "--drain-timeout", "1")
    yield p
    p.kill()


def test_cli_api_key(proc):
    with httpx.Client(base_url=proc.url, timeout=60) as c:
        assert_openai_error(c.get("/v1/models"), 401)
        assert_openai_error(c.post(CHAT, json=chat(), headers={"Authorization": "Bearer wrong"}), 401)
        assert_openai_error(c.post(GEN, json={"text": "a"}, headers={"Authorization": "sekret"}), 401)
        assert c.get("/health").status_code == 200  # probes need no key
        ok = c.post(CHAT, json=chat(), headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 4


def _hold_stream(url: str, started: threading.Event, lines: list[str]) -> None:
    body = {"text": "hold", "stream": True, "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
    with httpx.Client(timeout=60) as c, c.stream("POST", url + GEN, json=body,
                                                 headers={"Authorization": "Bearer sekret"}) as r:
        for line in r.iter_lines():
            if line:
                lines.append(line)
                started.set()


def test_cli_queue_full_then_sigterm_shuts_down_cleanly(proc):
    started, lines = threading.Event(), []
    holder = threading.Thread(target=_hold_stream, args=(proc.url, started, lines), daemon=True)
    holder.start()
    assert started.wait(60)
    with httpx.Client(base_url=proc.url, timeout=60, headers={"Authorization": "Bearer sekret"}) as c:
        r = c.post(CHAT, json=chat())
        assert_openai_error(r, 503)
        assert r.headers["retry-after"] == "1"
        r = c.post(CHAT, json=chat(stream=True))
        assert_openai_error(r, 503)
    t0 = time.monotonic()
    assert proc.signal(signal.SIGTERM) == 0
    assert time.monotonic() - t0 < 30
    holder.join(10)
    assert not holder.is_alive()
    last = json.loads(lines[-2].removeprefix("data: "))  # the stream's end, naming the cause
    assert last["error"]["code"] == "shutdown" and lines[-1] == "data: [DONE]"
    log = "".join(proc.log)
    assert "listening on http://127.0.0.1:" in log and "radixlm server stopped" in log
    assert "Traceback" not in log
