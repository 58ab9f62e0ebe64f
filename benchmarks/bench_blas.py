"""The 8B shape's GEMMs under torch's BLAS choices: cuBLAS (the default), cuBLASLt, and TunableOp (which
times every cuBLASLt algorithm once per shape and keeps the fastest). Issue 19: the prefill forwards run
their GEMMs at ~85 % of the measured bf16 matmul rate; is a better algorithm on offer?

    python benchmarks/bench_blas.py --tokens 336 4096 16384
"""
from __future__ import annotations

import argparse
import json

import torch

HIDDEN, QKV, FFN = 4096, 6144, 14336
SHAPES = {"qkv": (HIDDEN, QKV), "o_proj": (HIDDEN, HIDDEN), "gate_up": (HIDDEN, 2 * FFN), "down": (FFN, HIDDEN)}


def timed_ms(fn, repeats=20):
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def run(tokens_list, label):
    rows = {}
    for tokens in tokens_list:
        total_ms, flops = 0.0, 0
        for name, (k, n) in SHAPES.items():
            x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
            # nn.Linear's layout: weight [n, k], used transposed (what F.linear does).
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            ms = timed_ms(lambda: torch.nn.functional.linear(x, w))
            rows[f"{tokens}/{name}_ms"] = round(ms, 4)
            total_ms += ms
            flops += 2 * tokens * k * n
        rows[f"{tokens}/layer_ms"] = round(total_ms, 4)
        rows[f"{tokens}/tflops"] = round(flops / total_ms / 1e9, 1)
    print(json.dumps({label: rows}), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[336, 4096, 16384])
    args = parser.parse_args()
    run(args.tokens, "cublas")
    torch.backends.cuda.preferred_blas_library("cublaslt")
    run(args.tokens, "cublaslt")
    torch.backends.cuda.preferred_blas_library("cublas")
    torch.cuda.tunable.enable(True)
    torch.cuda.tunable.set_max_tuning_duration(200)
    torch.cuda.tunable.set_filename("/tmp/tunableop_results.csv")
    run(args.tokens, "tunableop")


if __name__ == "__main__":
    main()
