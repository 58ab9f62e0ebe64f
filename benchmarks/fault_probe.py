"""Fault probe (issue 37): what clients of a `radixlm serve` process see when the operator's world goes
wrong, measured from outside with N concurrent clients, and whether every KV slot came back.

    python benchmarks/fault_probe.py                                  # the tiny model, 200 clients, all
    python benchmarks/fault_probe.py --model-path DIR --clients 200 --scenarios drain kill
    python benchmarks/fault_probe.py --out benchmarks/results/DATE-faults.md

Each scenario starts its own server (it signals or breaks it), on a free loopback port:

- drain: N streaming clients admitted, then SIGTERM; a late request every 50 ms during the drain. Every
  admitted stream must finish normally, every late request get 503 (draining), /health say 503, and the
  process exit 0 within --drain-timeout.
- kill: the server with --scheduler-process; N streaming clients, then kill -9 of the scheduler's
  process. Every client must get an error (event or status) within 5 s, /health turn 503, the server
  exit non-zero, and no process be left behind.
- oom: N greedy requests on a server whose every 50th forward raises CUDA's out-of-memory error
  (RADIXLM_INJECT_FAULTS=oom_every=50, a test-only hook); their outputs must equal those of a server
  without it, and KV free + cached = total afterwards.
- deadline: N streaming requests with `timeout` T beside N/4 short ones without, each on a connection
  opened beforehand; each must end (an error event with code timeout) within 1 s of its limit, the short
  ones normally, and no slot leak. The client measures from the moment its request's bytes were written
  to the socket to the moment it read the final chunk's bytes (the error event follows). These clients are aiohttp's (C parser,
  no connection limit) reading raw bytes: with httpx, whose connection pool re-scans every connection on
  each request's start and end (seconds of this process's CPU with 250 connections), and a parsed line
  per token event, the figure was mostly the client's own work (benchmarks/results/2026-12-07-faults.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx

from radixlm.testing.servers import ServerProcess


def start_server(model: str, *flags: str, env: dict[str, str] | None = None) -> ServerProcess:
    return ServerProcess("--model-path", model, "--log-interval", "0", *flags, env=env, start_timeout=300)


def capacity(args: argparse.Namespace) -> tuple[str, ...]:
    """The KV pool, and room for every client to run at once (the CPU default runs 64)."""
    flags = ("--max-total-tokens", str(args.max_total_tokens), "--max-running-requests", str(args.max_running_requests))
    return flags + (("--scheduler-process",) if args.scheduler_process else ())


def server_info(server: ServerProcess) -> dict[str, Any]:
    return httpx.get(server.url + "/get_server_info", timeout=30).json()


@dataclass
class Stream:
    """One streaming request's outcome."""

    started: float = 0.0
    first: float | None = None
    ended: float | None = None
    status: int | None = None
    outcome: str = "cut"  # finish type, an error event's code, "http <status>", or "cut"
    ids: list[int] = field(default_factory=list)


async def stream(client: httpx.AsyncClient, path: str, body: dict, first: asyncio.Event | None = None) -> Stream:
    s = Stream(started=time.monotonic())
    try:
        async with client.stream("POST", path, json=body) as r:
            s.status = r.status_code
            if r.status_code != 200:
                await r.aread()
                s.outcome = f"http {r.status_code} {r.json()['error'].get('code')}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if s.first is None:
                        s.first = time.monotonic()
                        if first is not None:
                            first.set()
                    if line == "data: [DONE]":
                        break
                    if '"finish_reason": null' in line and '"error"' not in line:
                        continue  # a token chunk: not parsed, so that 200 streams do not starve this client
                    event = json.loads(line[6:])
                    if "error" in event:
                        s.outcome = event["error"]["code"]
                    elif event["meta_info"]["finish_reason"] is not None and s.outcome == "cut":
                        s.outcome = event["meta_info"]["finish_reason"]["type"]
                        s.ids = event["output_ids"]
    except httpx.HTTPError as exc:
        s.outcome = s.outcome if s.outcome != "cut" else f"cut ({type(exc).__name__})"
    s.ended = time.monotonic()
    if first is not None:
        first.set()
    return s


def limits(n: int) -> httpx.Limits:
    return httpx.Limits(max_connections=n + 50, max_keepalive_connections=n + 50)


def body(i: int, tokens: int, **extra: Any) -> dict:
    return {"text": f"client {i} writes about", "stream": True, **extra,
            "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True, "temperature": 0}}


async def start_clients(url: str, n: int, tokens: int, **extra: Any) -> tuple[list[asyncio.Task], httpx.AsyncClient]:
    client = httpx.AsyncClient(base_url=url, timeout=300, limits=limits(n))
    firsts = [asyncio.Event() for _ in range(n)]
    tasks = [asyncio.ensure_future(stream(client, "/generate", body(i, tokens, **extra), firsts[i])) for i in range(n)]
    await asyncio.gather(*(f.wait() for f in firsts))
    return tasks, client


def kv_accounted(url: str, timeout: float = 120) -> tuple[bool, dict]:
    """Waits until the engine is idle; whether free + cached = total then."""
    deadline = time.monotonic() + timeout
    while True:
        stats = httpx.get(url + "/get_server_info", timeout=30).json()["internal_states"][0]
        if (stats["running"] == 0 and stats["waiting"] == 0) or time.monotonic() > deadline:
            return stats["kv_slots_free"] + stats["kv_slots_cached"] == stats["kv_slots_total"], stats
        time.sleep(0.2)


# ---- scenarios --------------------------------------------------------------------------------------

async def drain(args: argparse.Namespace) -> dict:
    server = start_server(args.model_path, *capacity(args), "--drain-timeout",
                    str(args.drain_timeout))
    try:
        tasks, client = await start_clients(server.url, args.clients, args.tokens)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        live = sum(1 for t in tasks if not t.done())
        exit_at: list[float] = []
        waiter = asyncio.ensure_future(asyncio.to_thread(server.proc.wait, args.drain_timeout + 60))
        waiter.add_done_callback(lambda _: exit_at.append(time.monotonic()))
        late, health = [], []
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as probe:
            while not waiter.done():
                try:
                    r = await probe.post("/generate", json={"text": "late", "sampling_params": {"max_new_tokens": 2}})
                    late.append((r.status_code, r.json().get("error", {}).get("code")))
                    h = await probe.get("/health")
                    health.append(h.status_code)
                except httpx.HTTPError:
                    break
                await asyncio.sleep(0.05)
        streams = await asyncio.gather(*tasks)
        await client.aclose()
        code = await waiter
        exited = exit_at[0] - t0
    finally:
        server.kill()
    done = [s for s in streams if s.outcome == "length"]
    if len(done) < args.clients:
        print("".join(server.log[-40:]), flush=True)
    return {
        "admitted streams": args.clients,
        "streams still running at SIGTERM": live,
        "finished normally": len(done),
        "outcomes": dict(Counter(s.outcome for s in streams)),
        "last stream ended after SIGTERM (s)": round(max(s.ended for s in streams) - t0, 2),
        "late requests": len(late),
        "late requests answered 503 draining": sum(1 for st, c in late if st == 503 and c == "draining"),
        "/health during drain": sorted(set(health)),
        "exit code": code,
        "exited after SIGTERM (s)": round(exited, 2),
        "exited after the last stream ended (s)": round(exited - (max(s.ended for s in streams) - t0), 2),
        "pass": len(done) == args.clients and code == 0 and all(st == 503 for st, _ in late)
                and exited < args.drain_timeout + 10 and live == args.clients,
    }


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not left behind: it has exited
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


async def kill(args: argparse.Namespace) -> dict:
    server = start_server(args.model_path, *capacity(argparse.Namespace(**{**vars(args), "scheduler_process": True})))
    try:
        pid = server_info(server)["scheduler_pid"]
        tasks, client = await start_clients(server.url, args.clients, 4 * args.tokens)
        health: list = []
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        live = sum(1 for t in tasks if not t.done())

        async def watch() -> None:
            async with httpx.AsyncClient(base_url=server.url, timeout=5) as probe:
                while server.proc.poll() is None:
                    try:
                        r = await probe.get("/health")
                        health.append((r.status_code, r.json()["error"]["code"] if r.status_code != 200 else None))
                    except httpx.HTTPError:
                        break
                    await asyncio.sleep(0.05)

        watcher = asyncio.ensure_future(watch())
        streams = await asyncio.gather(*tasks)
        await client.aclose()
        code = await asyncio.to_thread(server.proc.wait, 60)
        await watcher
        left = [p for p in (pid, server.proc.pid) if _alive(p)]
    finally:
        server.kill()
    errors = [s for s in streams if s.outcome not in ("length", "stop") and not s.outcome.startswith("cut")]
    worst = max(s.ended for s in streams) - t0
    return {
        "clients": args.clients,
        "streams still running at the kill": live,
        "clients given an error": len(errors),
        "error codes": sorted({s.outcome for s in streams}),
        "last error after kill -9 (s)": round(worst, 2),
        "/health after kill": sorted({f"{st} {c}" for st, c in health if st != 200}),
        "exit code": code,
        "processes left": len(left),
        "pass": len(errors) == args.clients and worst < 5 and code != 0 and not left,
    }


async def _greedy_run(url: str, n: int, tokens: int) -> list[list[int]]:
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits(n)) as client:
        streams = await asyncio.gather(*(stream(client, "/generate", body(i, tokens)) for i in range(n)))
    return [s.ids if s.outcome == "length" else [s.outcome] for s in streams]


async def oom(args: argparse.Namespace) -> dict:
    flags = capacity(args)
    clean = start_server(args.model_path, *flags)
    try:
        expected = await _greedy_run(clean.url, args.clients, args.tokens)
    finally:
        clean.kill()
    faulty = start_server(args.model_path, *flags, env={"RADIXLM_INJECT_FAULTS": f"oom_every={args.oom_every}"})
    try:
        t0 = time.monotonic()
        got = await _greedy_run(faulty.url, args.clients, args.tokens)
        took = time.monotonic() - t0
        accounted, stats = kv_accounted(faulty.url)
    finally:
        faulty.kill()
    injected = sum(1 for line in faulty.log if "injected fault: CUDA out of memory" in line)
    same = sum(1 for a, b in zip(expected, got) if a == b)
    return {
        "requests": args.clients,
        "injected out-of-memory steps": injected,
        "outputs equal to the run without faults": same,
        "retractions": stats.get("retractions_total"),
        "KV free + cached = total": accounted,
        "run time with faults (s)": round(took, 1),
        "pass": same == args.clients and accounted and injected > 0,
    }


# In a stream's raw bytes: the error event's code, or the final chunk's finish reason.
_ERROR_CODE = re.compile(rb'data: \{"error": \{.*?"code": "(\w+)"')
_FINISH = re.compile(rb'"finish_reason": \{"type": "(\w+)"')


def _sent_stamps() -> aiohttp.TraceConfig:
    """Stamps a Stream's `started` when its request's bytes were written to the socket (the body's first
    chunk, which carries the headers too), not when the client was asked to send it."""
    trace = aiohttp.TraceConfig()

    async def sent(session: Any, ctx: Any, params: Any) -> None:
        s = ctx.trace_request_ctx
        if s is not None and not s.first_write:
            s.started, s.first_write = time.monotonic(), True

    trace.on_request_chunk_sent.append(sent)
    return trace


@dataclass
class RawStream(Stream):
    first_write: bool = False


async def raw_stream(session: aiohttp.ClientSession, payload: dict) -> RawStream:
    """A streaming /generate read as raw bytes: ended when its final chunk is read; its outcome the error
    event's code when one follows, else the finish reason."""
    s = RawStream(started=time.monotonic())
    tail = b""
    async with session.post("/generate", json=payload, trace_request_ctx=s) as r:
        s.status = r.status
        async for data in r.content.iter_any():
            seen = tail + data
            end = _FINISH.search(seen) or _ERROR_CODE.search(seen)
            if end is not None and s.ended is None:  # the final chunk (its error event follows it)
                s.outcome, s.ended = end.group(1).decode(), time.monotonic()
            error = _ERROR_CODE.search(seen)
            if error is not None:
                s.outcome = error.group(1).decode()
            tail = seen[-512:]
    if s.ended is None:
        s.ended = time.monotonic()
    return s


async def _loop_stalls(out: list[float]) -> None:
    """The client's own event loop: how late each 10 ms sleep woke (a late one: the client was busy)."""
    while True:
        t = time.monotonic()
        await asyncio.sleep(0.01)
        out.append(time.monotonic() - t - 0.01)


async def deadline(args: argparse.Namespace) -> dict:
    server = start_server(args.model_path, *capacity(args))
    stalls: list[float] = []
    try:
        n_short = max(1, args.clients // 4)
        connector = aiohttp.TCPConnector(limit=0)  # aiohttp's default, 100, would queue half the clients
        async with aiohttp.ClientSession(server.url, connector=connector, trace_configs=[_sent_stamps()],
                                         timeout=aiohttp.ClientTimeout(total=300)) as session:
            async def health() -> None:
                async with session.get("/health") as r:
                    await r.read()

            # Every client's connection is open before the clocks start: a limit counts from the server's
            # receipt of the request, not from a storm of 250 TCP connects on a shared CPU.
            await asyncio.gather(*(health() for _ in range(args.clients + n_short)))
            watch = asyncio.ensure_future(_loop_stalls(stalls))
            limited = [raw_stream(session, body(i, 4 * args.tokens, timeout=args.timeout)) for i in range(args.clients)]
            short = [raw_stream(session, body(i, 8)) for i in range(n_short)]
            results = await asyncio.gather(*limited, *short)
            watch.cancel()
        accounted, stats = kv_accounted(server.url)
    finally:
        server.kill()
    limited_r, short_r = results[:args.clients], results[args.clients:]
    late = [s.ended - s.started - args.timeout for s in limited_r]
    return {
        "requests with a limit": args.clients,
        "limit (s)": args.timeout,
        "ended with code timeout": sum(1 for s in limited_r if s.outcome == "timeout"),
        "latest end past the limit (s), from the request's bytes on the socket to its final chunk read":
            round(max(late), 2),
        "the client's longest event-loop stall (s)": round(max(stalls, default=0.0), 2),
        "short requests without a limit finished normally": f"{sum(1 for s in short_r if s.outcome == 'length')}/{n_short}",
        "KV free + cached = total": accounted,
        "pass": all(s.outcome == "timeout" for s in limited_r) and max(late) < 1.0 and accounted
                and all(s.outcome == "length" for s in short_r),
    }


SCENARIOS = {"drain": drain, "kill": kill, "oom": oom, "deadline": deadline}


def report(args: argparse.Namespace, results: dict[str, dict]) -> str:
    lines = [f"Command: `python benchmarks/fault_probe.py {' '.join(sys.argv[1:])}`",
             f"Machine: {platform.node()} ({os.cpu_count()} CPUs, {platform.platform()}), "
             f"date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", ""]
    for name, figures in results.items():
        lines += [f"### {name}", "", "| figure | value |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in figures.items()]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="default: the tiny random Llama the tests use")
    p.add_argument("--clients", type=int, default=200)
    p.add_argument("--tokens", type=int, default=64, help="tokens each streaming client asks for")
    p.add_argument("--max-total-tokens", type=int, default=60000)
    p.add_argument("--max-running-requests", type=int, default=256, help="the servers' limit (room for every client)")
    p.add_argument("--scheduler-process", action="store_true",
                   help="every server runs its scheduler in its own process (the kill scenario's always does)")
    p.add_argument("--drain-timeout", type=float, default=30.0)
    p.add_argument("--timeout", type=float, default=2.0, help="the deadline scenario's per-request limit (s)")
    p.add_argument("--oom-every", type=int, default=50)
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    p.add_argument("--out", help="append the Markdown report to this file")
    args = p.parse_args()
    if args.model_path is None:
        from radixlm.testing.checkpoints import tiny_model_path

        args.model_path = tiny_model_path()
    results = {}
    for name in args.scenarios:
        print(f"--- {name}", flush=True)
        results[name] = asyncio.run(SCENARIOS[name](args))
        print(json.dumps(results[name], indent=1), flush=True)
    text = report(args, results)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
