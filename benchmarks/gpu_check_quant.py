"""gpu_check.py's step for quantized weights (quantization="fp8"), on the GPU:

1. Kernels at the Llama-3-8B sizes: the per-token activation quantizer equal to its reference to the bit;
   the fp8 decode GEMVs (1 and 4 rows), the W8A8 GEMM (torch._scaled_mm, 16 and 300 rows) and the 4-bit
   GEMV and GEMM (AWQ/GPTQ, bf16 activations, 1 to 300 rows; groups of 128, and of 32 on SmolLM2's shapes) against the fp32 product of the same quantized
   values and scales, within 1 % of the output's largest magnitude.
2. The engine on the tiny Llama with quantization=fp8, against transformers (fp32) whose projections
   compute the reference W8A8 product of the same e4m3 weights (tests/test_quant_fp8.py's oracle): prompt
   logprobs (prefill: the fp8 GEMM path) mean error under 5e-3 in fp32 (the GEMM writes bf16); in bf16,
   against the same oracle in bf16, under twice that oracle's own error against the fp32 one + 0.01. Greedy tokens equal with CUDA graphs on and off, overlap on and off (fp32);
   with an fp8 KV cache as well it runs and its logprob error is reported.
3. What fp8 costs: mean |delta logprob| and greedy agreement against the unquantized bf16 engine.
4. 4-bit layers on the fused decode GEMVs in the engine against the unfused 4-bit path (check_int4_decode),
   with the one-row product on its fp32 path and on its packed (fp16x2) path.
5. The packed one-row 4-bit GEMV (decode_gemv.INT4_PACKED) against the twin on the 8B shapes (groups of
   128 and 64) and SmolLM2's (32), at 1 and 3 rows (3 takes the fp32 path), rows of ordinary values, of
   Llama-like large activations (every 97th value times 3,000, one at 1e5: past fp16's range), of small
   ones (1e-3), with integer zeros and fractional ones (GGUF's Q4_1/Q4_K): within 1 % of the output's
   largest magnitude (check_int4_packed).
"""

from __future__ import annotations

from typing import Any

import torch

import radixlm
from radixlm.kernels import quant_reference as qref
from radixlm.kernels import reference as ref

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
# SmolLM2-135M's projections (qkv, o, gate_up, down), which its GGUF stores in Q4_1.
GGUF_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GREEDY = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def check_kernels() -> dict[str, Any]:
    from radixlm.kernels import triton as tri
    from radixlm.kernels.triton import fp8_gemm

    out: dict[str, Any] = {}
    g = torch.Generator(device="cuda").manual_seed(0)
    for n, k in SHAPES:
        w = torch.randn(n, k, device="cuda", generator=g) / k**0.5
        wq, ws = qref.quantize_fp8_rows(w)
        for m in (1, 4):
            x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
            out[f"gemv_{m}x{n}x{k}"] = _rel_err(tri.gemv(x, wq, None, ws), ref.gemv(x.float(), wq, None, ws))
        for m in (16, 300):
            x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
            xq, xs = fp8_gemm.quantize_fp8_rows(x)
            rq, rs = qref.quantize_fp8_rows(x)
            out.setdefault("quantize_rows_bit_equal", True)
            out["quantize_rows_bit_equal"] &= bool(torch.equal(xq.view(torch.uint8), rq.view(torch.uint8))
                                                   and torch.equal(xs, rs))
            out[f"gemm_{m}x{n}x{k}"] = _rel_err(tri.fp8_linear(x, wq, ws), qref.fp8_linear(x.float(), wq, ws))
        packed, scales, zeros = qref.quantize_int4_rows(w, 128)
        for m in (1, 2, 3, 16, 300):  # the GEMV at 1, 2 and 4 rows (padded), the GEMM's two launch shapes
            x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
            out[f"int4_{m}x{n}x{k}"] = _rel_err(tri.int4_linear(x, packed, scales, zeros),
                                                qref.int4_linear(x.float(), packed, scales, zeros))
    for n, k in GGUF_SHAPES:  # groups of 32: GGUF's Q4_0 / Q4_1 kept quantized on CUDA (gguf_kept.int4_layer)
        w = torch.randn(n, k, device="cuda", generator=g) / k**0.5
        packed, scales, zeros = qref.quantize_int4_rows(w, 32)
        for m in (1, 4, 6, 300):
            x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
            out[f"int4_g32_{m}x{n}x{k}"] = _rel_err(tri.int4_linear(x, packed, scales, zeros),
                                                    qref.int4_linear(x.float(), packed, scales, zeros))
    out["ok"] = out["quantize_rows_bit_equal"] and all(v < 1e-2 for key, v in out.items()
                                                       if key.startswith(("gemv", "gemm", "int4")))
    return out


def w8a8_oracle(ckpt: str, device: str, dtype: torch.dtype = torch.float32, rounded: bool = True):
    """transformers in `dtype` with every projection replaced by the reference W8A8 product of its weight
    quantized as quantization=fp8 does (from the weight in the model dtype: per-row e4m3, per-token
    activations); `rounded=False`: the products kept in fp32 rather than written in bf16."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).to(device).eval()

    class W8A8(torch.nn.Module):
        def __init__(self, linear):
            super().__init__()
            self.q, self.s = qref.quantize_fp8_rows(linear.weight.detach())
            self.bias = linear.bias

        def forward(self, x):
            return qref.fp8_linear(x.reshape(-1, x.shape[-1]), self.q, self.s, self.bias,
                                   rounded).reshape(*x.shape[:-1], -1)

    for name, module in list(model.named_modules()):
        if name.rpartition(".")[2] in PROJ:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, W8A8(module))
    return model


def _prompt_logprobs(engine, prompts) -> list[torch.Tensor]:
    outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 1}, return_logprob=True,
                           logprob_start_len=0)
    return [torch.tensor([lp for lp, _, _ in o["meta_info"]["input_token_logprobs"][1:]]) for o in outs]


def _hf_logprobs(model, prompts, device: str) -> list[torch.Tensor]:
    rows = []
    with torch.inference_mode():
        for p in prompts:
            lsm = torch.log_softmax(model(torch.tensor([p], device=device)).logits[0].float(), -1).cpu()
            rows.append(lsm[torch.arange(len(p) - 1), torch.tensor(p[1:])])
    return rows


def _mean_err(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return float(torch.cat([(x - y).abs() for x, y in zip(a, b)]).mean())


def check_int4_decode(prompts: list[list[int]]) -> dict[str, Any]:
    """4-bit layers on the fused decode GEMVs in the engine (batch 1, CUDA graphs): a tiny Llama of whole
    groups of 128 (hidden 128, intermediate 256) with its random weights quantized as AWQ's (load_format
    dummy), decode_fused_gemv=1 against 0 (the 4-bit GEMV per projection, norms and rotary apart): in
    fp32 greedy tokens equal and decode logprobs within 1e-3; in bf16 the greedy agreement is reported."""
    import tempfile

    from radixlm.testing.checkpoints import build_checkpoint

    ckpt = build_checkpoint(tempfile.mkdtemp(prefix="radixlm-int4-") + "/tiny", "llama", hidden_size=128,
                            intermediate_size=256)
    runs: dict[tuple[str, int], list] = {}
    for dtype in ("float32", "bfloat16"):
        for rows in (0, 1):
            with radixlm.Engine(ckpt, device="cuda", dtype=dtype, quantization="awq", load_format="dummy",
                                decode_fused_gemv=rows, max_total_tokens=4096, log_level="warning") as engine:
                assert engine._runner.model.fused_gemv_rows == rows
                runs[dtype, rows] = [engine.generate(input_ids=p, sampling_params=GREEDY, return_logprob=True)
                                     for p in prompts]  # one at a time: batch-1 decode steps

    def tokens(key):
        return [o["output_ids"] for o in runs[key]]

    def logprobs(key):
        return torch.tensor([lp for o in runs[key] for lp, _, _ in o["meta_info"]["output_token_logprobs"]])

    equal = {dtype: sum(a == b for a, b in zip(tokens((dtype, 1)), tokens((dtype, 0)))) for dtype in ("float32", "bfloat16")}
    err = float((logprobs(("float32", 1)) - logprobs(("float32", 0))).abs().max()) if equal["float32"] == len(prompts) \
        else float("inf")
    return {"greedy_equal_fused_vs_unfused": equal, "of": len(prompts), "fp32_max_abs_dlogprob": err,
            "ok": equal["float32"] == len(prompts) and err <= 1e-3}


def _activation_rows(m: int, k: int, kind: str, g: torch.Generator) -> torch.Tensor:
    """m rows of bf16 activations: `normal`, `large` (every 97th value times 3,000 and one at 1e5, as
    Llama's massive activations in the residual stream and down_proj's inputs) or `small` (times 1e-3)."""
    x = torch.randn(m, k, device="cuda", generator=g)
    if kind == "large":
        x[:, ::97] *= 3000.0
        x[:, 5] = 1e5
    elif kind == "small":
        x *= 1e-3
    return x.bfloat16()


def _rotary_qkv_packed(g: torch.Generator) -> dict[str, float]:
    """The 8B qkv projection with the rotary and KV store in its epilogue (rotary_qkv_gemv) on a 4-bit
    weight, one row, against its twin: q and the stored k and v."""
    from radixlm.kernels import triton as tri

    heads, kv_heads, d, k = 32, 8, 128, 4096
    n = (heads + 2 * kv_heads) * d
    packed, scales, zeros = qref.quantize_int4_rows(torch.randn(n, k, device="cuda", generator=g) / k**0.5, 128)
    cache = torch.randn(64, d, device="cuda", generator=g).bfloat16()
    positions, loc = torch.tensor([7], device="cuda"), torch.tensor([3], device="cuda", dtype=torch.int32)
    out = {}
    for kind in ("normal", "large"):
        x, sums = _activation_rows(1, k, kind, g), torch.rand(1, 8, device="cuda", generator=g) * k
        pools = [[torch.zeros(8, kv_heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(2)] for _ in range(2)]
        got, want = (ops.rotary_qkv_gemv(x, sums, 1e-6, packed, None, positions, cache, *pool, loc, heads, kv_heads,
                                         scales, zeros) for ops, pool in ((tri, pools[0]), (ref, pools[1])))
        out[f"rotary_qkv_{kind}"] = max(_rel_err(got, want), *(_rel_err(a[3], b[3]) for a, b in zip(*pools)))
    return out


def check_int4_packed() -> dict[str, Any]:
    """The one-row 4-bit GEMV on its packed path (and 3 rows, on the fp32 path, with the flag on) against
    the fp32 product of the same nibbles, scales and zeros (quant_reference.int4_linear)."""
    from radixlm.kernels import triton as tri
    from radixlm.kernels.triton import decode_gemv

    out: dict[str, Any] = {}
    g = torch.Generator(device="cuda").manual_seed(1)
    packed_before, decode_gemv.INT4_PACKED = decode_gemv.INT4_PACKED, True
    try:
        for (n, k), group in [*((s, 128) for s in SHAPES), ((4096, 4096), 64), *((s, 32) for s in GGUF_SHAPES)]:
            w = torch.randn(n, k, device="cuda", generator=g) / k**0.5
            packed, scales, zeros = qref.quantize_int4_rows(w, group)
            fractional = zeros + torch.rand(zeros.shape, device="cuda", generator=g) - 0.5
            for zero_kind, z in (("int", zeros), ("frac", fractional)):
                for m in (1, 3):
                    for kind in ("normal", "large", "small"):
                        x = _activation_rows(m, k, kind, g)
                        out[f"{m}x{n}x{k}_g{group}_{zero_kind}_{kind}"] = _rel_err(
                            tri.gemv(x, packed, None, scales, z), qref.int4_linear(x.float(), packed, scales, z))
        out.update(_rotary_qkv_packed(g))
    finally:
        decode_gemv.INT4_PACKED = packed_before
    out["max"] = max(out.values())
    out["ok"] = out["max"] < 1e-2
    return out


def check_fp8_weights(ckpt: str, report: dict[str, Any], device: str, prompts: list[list[int]]) -> bool:
    entry: dict[str, Any] = {}
    ok = True
    if device == "cuda":
        entry["kernels"] = check_kernels()
        ok = entry["kernels"]["ok"]
        print(f"fp8 kernels: {'ok' if ok else 'FAIL'} {entry['kernels']}", flush=True)
        entry["int4_packed"] = check_int4_packed()
        ok = ok and entry["int4_packed"]["ok"]
        print(f"4-bit packed GEMV: {'ok' if entry['int4_packed']['ok'] else 'FAIL'} {entry['int4_packed']}", flush=True)
        from radixlm.kernels.triton import decode_gemv
        packed_before = decode_gemv.INT4_PACKED
        for packed in (False, True):
            decode_gemv.INT4_PACKED = packed
            key = "int4_decode_packed" if packed else "int4_decode"
            entry[key] = check_int4_decode(prompts)
            ok = ok and entry[key]["ok"]
            print(f"4-bit fused decode ({'packed' if packed else 'fp32'} one-row product): "
                  f"{'ok' if entry[key]['ok'] else 'FAIL'} {entry[key]}", flush=True)
        decode_gemv.INT4_PACKED = packed_before
    oracle = _hf_logprobs(w8a8_oracle(ckpt, device), prompts, device)
    oracle_bf16 = _hf_logprobs(w8a8_oracle(ckpt, device, torch.bfloat16), prompts, device)
    hf_bf16_err = _mean_err(oracle_bf16, oracle)
    # What writing the products in bf16 alone moves this model's logprobs (0.10 on the tiny random model):
    # the bound of the fp32 engine. Its inputs to each product differ from transformers' in the last bits
    # (attention kernels; on the GPU the fp8 GEMM's own accumulation), which flips some of those roundings:
    # 0.011 on the CPU, 0.075 on an H100 (2026-12-07); an unquantized model is 0.24 away.
    rounding_err = _mean_err(_hf_logprobs(w8a8_oracle(ckpt, device, rounded=False), prompts, device), oracle)
    common = dict(device=device, log_level="warning", max_total_tokens=16384, cuda_graph_max_bs=16)
    runs: dict[str, Any] = {}
    for name, opts in {"fp32": dict(dtype="float32"), "fp32_no_graphs": dict(dtype="float32", disable_cuda_graph=True),
                       "fp32_overlap_off": dict(dtype="float32", enable_overlap_schedule=False),
                       "bf16": dict(dtype="bfloat16"), "bf16_kv_fp8": dict(dtype="bfloat16", kv_cache_dtype="fp8_e4m3"),
                       "bf16_unquantized": dict(dtype="bfloat16", quantization=None)}.items():
        opts = {"quantization": "fp8", **opts}
        with radixlm.Engine(ckpt, **common, **opts) as engine:
            runs[name] = {"tokens": [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=GREEDY)],
                          "logprobs": _prompt_logprobs(engine, prompts)}
    errs = {name: _mean_err(r["logprobs"], oracle_bf16 if name.startswith("bf16") else oracle)
            for name, r in runs.items()}
    bounds = {"fp32": rounding_err, "bf16": 2 * hf_bf16_err + 1e-2}
    equal = {name: sum(a == b for a, b in zip(runs[name]["tokens"], runs["fp32"]["tokens"]))
             for name in ("fp32_no_graphs", "fp32_overlap_off")}
    agree = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
             for x, y in zip(runs["bf16"]["tokens"], runs["bf16_unquantized"]["tokens"])]
    entry.update({"logprob_mean_err_vs_w8a8_oracle": errs, "bounds": bounds, "hf_bf16_mean_err": hf_bf16_err,
                  "oracle_bf16_rounding_err": rounding_err,
                  "greedy_equal_requests_vs_fp32": equal, "of": len(prompts),
                  "fp8_vs_bf16_mean_abs_dlogprob": _mean_err(runs["bf16"]["logprobs"], runs["bf16_unquantized"]["logprobs"]),
                  "fp8_vs_bf16_greedy_equal_prefix": agree})
    passed = all(errs[k] <= b for k, b in bounds.items()) and all(v == len(prompts) for v in equal.values())
    entry["ok"] = ok and passed
    report["fp8_weights"] = entry
    print(f"fp8 weights: {'ok' if entry['ok'] else 'FAIL'} logprob mean err vs the W8A8 oracle {errs} "
          f"(bounds {bounds}); greedy equal with graphs off / overlap off {equal} of {len(prompts)}; "
          f"vs unquantized bf16: mean |dlogprob| {entry['fp8_vs_bf16_mean_abs_dlogprob']:.3f}, greedy equal "
          f"prefix {agree} of {GREEDY['max_new_tokens']}", flush=True)
    return entry["ok"]
