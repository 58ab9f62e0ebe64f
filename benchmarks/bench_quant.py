"""Quantized weights against the unquantized model, side by side in one run (docs/quantization.md).

    python benchmarks/bench_quant.py --engine --sweep-gemv --out-dir OUT      # the GPU: the 8B shape
    python benchmarks/bench_quant.py --accuracy --model-path M [--quantization fp8] [--cpu]
    python benchmarks/bench_quant.py --engine --model tiny --cpu               # the script's logic, seconds

--engine: benchmarks/bench_engine.py on the Llama-3-8B shape (random weights made on the device) once
per variant (bf16, then each of --variants: fp8, ...), in this process one after another with the same
options (overlap scheduling on, admissions of 64): batch-1 decode ms/token, 16 x 1024 prefill TFLOP/s,
the 1,000-request offline set, the weights' GiB and the KV tokens that fit.
--sweep-gemv: first times the fp8 and the 4-bit decode GEMVs' launch shapes on the 8B projections at one
row (4-bit: groups of 128, and groups of 32 on SmolLM2's projections; the fp32 path and the packed
path, decode_gemv.INT4_PACKED, each at every candidate, every output checked against the twin)
and keeps the fastest for the engine runs (decode_gemv.CONFIGS_FP8, decode_gemv.CONFIGS_INT4, the packed
path where it takes less time over the four 8B projections), beside the bf16 GEMV on the same shape.
--int4-paths (with --engine): each 4-bit variant runs twice, on the fp32 and on the packed path.
--accuracy: the quantized model against the unquantized one on real text (this repository's README,
the first --steps tokens, teacher-forced): mean |delta logprob| of each next token and top-1 agreement;
then greedy continuations of the quick start's six questions and of the text's first 32 tokens
(--steps tokens long), compared token by token.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

import radixlm

_HERE = Path(__file__).resolve().parent
QUESTIONS = ["What is the capital of France?", "What is the capital of Japan?", "How many legs does a spider have?",
             "What is 12 plus 7?", "What is the largest ocean on Earth?", "Which planet is known as the Red Planet?"]
SYSTEM = ("You are a concise assistant for a geography and general-knowledge quiz. Answer each question "
          "in one short sentence.")
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
OPS = ["scaled", "residual", "scaled", "silu"]  # the fused GEMV each of qkv, o, gate_up, down takes (_int4_op)
CANDIDATES = [(4, 1024, 4, 3), (8, 1024, 4, 3), (4, 2048, 4, 3), (8, 2048, 8, 3), (4, 4096, 8, 3), (16, 1024, 8, 3)]
# SmolLM2-135M's projections (qkv, o, gate_up, down), whose GGUF Q4_0/Q4_1 run in groups of 32 on CUDA.
SMOL_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
# The 4-bit GEMV's (BLOCK_N, BLOCK_K columns, a multiple of 32, warps, stages). The one-row product keeps
# its weight tile's layout only where the activation slices (BLOCK_K / 8 values) are fewer than the lanes
# (32 x warps): BLOCK_K < 256 x warps. Stages 1: its register prefetch, a step ahead (every shape's winner on
# the fp32 path on one H100, session 5). x's preparation (scale, fp16 pairs, their sums) is shared by the
# rows a lane holds: 64-row shapes hold 8 (sm_90 loop 3.0 instructions a weight), 32-row ones 4 (3.65).
# Each compiles three variants (scaled, residual, SiLU).
INT4_CANDIDATES = [(32, 512, 4, 1), (32, 1024, 8, 1), (64, 512, 4, 1), (64, 1024, 8, 1), (64, 256, 2, 1),
                          (16, 512, 4, 1), (32, 256, 2, 1), (16, 256, 2, 1), (8, 256, 2, 1)]
# Each path's fastest launch shape by (rows, N, K), filled by the sweep (_int4_sweep): False the fp32 path, True
# the packed one.
INT4_WINNERS: dict[bool, dict[tuple[int, int, int], tuple[int, ...]]] = {False: {}, True: {}}
# Each path's SiLU route for the down projection (decode_gemv.INT4_FUSED_SILU): the packed one's measured by
# the sweep, the fp32 one's as installed.
INT4_SILU_INSIDE: dict[bool, bool] = {}


def _bench_engine():
    spec = importlib.util.spec_from_file_location("bench_engine", _HERE / "bench_engine.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _time_cuda(fn, iters: int = 200, per_graph: int = 20) -> float:
    """Microseconds per call of `fn`, replayed from a CUDA graph of `per_graph` calls: a decode GEMV takes
    10-60 us on the GPU, about what a Triton launch costs the host, so launches timed one by one would
    measure the host (as the engine's decode steps, which replay graphs, do not)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compiles and warms outside the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters // per_graph):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (iters // per_graph * per_graph) * 1e3


def _sweep(fn, env: str, candidates: list[tuple[int, ...]], label: str, error=None) -> dict[tuple[int, ...], float]:
    """Microseconds of `fn` under each launch shape, set through the kernel's override variable `env`; with
    `error` (fn's output -> its relative error against a twin), shapes whose output is off by more than
    2e-2 (bf16 outputs round at 4e-3; a wrong kernel is off by O(1)) are reported and left out."""
    timed = {}
    for cfg in candidates:
        os.environ[env] = ",".join(map(str, cfg))
        try:
            us = _time_cuda(fn)
            err = error(fn()) if error else 0.0
            if err > 2e-2:
                print(f"  {label} {cfg}: WRONG, relative error {err:.3g} against the twin: left out", flush=True)
            else:
                timed[cfg] = us
        except Exception as exc:  # a shape the compiler refuses (registers, shared memory)
            print(f"  {label} {cfg}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    os.environ.pop(env, None)
    return timed


def _int4_op(x: torch.Tensor, int4: tuple, op: str):
    """The fused decode GEMV a projection takes in the engine at batch 1, on a 4-bit weight: `scaled` (qkv,
    gate_up: rms_scaled_gemv; qkv's rotary epilogue aside), `residual` (o_proj) or `silu` (down_proj:
    SiLU-and-mul of [gate | up] first, then the residual epilogue). Returns it, and its output's relative
    error against the twin's (kernels/reference.py)."""
    from radixlm.kernels import reference as ref
    from radixlm.kernels import triton as tri

    packed, scales, zeros = int4
    n, k = packed.shape[0], x.shape[1]
    if op == "scaled":
        sums = torch.rand(1, 8, device="cuda") * k
        args = (x, sums, 1e-6, packed, None, scales, zeros)
        fn, want = (lambda: tri.rms_scaled_gemv(*args)), ref.rms_scaled_gemv(*args).float()
    else:
        residual, norm_w = torch.randn(1, n, device="cuda", dtype=x.dtype), torch.ones(n, device="cuda", dtype=x.dtype)
        xs = torch.cat([x, x], dim=1) if op == "silu" else x
        kwargs = dict(silu=op == "silu", weight_scale=scales, weight_zero=zeros)
        fn = lambda: tri.residual_gemv(xs, packed, residual, norm_w, **kwargs)[0]  # noqa: E731 (the residual stream)
        want = ref.residual_gemv(xs, packed, residual, norm_w, **kwargs)[0].float()
    return fn, lambda got: ((got.float() - want).abs().max() / want.abs().max()).item()


def _int4_sweep(x: torch.Tensor, w: torch.Tensor, group: int, op: str, candidates: list[tuple[int, ...]],
                label: str) -> dict[str, Any]:
    """The 4-bit GEMV on one projection, timed as the engine runs it (`_int4_op`): the fp32 path at its
    candidates, then the packed path (decode_gemv.INT4_PACKED) at each; each path's fastest goes into INT4_WINNERS, with its GB/s of nibbles and of all it reads
    (nibbles, fp32 scales and zeros). Shapes whose output strays from the twin's are left out."""
    from radixlm.kernels.quant_reference import quantize_int4_rows
    from radixlm.kernels.triton import decode_gemv

    n, k = w.shape
    int4 = quantize_int4_rows(w, group)
    out: dict[str, Any] = {"int4_op": op}
    packed_before = decode_gemv.INT4_PACKED
    for packed in (False, True):
        decode_gemv.INT4_PACKED = packed
        path = "packed" if packed else "fp32"
        fn, error = _int4_op(x, int4, op)
        timed = _sweep(fn, "RADIXLM_GEMV_CONFIG", candidates, f"int4 {label} {path}", error=error)
        if not timed:
            continue
        best = min(timed, key=timed.get)
        INT4_WINNERS[packed][(1, n, k)] = best
        us = timed[best]
        print(f"  int4 {label} ({op}, {path}): " + ", ".join(f"{c} {t:.1f}" for c, t in
                                                            sorted(timed.items(), key=lambda i: i[1])), flush=True)
        out[path] = {"us": us, "config": list(best), "GBps": n * k / 2 / us / 1e3,
                     "total_GBps": (n * k / 2 + 8 * n * k / group) / us / 1e3,
                     "all_us": {",".join(map(str, c)): t for c, t in timed.items()}}
    if op == "silu" and "packed" in out:  # the other SiLU route (inside the product, or silu_and_mul first)
        best = tuple(out["packed"]["config"])
        fused = decode_gemv.INT4_FUSED_SILU
        decode_gemv.INT4_FUSED_SILU = not fused
        fn, error = _int4_op(x, int4, op)
        other = _sweep(fn, "RADIXLM_GEMV_CONFIG", [best], f"int4 {label}", error=error)
        decode_gemv.INT4_FUSED_SILU = fused
        us = out["packed"]["us"]
        inside, first = (us, other.get(best)) if fused else (other.get(best), us)
        print(f"  int4 {label} (packed): SiLU inside {inside or float('nan'):.1f} us, silu_and_mul first "
              f"{first or float('nan'):.1f} us", flush=True)
        out.update({"int4_silu_inside_us": inside, "int4_silu_first_us": first})
    decode_gemv.INT4_PACKED = packed_before
    return out


def _install_int4_path(packed: bool) -> None:
    """decode_gemv's 4-bit state for one path: INT4_PACKED and that path's sweep winners in CONFIGS_INT4."""
    from radixlm.kernels.triton import decode_gemv

    INT4_SILU_INSIDE.setdefault(False, decode_gemv.INT4_FUSED_SILU)
    decode_gemv.INT4_PACKED = packed
    decode_gemv.CONFIGS_INT4.update(INT4_WINNERS[packed])
    decode_gemv.INT4_FUSED_SILU = INT4_SILU_INSIDE.get(packed, INT4_SILU_INSIDE[False])


def _int4_gemm_times(w: torch.Tensor) -> dict[str, Any]:
    """The 4-bit product at more rows than the GEMV takes (groups of 128): the Triton GEMM at 16 and 128
    rows, the dequantize-then-cuBLAS path at 1,024, each beside cuBLAS on the bf16 weight, in TFLOP/s."""
    from radixlm.kernels import triton as tri
    from radixlm.kernels.quant_reference import quantize_int4_rows

    int4, out = quantize_int4_rows(w, 128), {}
    for m in (16, 128, 1024):
        x = torch.randn(m, w.shape[1], device="cuda", dtype=torch.bfloat16)
        int4_us = _time_cuda(lambda: tri.int4_linear(x, *int4), iters=40)
        bf16_us = _time_cuda(lambda: x @ w.t(), iters=40)
        out[m] = {"int4_us": int4_us, "bf16_us": bf16_us, "int4_TFLOPs": 2 * m * w.numel() / int4_us / 1e6,
                  "bf16_TFLOPs": 2 * m * w.numel() / bf16_us / 1e6}
    return out


def sweep_gemv(int4_candidates: list[tuple[int, ...]]) -> dict[str, Any]:
    """At one row, on the 8B projections: the fastest fp8 GEMV launch shape (installed in CONFIGS_FP8) and
    4-bit GEMV shape (timed as the fused op the engine runs it in) at groups of 128 (AWQ/GPTQ; installed
    in decode_gemv.CONFIGS_INT4), beside the bf16 GEMV on its own tuned shape, each with its bandwidth;
    then the 4-bit GEMV at groups of 32 on SmolLM2's projections (GGUF Q4_0/Q4_1 on CUDA). Prints the
    4-bit winners as CONFIGS_INT4 entries. Also the 4-bit product at 16, 128 and 1,024 rows against
    cuBLAS (`_int4_gemm_times`)."""
    from radixlm.kernels import triton as tri
    from radixlm.kernels.quant_reference import quantize_fp8_rows
    from radixlm.kernels.triton import decode_gemv

    results = {}
    for (n, k), op in zip(SHAPES, OPS):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        wq, ws = quantize_fp8_rows(w)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        bf16_us = _time_cuda(lambda: tri.gemv(x, w))
        timed = _sweep(lambda: tri.gemv(x, wq, None, ws), "RADIXLM_GEMV_CONFIG", CANDIDATES, f"fp8 {n}x{k}")
        best = min(timed, key=timed.get)
        decode_gemv.CONFIGS_FP8[(1, n, k)] = best
        int4 = _int4_sweep(x, w, 128, op, int4_candidates, f"{n}x{k}")
        gemm = _int4_gemm_times(w)
        results[f"{n}x{k}"] = {"bf16_us": bf16_us, "bf16_GBps": 2 * n * k / bf16_us / 1e3, "fp8_us": timed[best],
                               "fp8_config": list(best), "fp8_GBps": n * k / timed[best] / 1e3, **int4,
                               "int4_gemm": gemm, "all_fp8_us": {",".join(map(str, c)): t for c, t in timed.items()}}
        print(f"gemv {n}x{k}: bf16 {bf16_us:.1f} us ({2 * n * k / bf16_us / 1e3:.0f} GB/s), fp8 {timed[best]:.1f} us "
              f"with {best} ({n * k / timed[best] / 1e3:.0f} GB/s), int4 g128 ({op}) " + ", ".join(
                  f"{path} {r['us']:.1f} us with {tuple(r['config'])} ({r['GBps']:.0f} GB/s of nibbles)"
                  for path, r in int4.items() if path in ("fp32", "packed")) + "; 4-bit at 16/128/1024 rows: " +
              ", ".join(f"{g['int4_TFLOPs']:.0f} vs bf16 {g['bf16_TFLOPs']:.0f} TFLOP/s" for g in gemm.values()),
              flush=True)
    # The packed path where it takes less time over the four projections, with its SiLU route.
    eight_b = [results[f"{n}x{k}"] for n, k in SHAPES]
    packed = all("packed" in r and "fp32" in r for r in eight_b) and (
        sum(r["packed"]["us"] for r in eight_b) < sum(r["fp32"]["us"] for r in eight_b))
    down = eight_b[-1]  # the 8B down projection decides the packed path's SiLU route
    INT4_SILU_INSIDE.setdefault(False, decode_gemv.INT4_FUSED_SILU)
    if down.get("int4_silu_inside_us") and down.get("int4_silu_first_us"):
        INT4_SILU_INSIDE[True] = down["int4_silu_inside_us"] <= down["int4_silu_first_us"]
    for (n, k), op in zip(SMOL_SHAPES, OPS):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        bf16_us = _time_cuda(lambda: tri.gemv(x, w))
        int4 = _int4_sweep(x, w, 32, op, int4_candidates, f"g32 {n}x{k}")
        results[f"g32_{n}x{k}"] = {"bf16_us": bf16_us, **int4}
        print(f"gemv {n}x{k} (SmolLM2): bf16 {bf16_us:.1f} us, int4 g32 ({op}) " + ", ".join(
            f"{path} {r['us']:.1f} us with {tuple(r['config'])}" for path, r in int4.items()
            if path in ("fp32", "packed")), flush=True)
    _install_int4_path(packed)
    results["int4_packed"] = packed
    print("decode_gemv.CONFIGS_INT4 = {" + ", ".join(f"{key}: {cfg}" for key, cfg in
                                                     decode_gemv.CONFIGS_INT4.items()) + "}", flush=True)
    print(f"decode_gemv.INT4_FUSED_SILU = {decode_gemv.INT4_FUSED_SILU}", flush=True)
    print(f"decode_gemv.INT4_PACKED = {decode_gemv.INT4_PACKED}", flush=True)
    return results


def ncu_gemv() -> None:
    """One launch each of the 4-bit GEMV (the fused RMS-scaled product on 28,672 x 4,096, groups of 128,
    its installed launch shape) and the fp8 GEMV on the same product, after a warm-up, between
    cudaProfilerStart and Stop: for `ncu --profile-from-start off` (benchmarks/run_h200.sh RUN_NCU_GEMV):
    where the 4-bit one stalls, at what occupancy and issue rate."""
    from radixlm.kernels import triton as tri
    from radixlm.kernels.quant_reference import quantize_fp8_rows, quantize_int4_rows

    n, k = 28672, 4096
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    sums = torch.rand(1, 8, device="cuda") * k
    wq, ws = quantize_fp8_rows(w)
    runs = [_int4_op(x, quantize_int4_rows(w, 128), "scaled")[0],
            lambda: tri.rms_scaled_gemv(x, sums, 1e-6, wq, None, ws)]
    for fn in runs:  # compiled and warm outside the profiled range
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for fn in runs:
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def run_engines(args: argparse.Namespace) -> dict[str, Any]:
    bench = _bench_engine()
    out: dict[str, Any] = {}
    for spec in ["bf16", *args.variants]:
        label, _, parts = spec.partition(":")
        variant = label.removesuffix("-kv8")  # "-kv8": the same weights over an fp8 (e4m3) KV cache
        path = os.path.join(args.out_dir, f"bench_quant_{label}.json")
        argv = ["--model", args.model, "--no-hf", "--overlap", "--parts", *(parts.split(",") if parts else args.parts),
                "--out", path,
                "--engine-option", "schedule_admission_batch=64", *(["--cpu"] if args.cpu else [])]
        if variant != "bf16":
            argv += ["--engine-option", f"quantization={variant}"]
        if label != variant:
            argv += ["--engine-option", "kv_cache_dtype=fp8_e4m3"]
        if args.requests:
            argv += ["--requests", str(args.requests)]
        if args.profile_prefill:
            argv += ["--profile-prefill", str(args.profile_prefill)]
        # A 4-bit variant with --int4-paths runs once on each path of the one-row product (fp32, packed).
        paths = (False, True) if args.int4_paths and variant in ("awq", "gptq") else (None,)
        for packed in paths:
            name = label if packed is None else f"{label} ({'packed' if packed else 'fp32'} GEMV)"
            if packed is not None:
                _install_int4_path(packed)
            print(f"== {name}: bench_engine {' '.join(argv)}", flush=True)
            bench.main(argv)
            with open(path) as f:
                out[name] = json.load(f)
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return out


def table(results: dict[str, Any]) -> str:
    rows = ["| weights | batch-1 decode ms/token | prefill 16x1024 TFLOP/s | offline out tok/s | weights GiB | "
            "KV tokens | peak GiB |", "|---|---|---|---|---|---|---|"]
    for variant, r in results.items():
        ours, mem = r.get("radixlm", {}), r.get("memory", {})

        def get(part, key, fmt):
            value = (ours.get(part) or {}).get(key)
            return "-" if value is None else format(value, fmt)
        rows.append(f"| {variant} | {get('latency', 'ms_per_token', '.2f')} | {get('prefill', 'tflops', '.0f')} | "
                    f"{get('throughput', 'output_tok_s', ',.0f')} | {mem.get('weights_gib', float('nan')):.2f} | "
                    f"{r['engine']['kv_pool_tokens']:,} | {mem.get('peak_used_gib', float('nan')):.1f} |")
    return "\n".join(rows)


# ---- accuracy on real text --------------------------------------------------------------------------

def real_text_ids(tokenizer, steps: int) -> list[int]:
    text = (_HERE.parent / "README.md").read_text()
    ids = tokenizer(text)["input_ids"]
    if len(ids) < steps + 1:
        raise SystemExit(f"README.md has {len(ids)} tokens, fewer than --steps {steps} + 1")
    return ids[: steps + 1]


def run_model(path: str | None, options: dict[str, Any], steps: int) -> dict[str, Any]:
    with radixlm.Engine(path, log_level="warning", max_total_tokens=16384, **options) as engine:
        tok = engine.tokenizer
        ids = real_text_ids(tok, steps)
        scored = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0},
                                 return_logprob=True, logprob_start_len=0, top_logprobs_num=1)
        meta = scored["meta_info"]
        prompts = [tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                                           tokenize=False, add_generation_prompt=True) for q in QUESTIONS]
        answers = [o["text"] for o in engine.generate(prompts, {"max_new_tokens": 32, "temperature": 0})]
        free = engine.generate(input_ids=ids[:32], sampling_params={"max_new_tokens": steps, "temperature": 0,
                                                                    "ignore_eos": True})["output_ids"]
    return {"logprobs": [lp for lp, _, _ in meta["input_token_logprobs"][1:]],
            "top1": [top[0][1] for top in meta["input_top_logprobs"][1:]], "answers": answers, "free": free}


def accuracy(args: argparse.Namespace) -> dict[str, Any]:
    base_opts = {"device": "cpu"} if args.cpu else {}
    quant_opts = {**base_opts, **dict(kv.split("=", 1) for kv in args.quant_option)}
    t0 = time.perf_counter()
    base = run_model(args.model_path, base_opts, args.steps)
    quant = run_model(args.model_path, quant_opts, args.steps)
    delta = torch.tensor(base["logprobs"]) - torch.tensor(quant["logprobs"])
    equal_prefix = next((i for i, (a, b) in enumerate(zip(base["free"], quant["free"])) if a != b), len(base["free"]))
    result = {"steps": args.steps, "options": quant_opts, "mean_abs_dlogprob": float(delta.abs().mean()),
              "max_abs_dlogprob": float(delta.abs().max()),
              "top1_agreement": sum(a == b for a, b in zip(base["top1"], quant["top1"])) / len(base["top1"]),
              "greedy_equal_prefix": equal_prefix,
              "greedy_equal_tokens": sum(a == b for a, b in zip(base["free"], quant["free"])),
              "quick_start_answers_equal": sum(a == b for a, b in zip(base["answers"], quant["answers"])),
              "answers": {"unquantized": base["answers"], "quantized": quant["answers"]},
              "seconds": time.perf_counter() - t0}
    print(f"{args.steps} steps of README text, {quant_opts} vs unquantized: mean |dlogprob| "
          f"{result['mean_abs_dlogprob']:.4f} (max {result['max_abs_dlogprob']:.3f}), top-1 agreement "
          f"{result['top1_agreement']:.1%}; greedy continuation equal for {equal_prefix} of {args.steps} tokens "
          f"({result['greedy_equal_tokens']} equal in all); quick start answers equal "
          f"{result['quick_start_answers_equal']} of 6", flush=True)
    for a, b in zip(base["answers"], quant["answers"]):
        print(f"  {a!r}\n  {'==' if a == b else '!='} {b!r}", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", action="store_true", help="engine benchmarks, bf16 then each variant")
    p.add_argument("--sweep-gemv", action="store_true", help="time fp8 and 4-bit GEMV launch shapes first (CUDA)")
    p.add_argument("--int4-configs", nargs="+", metavar="BN,BK,WARPS,STAGES",
                   help="--sweep-gemv: the 4-bit GEMV's candidates for both paths, BLOCK_K in columns "
                   "(default: INT4_CANDIDATES)")
    p.add_argument("--accuracy", action="store_true", help="the quantized model against the unquantized on text")
    p.add_argument("--ncu-gemv", action="store_true", help="one 4-bit and one fp8 GEMV launch for Nsight Compute")
    p.add_argument("--model", default="llama3-8b-shape", help="bench_engine's model (--engine)")
    p.add_argument("--variants", nargs="+", default=["fp8"],
                   help="quantization values to run beside bf16, each optionally NAME:PART,PART (its parts); "
                        "NAME-kv8 runs NAME over an fp8 (e4m3) KV cache (bf16-kv8: unquantized weights)")
    p.add_argument("--parts", nargs="+", default=["latency", "prefill", "throughput"])
    p.add_argument("--int4-paths", action="store_true",
                   help="--engine: run each 4-bit variant on the fp32 and on the packed one-row product")
    p.add_argument("--requests", type=int, help="offline requests (default: bench_engine's 1,000)")
    p.add_argument("--profile-prefill", type=int, default=0, metavar="N",
                   help="also print each variant's N longest kernels of a prefill forward (CUDA)")
    p.add_argument("--model-path", help="--accuracy: the model (default: the embedded SmolLM2)")
    p.add_argument("--quant-option", action="append", default=[], metavar="KEY=VALUE",
                   help="--accuracy: the quantized run's Engine options (e.g. quantization=fp8)")
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--out-dir", default=".")
    args = p.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                              "device": torch.cuda.get_device_name() if torch.cuda.is_available() and not args.cpu
                              else "cpu"}
    if args.ncu_gemv:
        ncu_gemv()
    if args.sweep_gemv:
        int4 = [tuple(int(v) for v in c.split(",")) for c in args.int4_configs or []] or INT4_CANDIDATES
        report["gemv"] = sweep_gemv(int4)
    if args.engine:
        report["engine"] = run_engines(args)
        print(f"\n{report['device']}, {args.model}:\n" + table(report["engine"]), flush=True)
    if args.accuracy:
        report["accuracy"] = accuracy(args)
    with open(os.path.join(args.out_dir, "bench_quant.json"), "w") as f:
        json.dump(report, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
