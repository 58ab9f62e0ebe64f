"""FP8 W8A8 (core.runtime.quantization): the kernels against their pure-torch twins, checkpoints of the
two hub forms written here from their public format descriptions, and whole models against an
independent oracle: transformers' model on the same weights with each projection replaced by the W8A8
product of those e4m3 values and scales (so any difference is the engine's: its fused blocks, scales
and paths), and against the unquantized model (the accuracy fp8 costs).

Formats (public descriptions):
- `quant_method: fp8` (transformers FineGrainedFP8Config / vLLM Fp8Config): `<m>.weight` float8_e4m3fn,
  `<m>.weight_scale_inv` fp32 [ceil(N/bn), ceil(K/bk)] with `weight_block_size: [bn, bk]` (real = value *
  scale of its block), or without a block size a per-tensor `<m>.weight_scale` (and with
  `activation_scheme: static` an `<m>.input_scale`).
- `compressed-tensors` (`format: float-quantized`): `<m>.weight` float8_e4m3fn, `<m>.weight_scale`
  [N, 1] (strategy channel) or [1] (strategy tensor), `<m>.input_scale` [1] for static activations;
  `ignore: ["lm_head"]`.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import radixlm  # noqa: E402
from radixlm.core.errors import UnsupportedModelError  # noqa: E402
from radixlm.core.runtime.quantization.fp8 import Fp8Linear  # noqa: E402
from radixlm.kernels import quant_reference as qref  # noqa: E402
from radixlm.kernels import reference as ref  # noqa: E402

FP8 = torch.float8_e4m3fn
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = ["In a quiet village by the sea, the old lighthouse keeper told every visitor the same story",
           "Completely unrelated words about a whale"]
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


# ------------------------------------------------------------------------------------------ kernels

def test_quantize_rows_maps_each_rows_largest_magnitude_to_448():
    x = torch.randn(5, 70) * torch.tensor([1e-3, 1.0, 30.0, 1e4, 0.0])[:, None]
    q, scale = qref.quantize_fp8_rows(x)
    assert q.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == (5,)
    assert torch.equal(q.float().abs().amax(1)[:4], torch.full((4,), 448.0))
    assert not torch.isnan(q.float()).any() and float(q.float()[4].abs().max()) == 0.0
    # round to nearest e4m3: within half a step (2^-4 relative) of x / scale
    rel = ((q.float() * scale[:, None] - x).abs() / x.abs().clamp_min(1e-30))[:4]
    assert float(rel[x[:4].abs() / scale[:4, None] >= 2 ** -6].max()) <= 2 ** -4 + 1e-6


def test_fp8_linear_reference_is_the_dequantized_product():
    x = torch.randn(6, 96)
    w, b = torch.randn(40, 96) / 10, torch.randn(40)
    wq, ws = qref.quantize_fp8_rows(w)
    xq, xs = qref.quantize_fp8_rows(x)
    product = (xq.float() * xs[:, None]) @ (wq.float() * ws[:, None]).t()
    # written in bf16 before the bias, as cuBLASLt's row-wise scaled GEMM does
    want = product.to(torch.bfloat16).float() + b
    torch.testing.assert_close(qref.fp8_linear(x, wq, ws, b), want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(qref.fp8_linear(x, wq, ws, b), product + b)
    # and within fp8's error of the unquantized product: |err| <= 2 * 2^-4 of sum |x||w| (both rounded)
    bound = 2 * 2 ** -4 * (x.abs() @ w.abs().t())
    assert bool(((qref.fp8_linear(x, wq, ws) - x @ w.t()).abs() <= bound).all())


def test_triton_quantize_rows_equals_reference():
    """Scales to the bit; values within one e4m3 step: Triton's interpreter (these CPU runs) casts fp32 to
    e4m3 without carrying a rounded-up mantissa into the exponent and breaks ties upward, where the GPU's
    cvt.rn.satfinite rounds to nearest even. benchmarks/gpu_check.py asserts equality to the bit on the GPU."""
    from radixlm.kernels.triton import fp8_gemm as tri_fp8

    x = (torch.randn(7, 300) * 3).to(torch.bfloat16)
    q, s = tri_fp8.quantize_fp8_rows(x)
    q_ref, s_ref = qref.quantize_fp8_rows(x)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    assert (q.float() - q_ref.float()).abs().le(q_ref.float().abs() * 2 ** -1).all()
    assert float((q.float() == q_ref.float()).float().mean()) > 0.9


def test_triton_fp8_linear_against_reference():
    """The CUDA path (quantize kernel + torch._scaled_mm, which torch also runs on the CPU): the product of
    the kernel's e4m3 activations and scales with the weight's, plus bias, up to the bf16 output's rounding."""
    from radixlm.kernels import triton as tri
    from radixlm.kernels.triton import fp8_gemm as tri_fp8

    x = torch.randn(9, 64).to(torch.bfloat16)
    wq, ws = qref.quantize_fp8_rows(torch.randn(48, 64) / 8)
    b = torch.randn(48).to(torch.bfloat16)
    xq, xs = tri_fp8.quantize_fp8_rows(x)
    want = (xq.float() @ wq.float().t()) * xs[:, None] * ws[None, :] + b.float()
    got = tri.fp8_linear(x, wq, ws, b).float()
    assert (got - want).abs().max() <= 2 * 2 ** -8 * want.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fp8_gemvs_stream_the_e4m3_weight(dtype, monkeypatch):
    """The decode GEMVs with an fp8 weight and per-row scales against the reference (the dequantized
    weight in fp32): every fused variant, with tails in N and K."""
    from radixlm.kernels import triton as tri

    monkeypatch.setenv("RADIXLM_GEMV_CONFIG", "8,32,4,2")
    n, k, rows = 37, 100, 3
    wq, ws = qref.quantize_fp8_rows(torch.randn(n, k) / k ** 0.5)
    x, b = torch.randn(rows, k).to(dtype), torch.randn(n).to(dtype)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(tri.gemv(x, wq, b, ws), ref.gemv(x, wq, b, ws), **tol)
    residual, norm_w = torch.randn(rows, n).to(dtype), torch.randn(n).to(dtype)
    for ours, theirs in zip(tri.residual_gemv(x, wq, residual, norm_w, weight_scale=ws)[:2],
                            ref.residual_gemv(x, wq, residual, norm_w, weight_scale=ws)[:2]):
        torch.testing.assert_close(ours, theirs, **tol)
    sums = torch.rand(rows, 3) * k
    torch.testing.assert_close(tri.rms_scaled_gemv(x, sums, 1e-6, wq, b, ws),
                               ref.rms_scaled_gemv(x, sums, 1e-6, wq, b, ws), **tol)


# ------------------------------------------------------------------------------ checkpoint writers

def _copy_aux_files(src: str, dst: str) -> dict:
    os.makedirs(dst)
    for name in os.listdir(src):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(src, name), dst)
    with open(os.path.join(src, "config.json")) as f:
        return json.load(f)


def write_fp8_checkpoint(src: str, dst: str, form: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Quantizes src's projections into dst in `form` ("fp8-tensor", "fp8-block", "ct-channel",
    "ct-tensor"); returns {module: (e4m3 values, per-row scales)} as the format defines the real weight
    (for block scales: the dequantized weight and ones)."""
    cfg = _copy_aux_files(src, dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    out, truth = {}, {}
    for name, w in tensors.items():
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or module.rpartition(".")[2] not in PROJ:
            out[name] = w
            continue
        if form == "fp8-block":
            bn, bk = 32, 48  # K = 64 and 128: the last column block is partial
            rows, cols = w.shape
            nb, kb = -(-rows // bn), -(-cols // bk)
            padded = torch.zeros(nb * bn, kb * bk)
            padded[:rows, :cols] = w
            blocks = padded.view(nb, bn, kb, bk).abs().amax((1, 3)) / 448
            full = blocks.repeat_interleave(bn, 0)[:rows].repeat_interleave(bk, 1)[:, :cols]
            q = (w / full).clamp(-448, 448).to(FP8)
            out[name], out[f"{module}.weight_scale_inv"] = q, blocks
            truth[module] = (q.float() * full, torch.ones(rows))
            continue
        per_tensor = form in ("fp8-tensor", "ct-tensor")
        scale = (w.abs().amax() if per_tensor else w.abs().amax(1, keepdim=True)) / 448
        q = (w / scale).clamp(-448, 448).to(FP8)
        out[name] = q
        out[f"{module}.weight_scale"] = scale.reshape(1) if form == "ct-tensor" else (
            scale.reshape(()) if per_tensor else scale)
        if form in ("fp8-tensor", "ct-tensor"):
            out[f"{module}.input_scale"] = torch.tensor([0.05]).reshape(() if form == "fp8-tensor" else 1)
        truth[module] = (q, scale.reshape(-1).expand(w.shape[0]).clone())
    if form.startswith("fp8"):
        cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme":
                                      "static" if form == "fp8-tensor" else "dynamic",
                                      **({"weight_block_size": [32, 48]} if form == "fp8-block" else {})}
    else:
        strategy = form.removeprefix("ct-")
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True,
                            "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                      "symmetric": True, "dynamic": False}}}}
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return truth


def w8a8_oracle(src: str, truth: dict[str, tuple[torch.Tensor, torch.Tensor]]):
    """transformers' fp32 model of src with every projection computing the W8A8 product of `truth`'s
    e4m3 values and scales (the reference's dynamic per-token activation scales)."""
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()

    class W8A8(torch.nn.Module):
        def __init__(self, values, scales, bias):
            super().__init__()
            self.values, self.scales, self.bias = values, scales, bias

        def forward(self, x):
            flat = x.reshape(-1, x.shape[-1])
            if self.values.dtype == FP8:
                out = qref.fp8_linear(flat, self.values, self.scales, self.bias)
            else:  # block-scaled: requantized per row as the format conversion does
                out = qref.fp8_linear(flat, *qref.quantize_fp8_rows(self.values), self.bias)
            return out.reshape(*x.shape[:-1], -1)

    for module, (values, scales) in truth.items():
        owner, _, attr = module.rpartition(".")
        linear = model.get_submodule(owner).get_submodule(attr)
        setattr(model.get_submodule(owner), attr, W8A8(values, scales, linear.bias))
    return model


def prompt_logprobs(model, tok, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


def engine_logprobs(path: str, **options) -> tuple[list[list[int]], list[torch.Tensor]]:
    with radixlm.Engine(path, max_total_tokens=1024, log_level="warning", **options) as engine:
        outs = engine.generate(PROMPTS, GREEDY, return_logprob=True, logprob_start_len=0)
        kinds = {type(m) for m in engine._runner.model.modules()}
    assert Fp8Linear in kinds
    ids = [[t for _, t, _ in o["meta_info"]["input_token_logprobs"]] + o["output_ids"] for o in outs]
    lps = [torch.tensor([lp for lp, _, _ in o["meta_info"]["input_token_logprobs"][1:]]) for o in outs]
    return ids, lps


def assert_matches_w8a8_oracle(engine_path: str, hf_path: str, truth, **options) -> None:
    """The engine's prompt logprobs equal the oracle's: on average within 1e-3, each within 2e-2 (fp32 sums
    in another order put a rare activation on the other side of an e4m3 rounding edge); and so does its
    greedy continuation."""
    ids, lps = engine_logprobs(engine_path, **options)
    oracle = w8a8_oracle(hf_path, truth)
    tok = AutoTokenizer.from_pretrained(hf_path)
    for seq, lp, prompt in zip(ids, lps, PROMPTS):
        n = len(tok(prompt)["input_ids"])
        want = prompt_logprobs(oracle, tok, seq)
        delta = (lp - want[: n - 1]).abs()
        assert float(delta.mean()) < 1e-3 and float(delta.max()) < 2e-2, delta
        assert seq[n:] == [int(t) for t in _greedy(oracle, seq[:n], GREEDY["max_new_tokens"])]


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


# ---------------------------------------------------------------------------------------- models

@pytest.mark.parametrize("ckpt", ["llama_ckpt", "qwen2_ckpt"])
def test_quantize_at_load_matches_w8a8_oracle(ckpt, request):
    path = request.getfixturevalue(ckpt)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    truth = {name.removesuffix(".weight"): qref.quantize_fp8_rows(w) for name, w in tensors.items()
             if name.endswith(".weight") and name.removesuffix(".weight").rpartition(".")[2] in PROJ}
    assert_matches_w8a8_oracle(path, path, truth, quantization="fp8")


@pytest.mark.parametrize("form", ["fp8-tensor", "fp8-block", "ct-channel", "ct-tensor"])
def test_fp8_checkpoints_load_directly(form, llama_ckpt, qwen2_ckpt, tmp_path):
    src = qwen2_ckpt if form.startswith("ct") else llama_ckpt
    dst = str(tmp_path / form)
    truth = write_fp8_checkpoint(src, dst, form)
    assert_matches_w8a8_oracle(dst, src, truth)


def test_fp8_checkpoint_values_load_unchanged(llama_ckpt, tmp_path):
    """Per-tensor scales of q, k and v become the fused layer's per-row scales; the e4m3 values are the
    checkpoint's to the bit."""
    from radixlm.core.runtime.models.config import ModelConfig
    from radixlm.core.runtime.models.loader import load_model
    from radixlm.kernels import cpu

    dst = str(tmp_path / "ckpt")
    truth = write_fp8_checkpoint(llama_ckpt, dst, "fp8-tensor")
    model = load_model(dst, ModelConfig.from_dir(dst), torch.float32, torch.device("cpu"), cpu)
    qkv = model.layers[1].self_attn.qkv_proj
    parts = [truth[f"model.layers.1.self_attn.{p}"] for p in ("q_proj", "k_proj", "v_proj")]
    assert torch.equal(qkv.weight.view(torch.uint8), torch.cat([q for q, _ in parts]).view(torch.uint8))
    assert torch.equal(qkv.weight_scale, torch.cat([s for _, s in parts]))
    assert type(model.lm_head) is torch.nn.Linear


def test_fp8_accuracy_against_unquantized(llama_ckpt):
    """What fp8 costs on the tiny random model (logits spread over a few units, so more sensitive than a
    trained model): mean |delta logprob| of the prompts' tokens under 0.5 nats."""
    _, fp8 = engine_logprobs(llama_ckpt, quantization="fp8")
    with radixlm.Engine(llama_ckpt, max_total_tokens=1024, log_level="warning") as engine:
        outs = engine.generate(PROMPTS, GREEDY, return_logprob=True, logprob_start_len=0)
    plain = [torch.tensor([lp for lp, _, _ in o["meta_info"]["input_token_logprobs"][1:]]) for o in outs]
    delta = torch.cat([(a - b).abs() for a, b in zip(fp8, plain)])
    assert 0 < float(delta.mean()) < 0.5


# ---------------------------------------------------------------------------------------- errors

def _with_quant_config(src: str, dst: str, qcfg: dict) -> str:
    cfg = _copy_aux_files(src, dst)
    shutil.copy(os.path.join(src, "model.safetensors"), dst)
    cfg["quantization_config"] = qcfg
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


@pytest.mark.parametrize("qcfg, message", [
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
        "num_bits": 4, "type": "int", "strategy": "group"}}}}, "group 'g' has weights 4-bit int"),
])
def test_unsupported_checkpoints_are_refused_by_name(qcfg, message, llama_ckpt, tmp_path):
    dst = _with_quant_config(llama_ckpt, str(tmp_path / "c"), qcfg)
    with pytest.raises(UnsupportedModelError, match=message):
        radixlm.Engine(dst, log_level="warning")


def test_fp8_tensor_without_scale_is_named(llama_ckpt, tmp_path):
    dst = str(tmp_path / "c")
    write_fp8_checkpoint(llama_ckpt, dst, "ct-channel")
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    del tensors["model.layers.0.mlp.down_proj.weight_scale"]
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match=r"'model.layers.0.mlp.down_proj.weight' has no"):
        radixlm.Engine(dst, log_level="warning")


def test_e5m2_weights_and_bad_option_are_refused(llama_ckpt, tmp_path):
    dst = str(tmp_path / "c")
    write_fp8_checkpoint(llama_ckpt, dst, "ct-channel")
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    tensors["model.layers.1.self_attn.o_proj.weight"] = tensors["model.layers.1.self_attn.o_proj.weight"].to(
        torch.float8_e5m2)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match=r"'model.layers.1.self_attn.o_proj.weight' is torch.float8_e5m2"):
        radixlm.Engine(dst, log_level="warning")
    with pytest.raises(Exception, match="quantization must be one of"):
        radixlm.Engine(llama_ckpt, quantization="int3")


def test_fp8_checkpoint_under_tensor_parallelism(llama_ckpt, tmp_path):
    """tp=2 (spawned ranks, gloo) on a per-channel fp8 checkpoint: column-parallel layers split rows with
    their scales, row-parallel ones keep every row's scale and quantize their shard of the activations
    per token, so tp=2 differs from tp=1 by fp8 rounding alone: prompt logprobs within a third of what fp8
    itself costs on this model (test_fp8_accuracy_against_unquantized's < 0.5), where a misplaced
    scale would cost several nats."""
    dst = str(tmp_path / "ct")
    write_fp8_checkpoint(llama_ckpt, dst, "ct-channel")
    runs = {}
    for tp in (1, 2):
        with radixlm.Engine(dst, tp_size=tp, max_total_tokens=512, log_level="warning") as engine:
            outs = engine.generate(PROMPTS, GREEDY, return_logprob=True, logprob_start_len=0)
        runs[tp] = torch.cat([torch.tensor([lp for lp, _, _ in o["meta_info"]["input_token_logprobs"][1:]])
                              for o in outs])
    assert float((runs[1] - runs[2]).abs().mean()) < 0.17
