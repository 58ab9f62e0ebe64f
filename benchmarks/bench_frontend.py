"""The cost of the request path (front end, messages, detokenizing) on the CPU, where the tiny model makes
the model's own time small and the path's overhead shows.

    python benchmarks/bench_frontend.py                                   # this checkout
    python benchmarks/bench_frontend.py --baseline /tmp/radixlm-main      # and another, alternating

Workloads, greedy on the 2-layer test checkpoint (testing.checkpoints), ignore_eos:
- short: 512 requests of 8-token prompts and 16 output tokens, submitted as one batch; output tokens/s.
- stream: one request streaming 1000 tokens; output tokens/s as the consumer receives them.
- streams: 32 concurrent async streams of 64 tokens each; output tokens/s.
Each workload runs `--rounds` times per checkout; with --baseline the checkouts alternate round by
round (each in its own process, so neither warms the other) and the medians are reported.
`--process` adds the same workloads with scheduler_process=True (this checkout only).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

GREEDY = {"temperature": 0, "ignore_eos": True}


def run_workloads(model_dir: str, options: dict[str, Any]) -> dict[str, float]:
    import torch

    import radixlm

    torch.set_num_threads(2)
    results = {}
    with radixlm.Engine(model_dir, max_total_tokens=16384, **options) as engine:
        engine.generate("warm up", {**GREEDY, "max_new_tokens": 4})
        prompts = [[1 + (i * 7 + j) % 200 for j in range(8)] for i in range(512)]
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 16})
        results["short_tok_s"] = sum(len(o["output_ids"]) for o in outs) / (time.perf_counter() - t0)

        t0 = time.perf_counter()
        n = sum(len(c["output_ids"]) for c in engine.generate("A long story", {**GREEDY, "max_new_tokens": 1000},
                                                                 stream=True))
        results["stream_tok_s"] = n / (time.perf_counter() - t0)

        async def streams() -> int:
            async def one(i: int) -> int:
                it = await engine.async_generate(input_ids=[1 + i, 2, 3], sampling_params={**GREEDY, "max_new_tokens": 64},
                                                 stream=True)
                return sum([len(c["output_ids"]) async for c in it])
            return sum(await asyncio.gather(*(one(i) for i in range(32))))

        t0 = time.perf_counter()
        n = asyncio.run(streams())
        results["streams_tok_s"] = n / (time.perf_counter() - t0)
    return results


def _round(code_dir: str | None, model_dir: str, options: dict[str, Any]) -> dict[str, float]:
    """One round in a fresh process, importing radixlm from code_dir (None: the installed one)."""
    env = dict(os.environ)
    if code_dir is not None:  # a folder holding `radixlm` (a link to the other checkout) goes first
        env["PYTHONPATH"] = code_dir + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, __file__, "--one-round", model_dir, "--options", json.dumps(options)]
    done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    print(next(line for line in done.stderr.splitlines() if line.startswith("radixlm from")), file=sys.stderr)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", help="another checkout of the repository to compare with")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--process", action="store_true", help="also run with scheduler_process=True")
    p.add_argument("--one-round", metavar="MODEL_DIR", help=argparse.SUPPRESS)
    p.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one_round:
        import radixlm

        print(f"radixlm from {os.path.dirname(radixlm.__file__)}", file=sys.stderr)
        print(json.dumps(run_workloads(args.one_round, json.loads(args.options))))
        return
    from radixlm.testing.checkpoints import build_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_checkpoint(os.path.join(tmp, "tiny"), "llama")
        setups: dict[str, tuple[str | None, dict[str, Any]]] = {"this": (None, {})}
        if args.baseline:
            link_dir = os.path.join(tmp, "baseline")
            os.makedirs(link_dir)
            os.symlink(os.path.abspath(args.baseline), os.path.join(link_dir, "radixlm"))
            setups["baseline"] = (link_dir, {})
        if args.process:
            setups["this, scheduler_process"] = (None, {"scheduler_process": True})
        rounds: dict[str, list[dict[str, float]]] = {name: [] for name in setups}
        for _ in range(args.rounds):
            for name, (code_dir, options) in setups.items():
                rounds[name].append(_round(code_dir, model_dir, options))
        report = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in rounds.items()}
        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
