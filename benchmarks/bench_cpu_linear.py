"""The matrix products of one decode step of SmolLM2-135M on this CPU: F.linear (torch's MKL path)
against weights prepacked for oneDNN (kernels.cpu.prepack_linear_weight), fp32 and bf16, per layer
shape and for a whole forward (30 layers and the LM head), in microseconds and GFLOP/s.

    python benchmarks/bench_cpu_linear.py                       # rows 1 and 16, torch's threads
    python benchmarks/bench_cpu_linear.py --rows 16 --threads 1 --reps 50

Random weights of the model's shapes; each variant runs --reps times per round, the variants in turn,
and the table shows the fastest call (on a shared machine the least disturbed one).
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch
import torch.nn.functional as F

from radixlm.kernels import cpu

# SmolLM2-135M (out, in): fused q|k|v, o, fused gate|up, down; the LM head once per forward.
LAYER_SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
HEAD_SHAPE = (49152, 576)
NUM_LAYERS = 30


def fastest(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def variants(weight: torch.Tensor, x: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    out = {"F.linear fp32": lambda: F.linear(x, weight)}
    packed = cpu.prepack_linear_weight(weight)
    if packed is not None:
        out["prepacked fp32"] = lambda: cpu.prepacked_linear(x, packed, None)
    w16, x16 = weight.bfloat16(), x.bfloat16()
    out["F.linear bf16"] = lambda: F.linear(x16, w16)
    packed16 = cpu.prepack_linear_weight(w16)
    if packed16 is not None:
        out["prepacked bf16"] = lambda: cpu.prepacked_linear(x16, packed16, None)
    return out


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16], help="tokens per step (the batch)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    shapes = {**LAYER_SHAPES, "lm_head": HEAD_SHAPE}
    torch.manual_seed(0)
    weights = {name: torch.randn(shape) * 0.02 for name, shape in shapes.items()}
    for rows in args.rows:
        best: dict[tuple[str, str], float] = {}
        for _ in range(args.rounds):
            for name, w in weights.items():
                for variant, fn in variants(w, torch.randn(rows, w.shape[1])).items():
                    t = fastest(fn, args.reps)
                    best[name, variant] = min(best.get((name, variant), t), t)
        names = list(shapes)
        print(f"\nrows {rows}: fastest call in µs (GFLOP/s)")
        print("| variant | " + " | ".join(names) + " | forward (30 layers + head), ms |")
        print("|---|" + "---|" * (len(names) + 1))
        for variant in dict.fromkeys(v for _, v in best):
            cells = []
            for name in names:
                t = best[name, variant]
                out_f, in_f = shapes[name]
                cells.append(f"{t * 1e6:.0f} ({2 * rows * out_f * in_f / t / 1e9:.1f})")
            forward = NUM_LAYERS * sum(best[n, variant] for n in LAYER_SHAPES) + best["lm_head", variant]
            print(f"| {variant} | " + " | ".join(cells) + f" | {forward * 1e3:.1f} |")


if __name__ == "__main__":
    main()
