"""Soak: the server under a mix of good, hostile and abandoned requests for minutes, as an operator
would probe it (issue 16). Reports status counts, any 5xx, the bystander's correctness, /health latency
and, at the end, whether every KV slot came back.

    python benchmarks/soak_server.py --minutes 5                       # the embedded tiny model, CPU
    python benchmarks/soak_server.py --model-path DIR --minutes 30 --max-total-tokens 4096

Each worker loops over one kind of traffic:
- good: /v1/chat/completions and /generate (greedy, stream and not), some with regex / JSON schema;
- bystander: the same greedy /generate over and over; every answer must equal the first;
- hostile: malformed bodies, non-finite and out-of-range sampling values, huge fan-out, deep nesting,
  oversize prompts, duplicate rids: each must be a 4xx;
- disconnect: streams dropped after their first event;
- probe: /health, /metrics, /get_server_info every 50 ms, timed.
Afterwards: wait until idle, /flush_cache, and check kv_slots_free == kv_slots_total.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import threading
import time
from collections import Counter

import httpx
import uvicorn

import radixlm
from radixlm.server.app import create_app
from radixlm.server.args import ServerArgs

HOSTILE = [
    b'{"text": "x", "sampling_params": {"temperature": Infinity}}',
    b'{"text": "x", "sampling_params": {"logit_bias": {"-5": 1}}}',
    b'{"text": "x", "sampling_params": {"logit_bias": {"99999999999999999999": 1}}}',
    b'{"text": "x", "sampling_params": {"max_new_tokens": 10000000}}',
    b'{"text": ["a", "b", "c", "d", "e", "f", "g", "h", "i"], "sampling_params": {"n": 128}}',
    b'{"text": "x", "sampling_params": {"regex": "' + b"(" * 3000 + b")" * 3000 + b'"}}',
    b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
    b'{"messages": [',
    b"[" * 50_000 + b"]" * 50_000,
]


def start_server(args: argparse.Namespace) -> tuple[uvicorn.Server, str, radixlm.Engine]:
    engine = radixlm.Engine(args.model_path, max_total_tokens=args.max_total_tokens)
    config = uvicorn.Config(create_app(engine, ServerArgs(port=0)), host="127.0.0.1", port=0, log_level="error")
    server = uvicorn.Server(config)
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}", engine


async def soak(url: str, seconds: float) -> dict:
    stop = time.monotonic() + seconds
    statuses: Counter = Counter()
    fivexx: list[str] = []
    probe_ms: list[float] = []
    bystander: dict = {"expected": None, "runs": 0, "wrong": 0}
    rng = random.Random(0)

    def note(kind: str, resp: httpx.Response) -> None:
        statuses[f"{kind} {resp.status_code}"] += 1
        if resp.status_code >= 500:
            fivexx.append(f"{kind}: {resp.text[:200]}")

    async def good(client: httpx.AsyncClient) -> None:
        while time.monotonic() < stop:
            choice = rng.randrange(4)
            if choice == 0:
                resp = await client.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": f"hello {rng.random()}"}], "max_tokens": 24})
            elif choice == 1:
                resp = await client.post("/generate", json={"text": "json please", "sampling_params": {
                    "max_new_tokens": 32, "json_schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}})
            elif choice == 2:
                resp = await client.post("/generate", json={"text": "pick", "sampling_params": {
                    "max_new_tokens": 8, "regex": "(yes|no|maybe)"}})
            else:
                resp = await client.post("/generate", json={"text": ["a", "b"], "sampling_params": {
                    "max_new_tokens": 16, "n": 2}, "stream": True})
            note("good", resp)

    async def steady(client: httpx.AsyncClient) -> None:
        body = {"text": "the bystander", "sampling_params": {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}}
        while time.monotonic() < stop:
            resp = await client.post("/generate", json=body)
            note("bystander", resp)
            if resp.status_code == 200:
                ids = resp.json()["output_ids"]
                bystander["expected"] = bystander["expected"] or ids
                bystander["runs"] += 1
                bystander["wrong"] += ids != bystander["expected"]

    async def hostile(client: httpx.AsyncClient) -> None:
        while time.monotonic() < stop:
            raw = rng.choice(HOSTILE)
            path = "/v1/chat/completions" if b"messages" in raw or raw.startswith(b"[") else "/generate"
            note("hostile", await client.post(path, content=raw, headers={"content-type": "application/json"}))

    async def disconnect(client: httpx.AsyncClient) -> None:
        while time.monotonic() < stop:
            async with client.stream("POST", "/generate", json={"text": "leave", "stream": True, "sampling_params": {
                    "max_new_tokens": 200, "ignore_eos": True}}) as resp:
                statuses[f"disconnect {resp.status_code}"] += 1
                async for line in resp.aiter_lines():
                    if line.startswith("data:"):
                        break

    async def probe(client: httpx.AsyncClient) -> None:
        while time.monotonic() < stop:
            for path in ("/health", "/metrics", "/get_server_info"):
                start = time.monotonic()
                note("probe", await client.get(path))
                probe_ms.append((time.monotonic() - start) * 1000)
            await asyncio.sleep(0.05)

    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=64)) as client:
        await asyncio.gather(*(good(client) for _ in range(4)), steady(client), *(hostile(client) for _ in range(2)),
                             *(disconnect(client) for _ in range(4)), probe(client))
    probe_ms.sort()
    return {"statuses": dict(sorted(statuses.items())), "5xx": fivexx, "bystander": {k: v for k, v in bystander.items()
                                                                                     if k != "expected"},
            "probe_ms": {"median": statistics.median(probe_ms), "p99": probe_ms[int(len(probe_ms) * 0.99)],
                         "max": probe_ms[-1], "count": len(probe_ms)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--max-total-tokens", type=int, default=2048)
    args = ap.parse_args()
    server, url, engine = start_server(args)
    try:
        result = asyncio.run(soak(url, args.minutes * 60))
        deadline = time.monotonic() + 120
        while (stats := engine.get_stats())["in_flight"] or stats["running"] or stats["waiting"]:
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        flushed = engine.flush_cache()
        stats = engine.get_stats()
        result["after"] = {"flushed": flushed, "kv_slots_free": stats["kv_slots_free"],
                           "kv_slots_total": stats["kv_slots_total"], "aborted_total": stats["aborted_total"],
                           "retractions_total": stats["retractions_total"], "finished_total": stats["finished_total"]}
        print(json.dumps(result, indent=1))
        ok = not result["5xx"] and not result["bystander"]["wrong"] and stats["kv_slots_free"] == stats["kv_slots_total"]
        print("SOAK", "PASSED" if ok else "FAILED")
    finally:
        server.should_exit = True
        engine.shutdown()


if __name__ == "__main__":
    main()
