"""Speculative decoding on a GPU: the cost of a verify step (each request's newest token and 8 draft
tokens in one extend step, logits at every position) against a decode step, at batch 1, 8 and 64, on
the Llama-3-8B shape (random bf16 weights made on the device); then greedy equality, speculation off
against on, with the ngram proposer and with the draft proposer (the target as its own draft, so that
drafts are accepted), on the tiny test checkpoint in float32 and on the 8B shape in bf16.

    python benchmarks/bench_spec_gpu.py --out spec_gpu.json

Step times are CUDA-event times of the model runner's forward alone (CUDA graphs where the runner
replays them: decode up to cuda_graph_max_bs, extends up to cuda_graph_max_extend_tokens tokens), each
request with a context of --context tokens, median of --iters after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import make_model_dir  # noqa: E402

import radixlm  # noqa: E402
from radixlm.core.runtime.execution.batch_input import BatchInput  # noqa: E402


def step_ms(runner: Any, batch_fn: Any, iters: int) -> float:
    for _ in range(3):
        runner.forward(batch_fn())
    times = []
    for _ in range(iters):
        batch = batch_fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        runner.forward(batch)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def verify_cost(runner: Any, batch_sizes: list[int], drafts: int, context: int, iters: int) -> list[dict[str, Any]]:
    rows = [runner.req_to_token.alloc() for _ in range(max(batch_sizes))]
    span = context + drafts + 1
    for i, row in enumerate(rows):  # each request's positions on its own slots
        runner.req_to_token.write(row, 0, list(range(1 + i * span, 1 + (i + 1) * span)))
    out = []
    for b in batch_sizes:
        def decode() -> BatchInput:
            return BatchInput(True, [7] * b, [context] * b, [1 + i * span + context for i in range(b)], rows[:b],
                              [context + 1] * b, [1] * b, list(range(b)))

        def verify() -> BatchInput:
            n = drafts + 1
            batch = BatchInput(False, [7] * (b * n), [], [], rows[:b], [context + n] * b, [n] * b,
                               list(range(b * n)))
            for i in range(b):
                batch.positions.extend(range(context, context + n))
                batch.out_cache_loc.extend(range(1 + i * span + context, 1 + i * span + context + n))
            return batch

        d, v = step_ms(runner, decode, iters), step_ms(runner, verify, iters)
        out.append({"batch": b, "decode_ms": d, "verify_ms": v, "ratio": v / d})
        print(f"batch {b:3d}: decode {d:7.3f} ms  verify of {drafts} drafts {v:7.3f} ms  x{v / d:.2f}", flush=True)
    return out


PROMPTS = [list(range(200, 230)) * 3 + [200, 201], [9, 8, 7] * 10, list(range(50, 120))]
PARAMS = {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}


def outputs(e: radixlm.Engine) -> list[list[int]]:
    return [o["output_ids"] for o in e.generate(input_ids=PROMPTS, sampling_params=PARAMS)]


def greedy_equal(path: str, extra: dict[str, Any], label: str, base: list[list[int]],
                 algorithms: tuple[str, ...]) -> dict[str, Any]:
    """Outputs with speculation on (ngram; the target as its own draft) against `base` (off)."""
    result = {}
    kwargs = {"ngram": {"speculative_ngram_min_match_window_size": 1},
              "draft": {"speculative_draft_model_path": path}}
    for algo in algorithms:
        with radixlm.Engine(path, speculative_algorithm=algo, speculative_num_draft_tokens=8, **kwargs[algo],
                            **extra) as e:
            spec = outputs(e)
            stats = e.get_stats()
        same = [a == b for a, b in zip(base, spec)]
        first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(base, spec)]
        result[algo] = {"equal": same, "first_difference": first_diff, "accept_length": stats["spec_accept_length"],
                        "verify_steps": stats["spec_verify_steps_total"]}
        print(f"{label} {algo}: equal {same} (first difference at {first_diff}), accept length "
              f"{stats['spec_accept_length']:.2f}", flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--drafts", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda", help="cpu: only the tiny model's equality (a dry run)")
    args = ap.parse_args()
    root = tempfile.mkdtemp()
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    results: dict[str, Any] = {"device": gpu, "torch": torch.__version__,
                               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(results, flush=True)
    tiny, _ = make_model_dir("tiny", root)
    tiny_opts = {"dtype": "float32", "device": args.device}
    with radixlm.Engine(tiny, **tiny_opts) as e:
        base = outputs(e)
    results["greedy_tiny_fp32"] = greedy_equal(tiny, tiny_opts, "tiny fp32", base, ("ngram", "draft"))
    if args.device == "cpu":  # a dry run of the script's paths
        print(results)
        return
    path, extra = make_model_dir("llama3-8b-shape", root)
    opts = {**extra, "max_running_requests": 64, "context_length": 4096, "max_total_tokens": 140_000}
    with radixlm.Engine(path, **opts) as e:
        results["verify_cost"] = verify_cost(e._runner, args.batch, args.drafts, args.context, args.iters)
        base = outputs(e)
    results["greedy_8b_bf16"] = greedy_equal(path, opts, "8B bf16", base, ("ngram",))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
