"""Server-sent events: the server's own EventStreamResponse against sse-starlette's EventSourceResponse,
both streaming the same chunks (a chat-completion-sized JSON per event) from an async generator with no
engine behind it, so only the response classes differ. The server runs in a subprocess (uvicorn); the
client reads every event with httpx; runs alternate between the two, and the median is reported.

    python benchmarks/bench_sse.py --events 20000 --runs 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import httpx

_CHUNK = json.dumps({"id": "chatcmpl-0", "object": "chat.completion.chunk", "created": 0, "model": "m",
                     "choices": [{"index": 0, "delta": {"content": " token"}, "finish_reason": None}]})

_SERVER = '''
import sys, uvicorn
from starlette.applications import Starlette
from starlette.routing import Route
from sse_starlette import EventSourceResponse
from radixlm.server.generation import EventStreamResponse, sse

CHUNK, N = sys.argv[1], int(sys.argv[2])

async def ours(request):
    async def body():
        for _ in range(N):
            yield sse(CHUNK)
        yield sse("[DONE]")
    async def close():
        pass
    return EventStreamResponse(body(), close)

async def theirs(request):
    async def body():
        for _ in range(N):
            yield {"data": CHUNK}
        yield {"data": "[DONE]"}
    return EventSourceResponse(body(), ping=15)

app = Starlette(routes=[Route("/ours", ours), Route("/sse_starlette", theirs)])
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[3]), log_level="warning")
'''


def _read(client: httpx.Client, path: str) -> tuple[int, float]:
    start = time.perf_counter()
    events = 0
    with client.stream("GET", path) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                events += 1
    return events, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=20000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--port", type=int, default=38731)
    args = ap.parse_args()
    server = subprocess.Popen([sys.executable, "-c", _SERVER, _CHUNK, str(args.events), str(args.port)])
    try:
        url = f"http://127.0.0.1:{args.port}"
        with httpx.Client(base_url=url, timeout=120) as client:
            for _ in range(100):
                try:
                    client.get("/ours").read()
                    break
                except httpx.TransportError:
                    time.sleep(0.1)
            rates: dict[str, list[float]] = {"/ours": [], "/sse_starlette": []}
            for _ in range(args.runs):
                for path in rates:
                    events, seconds = _read(client, path)
                    assert events == args.events + 1, (path, events)
                    rates[path].append(events / seconds)
        for path, values in rates.items():
            print(f"{path:16s} median {statistics.median(values):9.0f} events/s  "
                  f"(runs: {', '.join(f'{v:.0f}' for v in values)})")
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
