"""Tensor and data parallelism on two GPUs (issue 10), in one run of a few minutes:

    python3 benchmarks/scale_out_check.py --out scale_out.json      # on a machine with 2 GPUs

1. Correctness: greedy tokens of tp=2 (NCCL) and of dp=2 against tp=1 on the tiny test Llama in fp32,
   prompts sharing prefixes so the radix cache is exercised.
2. Llama-3-8B shape (random bf16): batch-1 ms/token and offline throughput (random prompts, the
   throughput workload of bench_engine.py cut to --requests) for tp=1 and tp=2.
3. dp=2 against dp=1 on a prefix-heavy program workload (MMLU 5-shot, every instance in flight at once):
   programs/s and cache hit rate.
Each part runs in a process of its own and prints its result as one JSON line as soon as it has it.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time

import torch

from bench_engine import WORKLOADS as ENGINE_WORKLOADS, make_model_dir, workload  # makes radixlm importable

import radixlm  # noqa: E402
from radixlm.testing.checkpoints import build_checkpoint  # noqa: E402
from workloads import WORKLOADS  # noqa: E402

RESULTS: dict = {}


def report(name: str, value: dict) -> None:
    RESULTS[name] = value
    print(json.dumps({name: value}), flush=True)


def greedy(engine, prompts: list[list[int]], n: int = 24) -> list[list[int]]:
    outs = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": n, "temperature": 0,
                                                               "ignore_eos": True})
    return [o["output_ids"] for o in outs]


def check_correctness() -> None:
    ckpt = build_checkpoint(tempfile.mkdtemp(prefix="radixlm-tp-") + "/tiny", "llama")
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(5, 200, (40,), generator=g).tolist()
    prompts = [shared + torch.randint(5, 200, (int(n),), generator=g).tolist() for n in (3, 17, 60, 1, 120, 9)]
    prompts += [torch.randint(5, 200, (n,), generator=g).tolist() for n in (2, 300)]
    outs = {}
    for name, opts in (("tp1", {}), ("tp2", {"tp_size": 2}), ("dp2", {"dp_size": 2})):
        with radixlm.Engine(ckpt, dtype="float32", **opts) as engine:
            outs[name] = greedy(engine, prompts)
            outs[name + "_again"] = greedy(engine, prompts)  # now from the radix cache
    ref = outs["tp1"]
    report("correctness_fp32", {k: sum(a == b for a, b in zip(v, ref)) for k, v in outs.items()} | {"of": len(ref)})


def llama_8b(tp: int, path: str, opts: dict, requests: int) -> None:
    with radixlm.Engine(path, tp_size=tp, **opts) as engine:
        one = {"max_new_tokens": 128, "temperature": 0, "ignore_eos": True}
        engine.generate(input_ids=[[7] * 32], sampling_params=one)
        t = time.perf_counter()
        engine.generate(input_ids=[[9] * 32], sampling_params=one)
        ms_per_token = (time.perf_counter() - t) / 128 * 1e3
        prompts, out_lens = workload(ENGINE_WORKLOADS["llama3-8b-shape"] | {"n_req": requests}, 128000)
        params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in out_lens]
        t = time.perf_counter()
        engine.generate(input_ids=prompts, sampling_params=params)
        wall = time.perf_counter() - t
    report(f"llama3_8b_tp{tp}", {"batch1_ms_per_token": ms_per_token, "requests": requests,
                                 "throughput_out_tok_s": sum(out_lens) / wall, "wall_s": wall})


def dp_workload(dp: int, path: str, opts: dict, instances: int) -> None:
    w = WORKLOADS["mmlu"]
    batch = w.make_args(instances, w.sizes["gpu"], random.Random("mmlu:0"))
    with radixlm.Engine(path, dp_size=dp, **opts) as engine:
        w.run_batch(engine, batch[:16])  # warm-up
        engine.flush_cache()
        before = engine.get_stats()
        t = time.perf_counter()
        w.run_batch(engine, batch)
        wall = time.perf_counter() - t
        after = engine.get_stats()
    prompt = after["prompt_tokens_total"] - before["prompt_tokens_total"]
    cached = after["cached_tokens_total"] - before["cached_tokens_total"]
    report(f"mmlu_dp{dp}", {"instances": instances, "programs_per_s": instances / wall, "wall_s": wall,
                            "cache_hit_rate": cached / prompt})


STEPS = ("correctness", "tp1", "tp2", "dp1", "dp2")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=400, help="throughput requests per tp size")
    p.add_argument("--instances", type=int, default=512, help="MMLU instances per dp size")
    p.add_argument("--steps", nargs="+", default=list(STEPS), choices=STEPS)
    p.add_argument("--step", choices=STEPS, help=argparse.SUPPRESS)  # one step, in a child process
    p.add_argument("--out")
    args = p.parse_args()
    if args.step:
        run_step(args.step, args)
        return
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, {torch.cuda.device_count()} x "
          f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}", flush=True)
    # Each step in its own process: a tensor-parallel engine needs a process of its own, and every
    # step starts from an empty GPU.
    for step in args.steps:
        child = subprocess.run([sys.executable, __file__, "--step", step, "--requests", str(args.requests),
                                "--instances", str(args.instances)], capture_output=True, text=True)
        lines = [line for line in child.stdout.splitlines() if line.startswith("{")]
        for line in lines:
            print(line, flush=True)
            RESULTS.update(json.loads(line))
        if child.returncode or not lines:
            report(f"error_{step}", {"returncode": child.returncode, "stderr_tail": child.stderr[-1500:]})
        if args.out:
            with open(args.out, "w") as f:
                json.dump(RESULTS, f, indent=1)


def run_step(step: str, args: argparse.Namespace) -> None:
    if step == "correctness":
        check_correctness()
        return
    path, opts = make_model_dir("llama3-8b-shape", tempfile.mkdtemp(prefix="radixlm-8b-"))
    if step.startswith("tp"):
        llama_8b(int(step[2:]), path, opts, args.requests)
    else:
        dp_workload(int(step[2:]), path, opts, args.instances)


if __name__ == "__main__":
    main()
