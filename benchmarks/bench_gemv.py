"""Decode GEMVs on the Llama-3-8B shapes (CUDA only): cuBLAS (F.linear) against the Triton GEMV
(kernels/triton/decode_gemv.py) over a sweep of launch shapes, then the fused prologues against the launch
sequences they replace, and one decode layer's projections both ways (issue 19).

    python benchmarks/bench_gemv.py [--rows 1 4 8] [--quick] [--out gemv.json]

Every measurement replays a CUDA graph of `--calls` back-to-back calls, so launch gaps count as they do
in the engine's decode graph, and the calls cycle through enough copies of the weight (over 256 MiB in
all) that no call finds its weight in the 50 MB L2, as no decode layer does. Per call: microseconds and
GB/s of the weight bytes streamed (the copy bandwidth of an H200 is about 4.2-4.3 TB/s). The best Triton
launch shape per (rows, N, K) is printed as a `CONFIGS` line for kernels/triton/decode_gemv.py; the fused rows
use it. A correctness line per fused op compares it with its torch twin on the 8B shape.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from radixlm.kernels import reference as ref
from radixlm.kernels import triton as tri
from radixlm.kernels.triton import decode_gemv as gemv_module

DEVICE = "cuda"
HIDDEN, INTER = 4096, 14336
SHAPES = {"qkv": (6144, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER),
          "lm_head": (128256, HIDDEN)}


def sweep_configs(block_m: int, quick: bool) -> list[tuple[int, int, int, int]]:
    """Launch shapes (block_n, block_k, warps, stages) whose 3D accumulator stays within 128 fp32 registers
    a thread and whose weight tile is at least 2 KB, each with the loop's loads plain (stages 1) and
    pipelined through shared memory (stages 3)."""
    block_ns, block_ks, warps = ((4, 8), (512, 1024), (4,)) if quick else ((4, 8, 16), (256, 512, 1024, 2048), (4, 8))
    return [(n, k, w, stages) for n in block_ns for k in block_ks for w in warps for stages in (1, 3)
            if block_m * n * k <= 128 * 32 * w and n * k >= 1024 and k // block_m >= 32]


def graph_time_us(fn, copies: int, calls: int, replays: int = 10) -> float:
    """Microseconds per call of fn(i) for i cycling over the copies, captured `calls` at a time."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(copies):  # warm-up (and Triton compiles) outside the capture
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % copies)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (replays * calls)


class Shape:
    """Weights (copies of one [N, K] matrix) and inputs of one projection at `rows` rows."""

    def __init__(self, n: int, k: int, rows: int, dtype: torch.dtype) -> None:
        self.n, self.k, self.rows, self.bytes = n, k, rows, n * k * torch.tensor([], dtype=dtype).element_size()
        self.copies = max(2, -(-(256 << 20) // self.bytes))
        self.w = [torch.randn(n, k, device=DEVICE, dtype=dtype) / k**0.5 for _ in range(self.copies)]
        self.x = torch.randn(rows, k, device=DEVICE, dtype=dtype)
        self.residual = torch.randn(rows, k, device=DEVICE, dtype=dtype)
        self.gate_up = torch.randn(rows, 2 * k, device=DEVICE, dtype=dtype)
        self.norm_w = torch.rand(k, device=DEVICE, dtype=dtype) + 0.5

    def measure(self, fn, calls: int) -> dict:
        us = graph_time_us(fn, self.copies, calls)
        return {"us": round(us, 2), "GB/s": round(self.bytes / us / 1e3, 1)}


def bench_shape(name: str, s: Shape, args) -> dict:
    block_m = 1 << (s.rows - 1).bit_length()
    key = (block_m, s.n, s.k)
    result = {"key": key, "cublas": s.measure(lambda i: F.linear(s.x, s.w[i]), args.calls), "triton": {}}
    for config in sweep_configs(block_m, args.quick or s.rows in args.quick_rows):
        gemv_module.CONFIGS[key] = config
        try:
            result["triton"][",".join(map(str, config))] = s.measure(lambda i: tri.gemv(s.x, s.w[i]), args.calls)
        except Exception as e:  # a shape this GPU cannot run (out of registers or shared memory)
            result["triton"][",".join(map(str, config))] = {"error": f"{type(e).__name__}: {e}"[:200]}
    timed = {c: r for c, r in result["triton"].items() if "us" in r}
    best = min(timed, key=lambda c: timed[c]["us"])
    gemv_module.CONFIGS[key] = tuple(int(v) for v in best.split(","))
    result["best"] = {"config": best, **timed[best]}
    result["max_abs_err"] = (tri.gemv(s.x, s.w[0]).float() - F.linear(s.x, s.w[0]).float()).abs().max().item()
    print(f"{name:8s} M={s.rows} N={s.n:6d} K={s.k:5d}  cuBLAS {result['cublas']['us']:8.2f} us "
          f"{result['cublas']['GB/s']:7.1f} GB/s | Triton best {best:>10s} {timed[best]['us']:8.2f} us "
          f"{timed[best]['GB/s']:7.1f} GB/s  ({len(timed)} configs; max |Triton - cuBLAS| "
          f"{result['max_abs_err']:.3g})", flush=True)
    eps = 1e-5
    if name in ("o", "down"):  # the residual add and the next norm's first half after: residual_gemv
        silu = name == "down"
        x = s.gate_up if silu else s.x
        residual = s.residual[:, : s.n]
        norm_w = s.norm_w[: s.n]

        def unfused(i):
            h = F.linear(tri.silu_and_mul(x) if silu else x, s.w[i])
            return tri.fused_add_rms_norm(h, residual, norm_w, eps)
        result["epilogue_unfused"] = s.measure(unfused, args.calls)
        result["epilogue_fused"] = s.measure(lambda i: tri.residual_gemv(x, s.w[i], residual, norm_w, silu), args.calls)
        got, want = tri.residual_gemv(x, s.w[0], residual, norm_w, silu), ref.residual_gemv(x, s.w[0], residual, norm_w, silu)
        result["epilogue_max_abs_err"] = (got[0].float() - want[0].float()).abs().max().item()
        print(f"{'':8s} {'SiLU+' if silu else ''}GEMV+add+norm: unfused (cuBLAS + Triton norm) "
              f"{result['epilogue_unfused']['us']:8.2f} us | residual_gemv {result['epilogue_fused']['us']:8.2f} us "
              f"| max |h - twin| {result['epilogue_max_abs_err']:.3g}", flush=True)
    if name in ("qkv", "gate_up"):  # the norm's scale at the end: rms_scaled_gemv
        sums = (s.x.float() ** 2).sum(-1, keepdim=True).repeat(1, 512) / 512  # 512 partial sums, as o_proj leaves
        result["scaled"] = s.measure(lambda i: tri.rms_scaled_gemv(s.x, sums, eps, s.w[i]), args.calls)
        got, want = tri.rms_scaled_gemv(s.x, sums, eps, s.w[0]), ref.rms_scaled_gemv(s.x, sums, eps, s.w[0])
        result["scaled_max_abs_err"] = (got.float() - want.float()).abs().max().item()
        print(f"{'':8s} rms_scaled_gemv {result['scaled']['us']:8.2f} us (plain best {timed[best]['us']:.2f}) | "
              f"max |scaled - twin| {result['scaled_max_abs_err']:.3g}", flush=True)
    if name == "qkv":  # the rotary and the KV store in the epilogue (Llama-3-8B heads: 32 q, 8 kv, 128)
        heads, kv_heads, dim = 32, 8, s.n // 48
        cache = torch.randn(8192, dim, device=DEVICE)
        positions = torch.randint(0, 8192, (s.rows,), device=DEVICE)
        pool = [torch.zeros(4096, kv_heads, dim, device=DEVICE, dtype=s.x.dtype) for _ in range(2)]
        loc = torch.arange(s.rows, device=DEVICE, dtype=torch.int32)

        def pair(i):
            qkv = tri.rms_scaled_gemv(s.x, sums, eps, s.w[i]).view(s.rows, -1, dim)
            q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
            return tri.apply_rotary_store_kv(q, k, v, positions, cache, *pool, loc)
        result["rotary_unfused"] = s.measure(pair, args.calls)
        result["rotary_fused"] = s.measure(lambda i: tri.rotary_qkv_gemv(
            s.x, sums, eps, s.w[i], None, positions, cache, *pool, loc, heads, kv_heads), args.calls)
        print(f"{'':8s} + rotary and KV store: rms_scaled_gemv + apply_rotary_store_kv "
              f"{result['rotary_unfused']['us']:8.2f} us | rotary_qkv_gemv {result['rotary_fused']['us']:8.2f} us",
              flush=True)
    return result


def layer_summary(results: dict, rows: int, layers: int = 32) -> str:
    """One decode layer's projections with their norms and SiLU: cuBLAS with the norms apart against the
    GEMVs with the norms split into their neighbours, and x 32 layers."""
    r = {name: results[f"{name}_M{rows}"] for name in ("qkv", "o", "gate_up", "down")}
    unfused = (r["qkv"]["cublas"]["us"] + r["o"]["epilogue_unfused"]["us"] + r["gate_up"]["cublas"]["us"]
               + r["down"]["epilogue_unfused"]["us"])
    fused = (r["qkv"]["scaled"]["us"] + r["o"]["epilogue_fused"]["us"] + r["gate_up"]["scaled"]["us"]
             + r["down"]["epilogue_fused"]["us"])
    return (f"M={rows}: one layer's norms + projections + SiLU: unfused {unfused:.1f} us, fused {fused:.1f} us; "
            f"x{layers} layers: {unfused * layers / 1e3:.3f} -> {fused * layers / 1e3:.3f} ms per step "
            f"({(unfused - fused) * layers / 1e3:+.3f} ms saved)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--calls", type=int, default=64, help="calls per captured graph")
    p.add_argument("--quick", action="store_true", help="sweep up to 8 launch shapes instead of up to 40")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--configs-out", help="write the best launch shapes here, for RADIXLM_GEMV_CONFIGS")
    p.add_argument("--quick-rows", type=int, nargs="*", default=[4, 8],
                   help="rows that sweep the --quick launch shapes only (default 4 8: one row gets the full sweep)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gemv needs a CUDA GPU", file=sys.stderr)
        return 2
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    results: dict = {}
    for rows in args.rows:
        for name in args.shapes:
            n, k = SHAPES[name]
            try:
                results[f"{name}_M{rows}"] = bench_shape(name, Shape(n, k, rows, torch.bfloat16), args)
            except Exception as e:  # report and go on to the next shape
                print(f"{name} M={rows}: {type(e).__name__}: {e}", flush=True)
            torch.cuda.empty_cache()
            write(results, args)  # after every shape: a time limit loses only the shape in progress
        if all(f"{name}_M{rows}" in results for name in ("qkv", "o", "gate_up", "down")):
            print(layer_summary(results, rows), flush=True)
    # Paste-ready for kernels/triton/decode_gemv.py (rows rounded up to a power of two, as the kernel blocks them).
    print("CONFIGS = {" + ", ".join(f"{r['key']}: ({r['best']['config']})" for r in results.values()) + "}",
          flush=True)
    return 0


def write(results: dict, args) -> None:
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    if args.configs_out:
        Path(args.configs_out).write_text(json.dumps(
            {",".join(map(str, r["key"])): [int(v) for v in r["best"]["config"].split(",")] for r in results.values()}))


if __name__ == "__main__":
    sys.exit(main())
