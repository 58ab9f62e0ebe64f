"""`radixlm router` against a plain load balancer and one replica, on the paper's shared-prefix workloads.

    python benchmarks/bench_router.py --out results.json --markdown results.md

Three `radixlm serve` replicas of the default model (SmolLM2-135M-Instruct) on loopback, each with the
same KV pool (--max-total-tokens) and torch threads (--threads), and three ways to reach them:
- router: `radixlm router --policy cache_aware` over the three (the meta radix tree, load-bounded);
- round_robin: `radixlm router --policy round_robin` over the same three (a plain load balancer);
- single: the first replica alone, called directly.
Each workload (benchmarks/workloads/: MMLU 5-shot, multi-turn chat, and prefix_pressure: more long
documents than one replica's pool holds) runs every program instance at once through the DSL's
RuntimeEndpoint, the caches flushed before each run. Reported per workload and system: the cache hit
rate (cached / prompt tokens, summed over the replicas' own counters), throughput (program instances
per second), and the mean time to first token as the replicas measured it (arrival to first token,
queueing included; the router's own hop is not in it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_info import cpu_name  # noqa: E402
from workloads import WORKLOADS  # noqa: E402

import radixlm as sgl  # noqa: E402
from radixlm.testing.servers import ServerProcess  # noqa: E402

# Sizes between the workloads' "tiny" and "gpu" presets, small enough for minutes per run on a shared
# CPU with SmolLM2 (--max-total-tokens 1024 per replica).
SIZES = {
    "mmlu": ({"subjects": 6, "question_words": 12, "option_words": 3}, 24),
    "chat_short": ({"system_sentences": 6, "question_sentences": 1, "turns": 3, "answer_tokens": 4}, 12),
    # 8 documents of 250 to 300 tokens (about 2,250 in all): one replica's pool holds 3 of them, the three
    # pools all; each asked 3 times. 8, not a multiple of the 3 replicas, so that round-robin in arrival
    # order does not send each document to one replica by chance. (Until 2026-12-07 04:55: 12 documents of
    # ~145 tokens asked twice, where per-request work outweighed the prefix computed: see the results file.)
    "prefix_pressure": ({"documents": 8, "document_sentences": 24, "answer_tokens": 4}, 24),
}


def start(command: str, *flags: str, threads: int) -> ServerProcess:
    """`radixlm <command>` on a free loopback port, its torch threads capped."""
    return ServerProcess(*flags, command=command, env={"OMP_NUM_THREADS": str(threads)}, start_timeout=600)


def _counters(replicas: list[ServerProcess]) -> dict[str, float]:
    keys = ("prompt_tokens_total", "cached_tokens_total", "ttft_sum", "finished_total")
    total = dict.fromkeys(keys, 0.0)
    for r in replicas:
        state = httpx.get(r.url + "/get_server_info", timeout=60).json()["internal_states"][0]
        for k in keys:
            total[k] += state[k]
    return total


def run_one(name: str, url: str, replicas: list[ServerProcess], seed: int) -> dict[str, Any]:
    """One workload through `url`, the replicas' caches flushed first; its figures."""
    workload = WORKLOADS[name]
    size, n = SIZES[name]
    batch = workload.make_args(n, size, random.Random(seed))
    for r in replicas:
        assert httpx.post(r.url + "/flush_cache", timeout=60).status_code == 200
    backend = sgl.RuntimeEndpoint(url, timeout=3600)  # a starved CPU can take long
    before = _counters(replicas)
    start = time.perf_counter()
    workload.run_batch(backend, batch)
    elapsed = time.perf_counter() - start
    after = _counters(replicas)
    d = {k: after[k] - before[k] for k in before}
    return {"instances": n, "seconds": round(elapsed, 2), "throughput": round(n / elapsed, 3),
            "hit_rate": round(d["cached_tokens_total"] / max(d["prompt_tokens_total"], 1), 4),
            "prompt_tokens": int(d["prompt_tokens_total"]),
            "mean_ttft_s": round(d["ttft_sum"] / max(d["finished_total"], 1), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per replica (OMP_NUM_THREADS)")
    parser.add_argument("--max-total-tokens", type=int, default=1024, help="each replica's KV pool (tokens)")
    parser.add_argument("--workloads", nargs="+", default=list(SIZES))
    parser.add_argument("--systems", nargs="+", default=["router", "round_robin", "single"])
    parser.add_argument("--repeats", type=int, default=1, help="runs per workload and system, seeds 0, 1, ... (the "
                        "run of median throughput is reported, with every run's throughput beside it, in seed order)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()

    flags = ["--max-total-tokens", str(args.max_total_tokens), "--log-interval", "0"]
    started: list[ServerProcess] = []
    try:
        for _ in range(args.replicas):
            started.append(start("serve", *flags, threads=args.threads))
        replicas = list(started)
        policies = {"router": "cache_aware", "round_robin": "round_robin"}
        front = {}
        for system in (s for s in args.systems if s in policies):
            # Replicas starved of CPU (a shared machine) answer /health late: a long timeout keeps them in.
            front[system] = start("router", "--worker-urls", *[r.url for r in replicas], "--policy",
                                  policies[system], "--health-check-timeout-secs", "60", "--log-level",
                                  "warning", threads=1)
            started.append(front[system])
        results = measure(args, replicas, front)
    finally:
        for p in started:
            p.stop()
    if args.markdown:
        args.markdown.write_text(markdown(results))


def measure(args: argparse.Namespace, replicas: list[ServerProcess], front: dict[str, ServerProcess]) -> dict[str, Any]:
    results: dict[str, Any] = {
        "machine": {"cpu": cpu_name(), "cores_visible": os.cpu_count(), "threads_per_replica": args.threads,
                    "replicas": args.replicas, "max_total_tokens": args.max_total_tokens,
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
        "workloads": {}}
    for r in replicas:  # warm each replica's first call (kernels, allocator)
        httpx.post(r.url + "/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 2}}, timeout=300)
    # One untimed pass of each workload over all replicas: a replica's first batches of a new size run slow,
    # which would fall on whichever system is measured first.
    warm_url = next((front[s].url for s in ("round_robin", "router") if s in front), replicas[0].url)
    for name in args.workloads:
        run_one(name, warm_url, replicas, seed=1000)
    for name in args.workloads:
        results["workloads"][name] = {}
        for system in args.systems:
            url, counted = (replicas[0].url, replicas[:1]) if system == "single" else (front[system].url, replicas)
            runs = [run_one(name, url, counted, seed) for seed in range(args.repeats)]
            median = sorted(runs, key=lambda r: r["throughput"])[len(runs) // 2]
            results["workloads"][name][system] = {**median, "throughputs": [r["throughput"] for r in runs]}
            print(name, system, results["workloads"][name][system], flush=True)
            if args.out:
                args.out.write_text(json.dumps(results, indent=1))
    return results


def markdown(results: dict[str, Any]) -> str:
    rows = ["| workload | system | hit rate | throughput (programs/s) | throughput by seed | mean TTFT (s) | prompt tokens |",
            "|---|---|---|---|---|---|---|"]
    for name, systems in results["workloads"].items():
        for system, r in systems.items():
            spread = " / ".join(f"{t:.3f}" for t in r.get("throughputs", [r["throughput"]]))
            rows.append(f"| {name} | {system} | {r['hit_rate']:.3f} | {r['throughput']:.3f} | {spread} "
                        f"| {r['mean_ttft_s']:.3f} | {r['prompt_tokens']} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    main()
