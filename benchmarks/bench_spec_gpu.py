"""Speculative decoding on a GPU: the cost of a verify step (each request's newest token and 8 draft
tokens in one extend step, logits at every position) against a decode step, at batch 1, 8 and 64, on
the Llama-3-8B shape (random bf16 weights made on the device); then end-to-end generation at batch 1
on that shape: plain, with `draft` where the draft is the Llama-3.2-1B shape (random bf16 weights too,
so its drafts are nearly all rejected: drafts of a fixed length show what a step costs, the adaptive
policy shows how far it falls back to plain decoding), with the target as its own draft (nearly
every draft kept: the acceptance upper bound), and with a random EAGLE head of the 8B shape (nearly every
draft rejected: its step cost, with CUDA graphs and without, and the step's parts timed one by one: the
head's proposal, the target's verify and decode steps); then greedy equality, speculation off
against on, with ngram, draft and eagle on the tiny test checkpoint in float32 and with ngram and eagle
on the 8B shape in bf16.

    python benchmarks/bench_spec_gpu.py --out spec_gpu.json         # a GPU, about 4 minutes on an H100
    python benchmarks/bench_spec_gpu.py --device cpu                 # a dry run of every path, tiny models
    python benchmarks/bench_spec_gpu.py --eagle-only --out eagle_gpu.json   # plain and eagle at batch 1 alone

Step times are CUDA-event times of the model runner's forward alone (CUDA graphs where the runner
replays them: decode up to cuda_graph_max_bs, extends up to cuda_graph_max_extend_tokens tokens, verify
steps on the decode graphs with a row per token, captured here up to the largest verify step's rows; each
verify step is also timed eagerly, as verify steps ran before, for comparison), each
request with a context of --context tokens, median of --iters after a warm-up. The plain end-to-end
figure is the default engine's (overlap scheduling on, as users get it; speculation turns it off).
End-to-end tokens/s:
--new-tokens greedy tokens (ignore_eos) after each of --prompts random prompts of --prompt-len tokens
(each prompt cached by an untimed run first), one request at a time, from submission to the last token.
From the fixed-length draft runs (nearly nothing kept, so one verify step per token) the report also
projects tokens/s at per-token acceptance rates a draft model of the family would reach: the measured
step time over the expected tokens per step, 1 + a + ... + a^k.
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
from bench_engine import LLAMA3_8B_SHAPE, make_model_dir, random_prompts  # noqa: E402

import radixlm  # noqa: E402
from radixlm.core.runtime.execution.batch_input import BatchInput  # noqa: E402
from radixlm.testing.checkpoints import build_checkpoint, build_tokenizer  # noqa: E402
from radixlm.testing.eagle import build_eagle_head  # noqa: E402

# Llama-3.2-1B's shape (rope scaling left out: the weights are random, only the cost counts).
LLAMA32_1B_SHAPE = {**LLAMA3_8B_SHAPE, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                    "head_dim": 64, "tie_word_embeddings": True}


def step_ms(runner: Any, batch_fn: Any, iters: int) -> float:
    for _ in range(3):
        runner.forward(batch_fn())
    times = []
    for _ in range(iters):
        batch = batch_fn()
        if runner.device.type != "cuda":  # the dry run
            start_s = time.perf_counter()
            runner.forward(batch)
            times.append((time.perf_counter() - start_s) * 1e3)
            continue
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
        graphs = runner.graph_runner
        replayed = graphs is not None and b * (drafts + 1) <= graphs.max_bs
        runner.graph_runner = None  # the eager extend verify steps ran before they replayed the decode graphs
        try:
            eager = step_ms(runner, verify, iters)
        finally:
            runner.graph_runner = graphs
        out.append({"batch": b, "decode_ms": d, "verify_ms": v, "ratio": v / d, "verify_on_graphs": replayed,
                     "verify_eager_ms": eager, "eager_ratio": eager / d})
        print(f"batch {b:3d}: decode {d:7.3f} ms  verify of {drafts} drafts {v:7.3f} ms  x{v / d:.2f} "
              f"({'decode graphs' if replayed else 'eager'}); eager extend {eager:7.3f} ms  x{eager / d:.2f}", flush=True)
    return out


PROMPTS = [list(range(200, 230)) * 3 + [200, 201], [9, 8, 7] * 10, list(range(50, 120))]
PARAMS = {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}


def outputs(e: radixlm.Engine) -> list[list[int]]:
    return [o["output_ids"] for o in e.generate(input_ids=PROMPTS, sampling_params=PARAMS)]


def greedy_equal(path: str, extra: dict[str, Any], label: str, base: list[list[int]],
                 algorithms: tuple[str, ...]) -> dict[str, Any]:
    """Outputs with speculation on (ngram; the target as its own draft; a random EAGLE head), drafting at
    every step whether it pays or not, against `base` (off)."""
    result = {}
    kwargs = {"ngram": {"speculative_ngram_min_match_window_size": 1},
              "draft": {"speculative_draft_model_path": path}}
    if "eagle" in algorithms:
        head = build_eagle_head(tempfile.mkdtemp(prefix="eagle-"), path, embedding=False)
        kwargs["eagle"] = {"speculative_draft_model_path": head}
    for algo in algorithms:
        with radixlm.Engine(path, speculative_algorithm=algo, speculative_num_draft_tokens=8, **kwargs[algo],
                            speculative_adaptive=False, **extra) as e:  # every step drafts
            spec = outputs(e)
            stats = e.get_stats()
        same = [a == b for a, b in zip(base, spec)]
        first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(base, spec)]
        result[algo] = {"equal": same, "first_difference": first_diff, "accept_length": stats["spec_accept_length"],
                        "verify_steps": stats["spec_verify_steps_total"]}
        print(f"{label} {algo}: equal {same} (first difference at {first_diff}), accept length "
              f"{stats['spec_accept_length']:.2f}", flush=True)
    return result


def scheduler(e: radixlm.Engine) -> Any:
    return e.frontend.scheduler.scheduler


def end_to_end(e: radixlm.Engine, label: str, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """Batch-1 tokens/s over the prompts (each cached first), and the speculative counters."""
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    for p in prompts:
        e.generate(input_ids=p, sampling_params={**params, "max_new_tokens": 1})
    tokens, seconds, verify, kept, each = 0, 0.0, 0, 0, []
    for p in prompts:
        start = time.perf_counter()
        meta = e.generate(input_ids=p, sampling_params=params)["meta_info"]
        each.append(time.perf_counter() - start)
        seconds += each[-1]
        tokens += meta["completion_tokens"]
        verify += meta.get("spec_verify_ct", 0)
        kept += meta.get("spec_accepted_tokens", 0)
    out = {"tokens_per_s": tokens / seconds, "tokens": tokens, "verify_steps": verify, "seconds_each": each,
           "accept_length": 1 + kept / verify if verify else 0.0, "seconds_per_verify_step":
           seconds / verify if verify else None}
    print(f"end to end, batch 1, {label:34s}: {out['tokens_per_s']:7.1f} tok/s  verify steps {verify:4d}  "
          f"accept length {out['accept_length']:.2f}  (s each: {', '.join(f'{x:.3f}' for x in each)})", flush=True)
    return out


def add_projection(run: dict[str, Any], drafts: int, rates: tuple[float, ...] = (0.5, 0.6, 0.7, 0.8, 0.9)) -> None:
    """Adds to a fixed-length run (nearly nothing kept: one verify step per token) the tokens/s a proposer
    of its step cost would give at each per-token acceptance rate (see the docstring)."""
    step = run["seconds_per_verify_step"]
    if not step:
        return
    run["projected_tokens_per_s"] = {str(a): sum(a ** j for j in range(drafts + 1)) / step for a in rates}
    print("  projected tok/s at acceptance rate " + "  ".join(
        f"{a}: {v:.1f}" for a, v in run["projected_tokens_per_s"].items()), flush=True)


def draft_runs(target: str, draft: str, opts: dict[str, Any], prompts: list[list[int]], new_tokens: int,
               drafts: int) -> dict[str, Any]:
    """`draft` proposing for `target`: fixed lengths (speculative_adaptive off), then the adaptive policy."""
    spec = {"speculative_algorithm": "draft", "speculative_draft_model_path": draft,
            "speculative_num_draft_tokens": drafts}
    out: dict[str, Any] = {}
    with radixlm.Engine(target, **spec, speculative_adaptive=False, **opts) as e:
        out["fixed"] = end_to_end(e, f"{Path(draft).name} drafts {drafts} fixed", prompts, new_tokens)
    with radixlm.Engine(target, **spec, **opts) as e:
        out["adaptive"] = end_to_end(e, f"{Path(draft).name} drafts {drafts} adaptive", prompts, new_tokens)
    add_projection(out["fixed"], drafts)
    return out


def model_dirs(device: str, root: str) -> tuple[str, str, dict[str, Any]]:
    """The target, the small draft and the target's options: the 8B and 1B shapes (random weights made on
    the device), or on the CPU the tiny test checkpoint and another of its tokenizer."""
    if device == "cpu":
        target, _ = make_model_dir("tiny", root)
        draft = build_checkpoint(os.path.join(root, "tiny-draft"), "llama", tie_word_embeddings=True, seed=1)
        return target, draft, {"dtype": "float32", "device": "cpu", "max_running_requests": 64}
    target, extra = make_model_dir("llama3-8b-shape", root)
    draft = os.path.join(root, "llama3.2-1b-shape")
    build_tokenizer(draft)
    Path(draft, "config.json").write_text(json.dumps(LLAMA32_1B_SHAPE, indent=2))
    return target, draft, {**extra, "max_running_requests": 64, "context_length": 4096}


def speed(args: argparse.Namespace, target: str, draft: str, opts: dict[str, Any]) -> dict[str, Any]:
    """The verify-step costs and the end-to-end batch-1 figures."""
    results: dict[str, Any] = {}
    prompts = random_prompts(args.prompts, args.prompt_len, 1000, seed=0)
    # Decode graphs up to the largest verify step's rows (a row per token), so that every batch replays them.
    graph_rows = max(args.batch) * (args.drafts + 1) if args.device == "cuda" else None
    with radixlm.Engine(target, **opts, max_total_tokens=args.pool_tokens, cuda_graph_max_bs=graph_rows) as e:
        results["verify_cost"] = verify_cost(e._runner, args.batch, args.drafts, args.context, args.iters)
        results["plain"] = end_to_end(e, "plain", prompts, args.new_tokens)
    small = {**opts, "max_total_tokens": 8 * (args.prompt_len + args.new_tokens + 16)}
    results["draft_small"] = draft_runs(target, draft, small, prompts, args.new_tokens, args.e2e_drafts)
    with radixlm.Engine(target, speculative_algorithm="draft", speculative_draft_model_path=target,
                        speculative_num_draft_tokens=args.e2e_drafts, speculative_adaptive=False, **small) as e:
        results["draft_self"] = end_to_end(e, f"target as its own draft {args.e2e_drafts}", prompts, args.new_tokens)
    results.update(eagle_runs(target, small, prompts, args.new_tokens, args.e2e_drafts))
    return results


def step_costs(e: radixlm.Engine, prompt: list[int], new_tokens: int) -> dict[str, Any]:
    """One more greedy run of `prompt` with the proposer's proposals and the target's forwards timed one by
    one (synchronized on a GPU): median ms per proposal (an EAGLE head's catch-up and chain steps), per
    target verify step (logits at every new token) and per target decode step, with their counts."""
    spec = scheduler(e).speculator
    proposer, runner = spec.proposer, spec.executor.runner
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    timed: dict[str, list[float]] = {"propose": [], "target_verify": [], "target_decode": [], "target_other": []}

    def timing(fn: Any, key: Any) -> Any:
        def wrapped(*args: Any) -> Any:
            sync()
            start = time.perf_counter()
            out = fn(*args)
            sync()
            timed[key(*args)].append((time.perf_counter() - start) * 1e3)
            return out
        return wrapped

    proposer.propose = timing(proposer.propose, lambda *_: "propose")
    runner.forward = timing(runner.forward, lambda b: "target_decode" if b.is_decode else
                            "target_verify" if len(b.logit_rows) > len(b.rows) else "target_other")
    try:
        e.generate(input_ids=prompt, sampling_params={"max_new_tokens": new_tokens, "temperature": 0,
                                                      "ignore_eos": True})
    finally:
        del proposer.propose, runner.forward  # the wrappers: instance attributes over the methods
    out = {f"{k}_ms": statistics.median(v) if v else None for k, v in timed.items()}
    out.update({f"{k}_steps": len(v) for k, v in timed.items()})
    print("  step costs (ms, median): " + "  ".join(f"{k} {out[k + '_ms']:.3f} x{out[k + '_steps']}"
                                                    for k in timed if timed[k]), flush=True)
    return out


def step_walls(e: radixlm.Engine, prompt: list[int], new_tokens: int) -> dict[str, Any]:
    """One more greedy run of `prompt`, nothing synchronized: its wall time beside the wall times of the
    speculator's steps (sum, median, longest), of their parts (drafting, with the proposer's proposals in
    it; decode steps; verify steps' model forwards) and the garbage collector's pauses, so that a token's
    time outside the steps (the scheduler loop, delivery, collections) or inside them shows."""
    spec = scheduler(e).speculator
    walls: dict[str, list[float]] = {"step": [], "drafts": [], "propose": [], "run_decode": [], "forward": []}
    targets = {"step": spec, "drafts": spec, "propose": spec.proposer, "run_decode": spec.executor,
               "forward": spec.executor.runner}
    names = {"step": "step", "drafts": "_drafts", "propose": "propose", "run_decode": "run_decode",
             "forward": "forward"}

    def timed(key: str) -> Any:
        fn = getattr(targets[key], names[key])

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                walls[key].append(time.perf_counter() - start)
        return wrapped

    gc_before = sum(scheduler(e).gc_pauses.snapshot()["pause_seconds_total"])
    for key in walls:
        setattr(targets[key], names[key], timed(key))
    try:
        start = time.perf_counter()
        e.generate(input_ids=prompt, sampling_params={"max_new_tokens": new_tokens, "temperature": 0,
                                                      "ignore_eos": True})
        wall = time.perf_counter() - start
    finally:
        for key in walls:  # the wrappers: instance attributes over the methods
            delattr(targets[key], names[key])
    gc_s = sum(scheduler(e).gc_pauses.snapshot()["pause_seconds_total"]) - gc_before
    out: dict[str, Any] = {"wall_ms": wall * 1e3, "gc_pause_ms": gc_s * 1e3}
    for key, times in walls.items():
        out[key] = {"calls": len(times), "sum_ms": sum(times) * 1e3, "max_ms": max(times, default=0.0) * 1e3,
                    "median_ms": statistics.median(times) * 1e3 if times else None}
    print(f"  walls (ms): {out['wall_ms']:.1f} in all, gc pauses {out['gc_pause_ms']:.1f}; " + "; ".join(
        f"{k} x{v['calls']} {v['sum_ms']:.1f} (median {v['median_ms'] or 0:.3f}, longest {v['max_ms']:.3f})"
        for k, v in out.items() if isinstance(v, dict)), flush=True)
    return out


def eagle_runs(target: str, opts: dict[str, Any], prompts: list[list[int]], new_tokens: int,
               steps: int) -> dict[str, Any]:
    """A random EAGLE head of the target's shape (nearly every draft rejected): end to end at batch 1 with
    `steps` drafts a step, on CUDA graphs (the target's decode and verify steps and the head's decode
    steps) and without (disable_cuda_graph, as EAGLE ran before); the step costs of each; and the adaptive
    policy on graphs (how far it falls back to plain decoding)."""
    head = build_eagle_head(os.path.join(os.path.dirname(target), "eagle-head"), target, embedding=False)
    spec = {"speculative_algorithm": "eagle", "speculative_draft_model_path": head, "speculative_num_steps": steps}
    out: dict[str, Any] = {}
    for label, extra in (("eagle_fixed", {"speculative_adaptive": False}),
                         ("eagle_fixed_no_graphs", {"speculative_adaptive": False, "disable_cuda_graph": True}),
                         ("eagle_adaptive", {})):
        with radixlm.Engine(target, **spec, **extra, **opts) as e:
            out[label] = end_to_end(e, f"random EAGLE head, {steps} steps {label[6:]}", prompts, new_tokens)
            out[label]["step_costs"] = step_costs(e, prompts[0], new_tokens)
            out[label]["step_walls"] = step_walls(e, prompts[1 % len(prompts)], new_tokens)
    add_projection(out["eagle_fixed"], steps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--drafts", type=int, default=8, help="draft tokens of the verify-cost steps")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--e2e-drafts", type=int, default=4, help="draft tokens of the end-to-end draft runs")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--pool-tokens", type=int, default=140_000, help="the verify-cost engine's KV pool")
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of every path on tiny checkpoints")
    ap.add_argument("--eagle-only", action="store_true", help="only the batch-1 end-to-end runs: plain, and eagle "
                    "with CUDA graphs and without (their step costs too)")
    args = ap.parse_args()
    if args.device == "cpu":  # small enough for a few seconds a step on a CPU
        args.batch, args.context, args.iters = [1, 8], 64, 3
        args.pool_tokens, args.new_tokens, args.prompt_len = 4096, 24, 32
    root = tempfile.mkdtemp()
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    results: dict[str, Any] = {"device": gpu, "torch": torch.__version__,
                               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "args": vars(args)}
    print(results, flush=True)
    target, draft, opts = model_dirs(args.device, root)
    if args.eagle_only:
        prompts = random_prompts(args.prompts, args.prompt_len, 1000, seed=0)
        small = {**opts, "max_total_tokens": 8 * (args.prompt_len + args.new_tokens + 16)}
        with radixlm.Engine(target, **small) as e:
            results["plain"] = end_to_end(e, "plain", prompts, args.new_tokens)
        with radixlm.Engine(target, **small, enable_overlap_schedule=False) as e:  # as speculation runs
            results["plain_no_overlap"] = end_to_end(e, "plain, overlap scheduling off", prompts, args.new_tokens)
        results.update(eagle_runs(target, small, prompts, args.new_tokens, args.e2e_drafts))
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
        return
    results.update(speed(args, target, draft, opts))
    tiny, _ = make_model_dir("tiny", os.path.join(root, "equality"))
    tiny_opts = {"dtype": "float32", "device": args.device}
    # The baselines run as the speculative engines do, overlap scheduling off (speculation turns it off):
    # in bf16 another batch composition or kernel path flips near-ties of random weights.
    with radixlm.Engine(tiny, **tiny_opts, enable_overlap_schedule=False) as e:
        base = outputs(e)
    results["greedy_tiny_fp32"] = greedy_equal(tiny, tiny_opts, "tiny fp32", base, ("ngram", "draft", "eagle"))
    if args.device != "cpu":
        opts = {**opts, "max_total_tokens": 16_384}
        with radixlm.Engine(target, **opts, enable_overlap_schedule=False) as e:
            base = outputs(e)
        results["greedy_8b_bf16"] = greedy_equal(target, opts, "8B bf16", base, ("ngram", "eagle"))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
