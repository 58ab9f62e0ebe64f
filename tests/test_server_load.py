"""Load: 200 concurrent streaming chat requests complete with correct usage, while 50 more disconnect
mid-stream; afterwards nothing runs, the 50 were aborted, and after a flush every KV slot is free."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from server_harness import render_chat, shared_server, wait_idle

COMPLETE, DISCONNECT = 200, 50


@pytest.fixture(scope="module")
def live(llama_ckpt):
    return shared_server(llama_ckpt)


def messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Request number {i}: say something."}]


async def complete_one(client: httpx.AsyncClient, i: int) -> dict:
    body = {"messages": messages(i), "max_tokens": 3 + i % 6, "temperature": 0.8, "seed": i, "stream": True,
            "logprobs": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    tokens, usage, finish, done = 0, None, None, False
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line:
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                done = True
                continue
            chunk = json.loads(data)
            if chunk["usage"] is not None:
                usage = chunk["usage"]
            for c in chunk["choices"]:
                tokens += len((c["logprobs"] or {}).get("content") or [])
                finish = c["finish_reason"] or finish
    return {"i": i, "tokens": tokens, "usage": usage, "finish": finish, "done": done}


async def disconnect_one(client: httpx.AsyncClient, i: int) -> None:
    body = {"messages": messages(1000 + i), "max_tokens": 1500, "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        seen = 0
        async for line in r.aiter_lines():
            seen += line.startswith("data: ")
            if seen >= 3:  # role chunk plus some content: the request is running; hang up
                break


async def run_load(url: str) -> list[dict]:
    limits = httpx.Limits(max_connections=COMPLETE + DISCONNECT + 10, max_keepalive_connections=20)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        results = await asyncio.gather(*[complete_one(client, i) for i in range(COMPLETE)],
                                       *[disconnect_one(client, i) for i in range(DISCONNECT)])
    return results[:COMPLETE]


def test_concurrent_streams_and_disconnects(live):
    before = wait_idle(live)
    results = asyncio.run(run_load(live.url))
    for res in results:
        i = res["i"]
        expected_completion = 3 + i % 6
        assert res["done"] and res["finish"] == "length"
        assert res["tokens"] == expected_completion
        assert res["usage"]["completion_tokens"] == expected_completion
        assert res["usage"]["prompt_tokens"] == len(render_chat(live.engine, messages(i)))
        assert res["usage"]["total_tokens"] == res["usage"]["prompt_tokens"] + expected_completion
    after = wait_idle(live, timeout=60)
    assert after["aborted_total"] - before["aborted_total"] == DISCONNECT
    assert after["finished_total"] - before["finished_total"] == COMPLETE + DISCONNECT
    # Disconnected requests were cut short: far fewer tokens than their 1500 each.
    generated = after["generated_tokens_total"] - before["generated_tokens_total"]
    assert generated < sum(3 + i % 6 for i in range(COMPLETE)) + DISCONNECT * 1500 // 2
    with live.client() as client:
        assert client.post("/flush_cache").status_code == 200
        state = client.get("/get_server_info").json()["internal_states"][0]
    assert state["kv_slots_free"] == state["kv_slots_total"]
    assert state["running"] == state["waiting"] == 0


def test_non_streaming_client_disconnect_aborts(live):
    before = wait_idle(live)
    body = {"prompt": "hang up on me", "max_tokens": 1800, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up (and closes the connection) first
        httpx.post(live.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    after = wait_idle(live, timeout=30)
    assert after["aborted_total"] == before["aborted_total"] + 1
    assert after["generated_tokens_total"] - before["generated_tokens_total"] < 1800
