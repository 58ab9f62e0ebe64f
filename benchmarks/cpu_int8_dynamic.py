"""Study (not a runtime path): torch's fbgemm dynamic int8 linear in place of `quantization="gguf"`'s CPU
products, measured with the project's own accuracy and speed scripts (results: benchmarks/results/
2026-12-07-quantization.md, "fbgemm's dynamic int8 linear for gguf, in the engine").

    python benchmarks/cpu_int8_dynamic.py --mode one --kinds all products
    python benchmarks/cpu_int8_dynamic.py --mode one --kinds all errors
    python benchmarks/cpu_int8_dynamic.py --mode one --kinds all quant --accuracy --cpu --quant-option quantization=gguf --steps 64
    python benchmarks/cpu_int8_dynamic.py --mode one --kinds all cpu --threads 1 --batch 1 --dtypes float32 \
        --systems radixlm --gguf-quantized --startup-runs 0

The GGUF layers that gguf_kept builds (Int4GroupLinear for Q4_0/Q4_1, Int8GroupLinear for Q8_0) are
replaced, for the --kinds named (SmolLM2's projections told apart by shape), by fbgemm's product on the
same values requantized to int8 with one scale per row (|error| <= max|w_row| / 254):
- one: `quantized::linear_dynamic(x, packed, reduce_range=True)`: x quantized to 7-bit uint8 with one
  scale for the whole call (llama.cpp: 8 bits a block of 32). `vpmaddubsw` sums two uint8 x int8
  products in a saturating int16, so 8-bit activations (reduce_range=False) overflow it.
- twopass: one, plus the same product of the first pass's rounding residual (x minus x quantized as
  linear_dynamic does it): ~14-bit activations at twice the cost.
- weights: fp32 F.linear on the requantized weight (the weights' share of the error alone).
- int8pack: not fbgemm: torch's `_weight_int8pack_mm` on the requantized weight in one call, activations
  in bf16 (gguf's Q8_0 layer calls it once per block of 32 columns, each with the file's own scales).
- ggml: not fbgemm: ggml's own product (llama.cpp's) on the file's blocks, re-encoded from the fields
  gguf_kept gets: the runtime's ggml_product.GgmlLinear (libggml-python), which gguf_kernel="ggml" uses,
  here on every row count (one threadpool of torch's thread count).
Then: `errors` (each kind's error on the inputs a prefill of README text gives it), `products` (CPU ms a token of each kind's layers, all 30 layers' distinct weights so that none is
warm in cache, as in a step; the LM head too), `quant ARGS` (bench_quant.py ARGS) or `cpu ARGS`
(bench_cpu.py ARGS) with the patched layers.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import torch
from torch import nn

import radixlm
from radixlm.core.runtime.quantization import gguf_kept
from radixlm.core.runtime.quantization.ggml_product import GgmlLinear, GgmlThreads

_HERE = Path(__file__).resolve().parent
KINDS = {(960, 576): "qkv", (576, 576): "o", (3072, 576): "gate_up", (576, 1536): "down", (49152, 576): "lm_head"}


def requantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 in -127..127, scale per row) with |q * scale - w| <= scale / 2 = max|w_row| / 254."""
    amax = w.abs().amax(1)
    scale = torch.where(amax > 0, amax / 127, 1.0).float()
    return torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


class Int8Dynamic(nn.Module):
    """x @ W.T through fbgemm's dynamic int8 linear (see the module docstring for `mode`). At more than
    one row each row is first brought to max |x| = 1 (and its output scaled back): a scale per token."""

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None, mode: str) -> None:
        super().__init__()
        self.out_features, self.in_features = w.shape
        q, scale = requantize_rows(w)
        self.mode, self.bias, self.file_weight = mode, bias, w  # the file's values, for `errors`
        self.plain = q.float() * scale[:, None] if mode == "weights" else None
        self.q, self.scale = q, scale.to(torch.bfloat16)  # mode int8pack: torch's int8 product, bf16 activations
        weight = torch._make_per_channel_quantized_tensor(q, scale.double(), torch.zeros(len(scale), dtype=torch.long), 0)
        self.packed = torch.ops.quantized.linear_prepack(weight, None)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.quantized.linear_dynamic(x, self.packed, True)
        if self.mode == "twopass":
            rounded = torch.quantize_per_tensor_dynamic(x, torch.quint8, True).dequantize()
            out += torch.ops.quantized.linear_dynamic(x - rounded, self.packed, True)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float()
        if self.plain is not None:
            out = torch.nn.functional.linear(flat, self.plain)
        elif self.mode == "int8pack":
            out = torch._weight_int8pack_mm(flat.to(torch.bfloat16), self.q, self.scale).float()
        elif flat.shape[0] == 1:
            out = self._product(flat)
        else:
            amax = flat.abs().amax(1, keepdim=True).clamp_min_(1e-30)
            out = self._product(flat / amax) * amax
        out = out if self.bias is None else out + self.bias
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


def ggml_blocks(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> tuple[str, torch.Tensor]:
    """(GGUF type, the blocks' bytes as a file stores them) from integer fields as gguf_dequant.integer_blocks
    gives them: Q8_0 (q int8), Q4_0 (m None) or Q4_1 (nibbles 0..15): d (fp16) [m (fp16)] then the 32
    values, two a byte (value j low, j + 16 high)."""
    rows, cols = q.shape
    half = lambda t: t.to(torch.float16).view(torch.uint8).reshape(rows, cols // 32, 2)  # noqa: E731
    if q.dtype == torch.int8:
        return "Q8_0", torch.cat([half(d), q.view(torch.uint8).reshape(rows, cols // 32, 32)], -1).reshape(-1)
    v = q.to(torch.uint8).reshape(rows, cols // 32, 32)
    body = v[..., :16] | (v[..., 16:] << 4)
    head, qtype = (half(d), "Q4_0") if m is None else (torch.cat([half(d), half(m)], -1), "Q4_1")
    return qtype, torch.cat([head, body], -1).reshape(-1)


def patch(mode: str, kinds: set[str]) -> None:
    """gguf_kept builds Int8Dynamic for the layers of `kinds` (its own layers for the rest)."""
    int4, int8 = gguf_kept.Int4GroupLinear, gguf_kept.Int8GroupLinear
    threads = GgmlThreads(torch.get_num_threads()) if mode == "ggml" else None

    def four(q, scale, zero, bias):  # W = (q - 8) * scale + zero, groups of 32
        if KINDS.get(tuple(q.shape)) not in kinds:
            return int4(q, scale, zero, bias)
        n, k = q.shape
        if mode == "ggml":  # the file's blocks again: m = zero - 8d (Q4_1), no m where zero is 0 (Q4_0)
            return GgmlLinear(*ggml_blocks(q, scale, None if not zero.any() else zero - 8 * scale), (n, k), bias,
                              threads)
        w = (q.float().view(n, -1, 32) - 8) * scale.float()[..., None] + zero.float()[..., None]
        return Int8Dynamic(w.view(n, k), bias, mode)

    def eight(q, d, bias):  # W = q * d, groups of 32
        if KINDS.get(tuple(q.shape)) not in kinds:
            return int8(q, d, bias)
        n, k = q.shape
        if mode == "ggml":
            return GgmlLinear(*ggml_blocks(q, d, None), (n, k), bias, threads)
        return Int8Dynamic((q.float().view(n, -1, 32) * d.float()[..., None]).view(n, k), bias, mode)

    gguf_kept.Int4GroupLinear, gguf_kept.Int8GroupLinear = four, eight


def _layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(KINDS[(m.out_features, m.in_features)], m) for _, m in model.named_modules()
            if hasattr(m, "out_features") and (m.out_features, m.in_features) in KINDS]


def products(rounds: int = 20) -> None:
    """CPU ms a token of each kind's products at one row, the model's own layers in layer order."""
    with radixlm.Engine(quantization="gguf", log_level="warning") as engine:
        layers = _layers(engine._runner.model)
        xs = {m.in_features: torch.randn(1, m.in_features) for _, m in layers}
        spent = dict.fromkeys(KINDS.values(), 0.0)
        with torch.inference_mode():
            for r in range(rounds + 1):
                for kind, m in layers:
                    start = time.thread_time()
                    m(xs[m.in_features])
                    spent[kind] += (time.thread_time() - start) if r else 0.0
        kinds = {kind: type(m).__name__ for kind, m in layers}
    print(" | ".join(f"{k} ({kinds[k]}) {v / rounds * 1e3:.2f}" for k, v in spent.items()),
          f"| all {sum(spent.values()) / rounds * 1e3:.2f} CPU ms a token", flush=True)


def errors(mode_rows: int = 64) -> None:
    """Each kind's relative error ||out - x W.T|| / ||x W.T|| against the file's fp32 values, on the inputs
    it gets from the first 64 tokens of README.md (a prefill) in layers 0, 15 and 29 and the LM head, one row
    a call: x in bf16 (as gguf's own layers take it), the weight requantized alone, one pass, two passes."""
    with radixlm.Engine(quantization="gguf", log_level="warning") as engine:
        model, seen = engine._runner.model, {}
        hooks = [m.register_forward_hook(lambda m, inp, out, name=name: seen.setdefault(name, (m, inp[0].clone())) and None)
                 for name, m in model.named_modules() if isinstance(m, Int8Dynamic)
                 and (name == "lm_head" or name.split(".")[1] in ("0", "15", "29"))]
        ids = engine.tokenizer((_HERE.parent / "README.md").read_text())["input_ids"][:mode_rows]
        engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0})
        for hook in hooks:
            hook.remove()
    with torch.inference_mode():
        for name, (m, x) in seen.items():
            x = x.reshape(-1, m.in_features).float()
            want = x @ m.file_weight.t()
            bf16 = x.to(torch.bfloat16).float() @ m.file_weight.t()  # gguf's own layers round x to bf16
            row = [f"bf16 x {float((bf16 - want).norm() / want.norm()):.4f}"]
            for mode in ("weights", "one", "twopass"):
                layer = Int8Dynamic(m.file_weight, None, mode)
                got = torch.cat([layer(x[i:i + 1]) for i in range(len(x))])
                row.append(f"{mode} {float((got - want).norm() / want.norm()):.4f}")
            amax = x.abs().amax(1) / x.abs().median(1).values
            print(f"{name}: {len(x)} rows, max|x| / median|x| {float(amax.median()):.0f}; " + ", ".join(row), flush=True)


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, _HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["one", "twopass", "weights", "int8pack", "ggml", "off"], default="one")
    p.add_argument("--kinds", default="all", help="comma list of qkv,o,gate_up,down,lm_head, or all")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("what", choices=["products", "errors", "quant", "cpu"])
    args, rest = p.parse_known_args(argv)
    kinds = set(KINDS.values()) if args.kinds == "all" else set(args.kinds.split(","))
    if args.mode != "off":
        patch(args.mode, kinds)
    torch.set_num_threads(args.torch_threads)
    print(f"mode {args.mode} for {sorted(kinds) if args.mode != 'off' else 'none'}", flush=True)
    if args.what in ("products", "errors"):
        products() if args.what == "products" else errors()
        return 0
    sys.argv = [f"bench_{args.what}.py", *rest]  # bench_cpu.main reads sys.argv
    return _script(f"bench_{args.what}").main() or 0


if __name__ == "__main__":
    sys.exit(main())
