"""The radix cache's host tier (hicache_size_gb) on a multi-turn chat workload whose live prefixes are
several times the device KV pool: throughput and TTFT with the tier off and on, side by side in one run.

    python benchmarks/bench_hicache.py --preset h200 --out hicache.json   # Llama-3-8B shape, random weights
    python benchmarks/bench_hicache.py --preset cpu                         # the default model (SmolLM2-135M)
    python benchmarks/bench_hicache.py --preset tiny --cpu                  # the test model, seconds (CI)

Workload: `users` chat sessions, each behind one of `agents` long system prompts and with its own long
first message (a document), take `turns` turns. A round is every user's next turn, in a shuffled order
(seed 0), at most `concurrency` in flight; a turn's prompt is the whole conversation so far (system
prompt, every earlier message and reply) plus a new message, so a returning user's prefix is cached
from the previous round unless it was evicted. The device pool is limited by max_total_tokens to a
third or less of the live prefixes, so by the time a user returns, most of the others have pushed its
KV out of the device; with the tier on it waits in host memory. Prompts are random token ids, outputs
greedy with ignore_eos (fixed lengths). Round 0 is cold for both (no user has been seen): throughput
and TTFT are reported for the returning rounds (1..turns-1) and for all.

With --also-fits the same workload runs again with the default (large) device pool, tier off and on:
the tier must not slow down a workload that fits on the device.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import make_model_dir  # noqa: E402  (makes radixlm importable from a bare checkout)

import radixlm  # noqa: E402

# model: bench_engine's model name; pool_tokens: the device pool (max_total_tokens) of the spill run.
PRESETS = {
    "h200": dict(model="llama3-8b-shape", agents=8, system_len=1024, users=96, document_len=1024, message_len=64,
                 output_len=64, turns=4, concurrency=16, pool_tokens=40_000, hicache_size_gb=24.0,
                 chunked_prefill_size=8192),
    "cpu": dict(model="default", agents=2, system_len=192, users=12, document_len=192, message_len=16, output_len=8,
                turns=3, concurrency=4, pool_tokens=1536, hicache_size_gb=0.25, chunked_prefill_size=8192),
    "tiny": dict(model="tiny", agents=2, system_len=32, users=8, document_len=40, message_len=4, output_len=4,
                 turns=3, concurrency=3, pool_tokens=200, hicache_size_gb=0.002, chunked_prefill_size=8192),
}


def conversations(p: dict[str, Any], vocab: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Each user's opening (system prompt + document) and the new message of each of its turns."""
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    systems = [tokens(p["system_len"]) for _ in range(p["agents"])]
    openings = [systems[u % p["agents"]] + tokens(p["document_len"]) for u in range(p["users"])]
    messages = [[tokens(p["message_len"]) for _ in range(p["turns"])] for _ in range(p["users"])]
    return openings, messages


async def run_rounds(engine: Any, p: dict[str, Any], vocab: int) -> dict[str, Any]:
    openings, messages = conversations(p, vocab)
    history = [list(o) for o in openings]
    params = {"max_new_tokens": p["output_len"], "temperature": 0, "ignore_eos": True}
    order = list(range(p["users"]))
    rng = random.Random(0)
    limit = asyncio.Semaphore(p["concurrency"])
    rounds = []
    outputs: list[list[int]] = []

    async def turn(u: int, r: int) -> tuple[int, dict[str, Any]]:
        async with limit:
            prompt = history[u] + messages[u][r]
            out = await engine.async_generate(input_ids=prompt, sampling_params=params)
            history[u] = prompt + out["output_ids"]
            return u, out

    for r in range(p["turns"]):
        rng.shuffle(order)
        stats0, t0 = engine.get_stats(), time.perf_counter()
        done = await asyncio.gather(*(turn(u, r) for u in order))
        seconds = time.perf_counter() - t0
        stats1 = engine.get_stats()
        outs = [o for _, o in sorted(done, key=lambda x: x[0])]
        outputs.extend(o["output_ids"] for o in outs)
        rounds.append({
            "seconds": seconds,
            "ttft": [o["meta_info"]["ttft"] for o in outs],
            "prompt_tokens": sum(o["meta_info"]["prompt_tokens"] for o in outs),
            "output_tokens": sum(o["meta_info"]["completion_tokens"] for o in outs),
            **{k: stats1[k] - stats0[k] for k in ("prefill_tokens_total", "cached_tokens_total",
                                                   "hicache_host_hit_tokens_total", "hicache_bytes_to_host_total",
                                                   "hicache_bytes_to_device_total", "hicache_load_wait_s")},
        })
    live = sum(len(h) for h in history)
    return {"rounds": rounds, "outputs": outputs, "live_prefix_tokens": live}


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    seconds = sum(r["seconds"] for r in rounds)
    ttft = sorted(t for r in rounds for t in r["ttft"])
    out = {k: sum(r[k] for r in rounds) for k in rounds[0] if k not in ("seconds", "ttft")}
    n = len(ttft)
    out.update(seconds=seconds, requests=n, requests_per_s=n / seconds,
               output_tokens_per_s=out["output_tokens"] / seconds,
               total_tokens_per_s=(out["output_tokens"] + out["prompt_tokens"]) / seconds,
               ttft_p50_s=statistics.median(ttft), ttft_p99_s=ttft[min(n - 1, int(0.99 * n))])
    return out


def run_config(model_dir: str | None, extra: dict[str, Any], p: dict[str, Any], device: str, pool_tokens: int | None,
               policy: str | None, label: str) -> dict[str, Any]:
    """One engine through the whole workload; `policy` None: the tier off, else its write policy."""
    t0 = time.perf_counter()
    tier = {} if policy is None else {"hicache_size_gb": p["hicache_size_gb"], "hicache_write_policy": policy}
    engine = radixlm.Engine(model_dir, device=device, max_total_tokens=pool_tokens,
                            chunked_prefill_size=p["chunked_prefill_size"], log_level="warning", **tier, **extra)
    try:
        start_s = time.perf_counter() - t0
        vocab = engine.model_config.vocab_size
        result = asyncio.run(run_rounds(engine, p, vocab))
        stats = engine.get_stats()
    finally:
        engine.shutdown()
    rounds = result["rounds"]
    for i, r in enumerate(rounds):
        print(f"{label}: round {i} {r['seconds']:.2f} s, TTFT p50 {statistics.median(r['ttft']):.3f} s, "
              f"{r['prefill_tokens_total']} tokens computed, {r['hicache_host_hit_tokens_total']} from the host",
              flush=True)
    return {
        "device_pool_tokens": stats["kv_slots_total"], "host_pool_tokens": stats["hicache_slots_total"],
        "live_prefix_tokens": result["live_prefix_tokens"], "engine_start_s": start_s,
        "returning": summarize(rounds[1:]), "all": summarize(rounds), "outputs": result["outputs"],
    }


def compare(off: dict[str, Any], on: dict[str, Any]) -> dict[str, Any]:
    a, b = off["returning"], on["returning"]
    same = sum(x == y for x, y in zip(off["outputs"], on["outputs"]))
    return {"throughput_x": b["total_tokens_per_s"] / a["total_tokens_per_s"],
            "ttft_p50_x_lower": a["ttft_p50_s"] / b["ttft_p50_s"],
            "ttft_p99_x_lower": a["ttft_p99_s"] / b["ttft_p99_s"],
            "outputs_equal": f"{same}/{len(off['outputs'])}"}


def table(name: str, off: dict[str, Any], ons: dict[str, dict[str, Any]]) -> str:
    """Tier off against the tier with each write policy, as a markdown table."""
    some = next(iter(ons.values()))
    rows = [f"{name}: device pool {off['device_pool_tokens']} tokens, live prefixes {off['live_prefix_tokens']} "
            f"tokens ({off['live_prefix_tokens'] / off['device_pool_tokens']:.1f}x), host tier "
            f"{some['host_pool_tokens']} tokens", "| returning rounds | tier off | " + " | ".join(ons) + " |",
            "| --- " * (2 + len(ons)) + "|"]
    for label, key, fmt in (("total tokens/s", "total_tokens_per_s", "{:.0f}"),
                            ("output tokens/s", "output_tokens_per_s", "{:.0f}"),
                            ("TTFT p50 (s)", "ttft_p50_s", "{:.3f}"), ("TTFT p99 (s)", "ttft_p99_s", "{:.3f}"),
                            ("prefill tokens computed", "prefill_tokens_total", "{}"),
                            ("tokens from the host tier", "hicache_host_hit_tokens_total", "{}"),
                            ("load wait (s, summed)", "hicache_load_wait_s", "{:.3f}")):
        cells = [fmt.format(r["returning"][key]) for r in (off, *ons.values())]
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    for policy, on in ons.items():
        c = compare(off, on)
        rows.append(f"{policy}: throughput {c['throughput_x']:.2f}x, TTFT p50 {c['ttft_p50_x_lower']:.2f}x lower, "
                    f"p99 {c['ttft_p99_x_lower']:.2f}x lower; greedy outputs equal {c['outputs_equal']}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU even when a GPU is present")
    ap.add_argument("--also-fits", action="store_true", help="also run with the default device pool (no spill)")
    ap.add_argument("--out", help="write the results as JSON here")
    for key in ("users", "turns", "concurrency", "pool_tokens"):
        ap.add_argument("--" + key.replace("_", "-"), type=int, help=f"override the preset's {key}")
    ap.add_argument("--hicache-size-gb", type=float, help="override the preset's host tier size")
    ap.add_argument("--write-policies", nargs="+", default=["write_back"], choices=["write_back", "write_through"],
                    help="run the tier once with each (hicache_write_policy)")
    args = ap.parse_args(argv)
    p = dict(PRESETS[args.preset])
    for key in ("users", "turns", "concurrency", "pool_tokens", "hicache_size_gb"):
        if getattr(args, key) is not None:
            p[key] = getattr(args, key)
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    model_dir, extra = ((None, {}) if p["model"] == "default"
                        else make_model_dir(p["model"], tempfile.mkdtemp(prefix="radixlm-hicache-")))
    results: dict[str, Any] = {"preset": args.preset, "params": p, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                               "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor()
                               or "cpu", "torch": torch.__version__, "argv": sys.argv[1:] if argv is None else argv}
    scenarios = [("spill", p["pool_tokens"])] + ([("fits", None)] if args.also_fits else [])
    for name, pool in scenarios:
        off = run_config(model_dir, extra, p, device, pool, None, f"{name}, tier off")
        ons = {policy: run_config(model_dir, extra, p, device, pool, policy, f"{name}, {policy}")
               for policy in args.write_policies}
        results[name] = {"off": off, **ons, "compare": {policy: compare(off, on) for policy, on in ons.items()}}
        print(table(name, off, ons), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
