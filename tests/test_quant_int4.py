"""4-bit AWQ and GPTQ checkpoints (core.runtime.quantization.int4): checkpoints written here from the
formats' public descriptions (AutoAWQ's GEMM packing, AutoGPTQ's packing; group size 128; zero points
as each stores them) on tiny Llama and Qwen2 shapes, loaded by the engine and compared with transformers
(fp32) running the dequantized weights; the Triton kernel against its twin. transformers itself loads
these formats only through autoawq / gptqmodel on CUDA, so the dequantized model is the oracle here.

- AWQ: `qweight` int32 [K, N/8], nibble i of word c holds column 8c + (0, 2, 4, 6, 1, 3, 5, 7)[i];
  `qzeros` int32 [K/g, N/8] packed alike; `scales` fp16 [K/g, N]; weight = (q - zero) * scale.
- GPTQ: `qweight` int32 [K/8, N], nibble j of row i is input 8i + j; `qzeros` int32 [K/g, N/8] in
  order, storing zero - 1 (checkpoint_format "gptq"); `scales` fp16 [K/g, N]; `g_idx` int32 [K].
"""

from __future__ import annotations

import json
import os
import shutil

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import radixlm  # noqa: E402
from radixlm.core.errors import UnsupportedModelError  # noqa: E402
from radixlm.core.runtime.quantization.int4 import Int4Linear  # noqa: E402
from radixlm.testing.checkpoints import build_checkpoint  # noqa: E402
from radixlm.kernels import quant_reference as qref  # noqa: E402

GROUP = 128
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
PROMPTS = ["In a quiet village by the sea, the old lighthouse keeper told every visitor the same story",
           "Completely unrelated words"]


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min-max 4-bit per group of GROUP inputs: (q [N, K] 0..15, zeros [N, G], fp16 scales [N, G])."""
    n, k = w.shape
    g = w.view(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp_min(1e-8).half()
    zero = (-lo / scale.float()).round().clamp(0, 15)
    q = (g / scale.float()[..., None] + zero[..., None]).round().clamp(0, 15)
    return q.view(n, k).to(torch.int32), zero.to(torch.int32), scale


def _pack_words(values: torch.Tensor, order: list[int]) -> torch.Tensor:
    """[R, C] 0..15 -> int32 [R, C / 8]: nibble i of word c holds column 8c + order[i]."""
    v = values.view(values.shape[0], -1, 8)[..., order].to(torch.int64)
    words = sum(v[..., i] << (4 * i) for i in range(8))
    return (words - ((words >> 31) << 32)).to(torch.int32)  # two's complement into int32


def write_int4_checkpoint(src: str, dst: str, method: str) -> dict[str, torch.Tensor]:
    """src's projections quantized into dst in `method`'s format; returns the dequantized weights."""
    os.makedirs(dst)
    for name in os.listdir(src):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(src, name), dst)
    out, truth = {}, {}
    for name, w in load_file(os.path.join(src, "model.safetensors")).items():
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or module.rpartition(".")[2] not in PROJ:
            out[name] = w
            continue
        q, zero, scale = _quantize(w)
        truth[name] = (q - zero.repeat_interleave(GROUP, 1)).float() * scale.float().repeat_interleave(GROUP, 1)
        if method == "awq":
            out[f"{module}.qweight"] = _pack_words(q.t().contiguous(), AWQ_ORDER)
            out[f"{module}.qzeros"] = _pack_words(zero.t().contiguous(), AWQ_ORDER)
        else:
            qk = q.t().contiguous().view(-1, 8, q.shape[0]).transpose(1, 2)  # [K/8, N, 8]: input 8i + j
            out[f"{module}.qweight"] = _pack_words(qk.reshape(qk.shape[0], -1), list(range(8)))
            out[f"{module}.qzeros"] = _pack_words((zero - 1).t().contiguous(), list(range(8)))
            out[f"{module}.g_idx"] = torch.arange(w.shape[1], dtype=torch.int32) // GROUP
        out[f"{module}.scales"] = scale.t().contiguous()
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = ({"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
                                   "version": "gemm"} if method == "awq" else
                                  {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False,
                                   "sym": False, "checkpoint_format": "gptq"})
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return truth


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def wide_ckpt(request, tmp_path_factory) -> str:
    """Tiny shapes with inputs in whole groups of 128: hidden 128, intermediate 256."""
    path = str(tmp_path_factory.mktemp("int4") / request.param)
    return build_checkpoint(path, request.param, hidden_size=128, intermediate_size=256)


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_int4_checkpoint_matches_dequantized_model(method, wide_ckpt, tmp_path):
    """fp32 engine (the CPU twin: dequantize, fp32 product) against transformers fp32 holding the
    dequantized weights: prompt logprobs within 1e-4 and greedy tokens equal."""
    dst = str(tmp_path / method)
    truth = write_int4_checkpoint(wide_ckpt, dst, method)
    oracle = AutoModelForCausalLM.from_pretrained(wide_ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, w in truth.items():
            oracle.get_parameter(name).copy_(w)
    greedy = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    with radixlm.Engine(dst, log_level="warning", max_total_tokens=1024) as engine:
        assert isinstance(engine._runner.model.layers[0].self_attn.qkv_proj, Int4Linear)
        outs = engine.generate(PROMPTS, greedy, return_logprob=True, logprob_start_len=0)
    for out in outs:
        ids = [t for _, t, _ in out["meta_info"]["input_token_logprobs"]] + out["output_ids"]
        with torch.no_grad():
            lsm = torch.log_softmax(oracle(torch.tensor([ids])).logits[0], -1)
        ours = torch.tensor([lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]])
        n = len(ours) + 1
        torch.testing.assert_close(ours, lsm[torch.arange(n - 1), torch.tensor(ids[1:n])], atol=1e-4, rtol=0)
        want = list(ids[:n])
        with torch.no_grad():
            for _ in range(greedy["max_new_tokens"]):
                want.append(int(oracle(torch.tensor([want])).logits[0, -1].argmax()))
        assert out["output_ids"] == want[n:]


def test_pack_int4_layout():
    """pack_int4's layout as the kernels read it, checked bit by bit in Python integers: word 4b + s of a
    row holds columns 32b + 4j + s in nibble j (bits 4j..4j+3); unpack_int4 inverts it."""
    q = torch.randint(0, 16, (3, 96))
    packed = qref.pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (3, 12)
    for row in range(3):
        for w in range(12):
            word = int(packed[row, w]) & 0xFFFFFFFF
            assert [(word >> 4 * j) & 0xF for j in range(8)] == [int(q[row, 32 * (w // 4) + 4 * j + w % 4])
                                                              for j in range(8)]
    assert torch.equal(qref.unpack_int4(packed), q.to(torch.uint8))
    with pytest.raises(ValueError, match="blocks of 32"):
        qref.pack_int4(torch.zeros(2, 48))


@pytest.mark.parametrize("rows,group,groups", [
    (1, 128, 4), (2, 32, 65), (3, 64, 5), (4, 32, 33), (1, 128, 17),  # the GEMV: 1..4 rows, K steps and tails
    (5, 128, 4), (17, 96, 3), (40, 32, 7), (64, 64, 5),  # the GEMM: 5..64 rows, K tails, a group of 96
    (256, 64, 17)])  # from DEQUANT_MIN_ROWS: dequantized (K = 1,088: a tail of the 1,024-column tiles), then torch
def test_triton_int4_gemm_against_reference(rows, group, groups):
    """fp32 under Triton's interpreter (whose bf16 tl.dot is broken; benchmarks/gpu_check_quant.py checks
    bf16 on the GPU), odd N: up to 4 rows the GEMV (64, 32 or 16 blocks of 32 columns a step: K = 2,080,
    1,056 and 2,176 take several steps and a tail), more rows the GEMM (256 or 128 columns a step), from
    256 rows the dequantizing kernel and torch's product."""
    from radixlm.kernels.triton import int4_gemm

    n, k = 41, groups * group
    q = torch.randint(0, 16, (n, k))
    packed = qref.pack_int4(q)
    scales, zeros = torch.rand(n, k // group) / 50, torch.randint(0, 16, (n, k // group)).float()
    zeros[0] = torch.randn(k // group) * 40  # GGUF Q4_1's zeros (-m / d) are any float
    x, bias = torch.randn(rows, k), torch.randn(n)
    got = int4_gemm.int4_linear(x, packed, scales, zeros, bias)
    want = qref.int4_linear(x, packed, scales, zeros, bias)
    # Both are fp32 sums of the same products in other orders (the GEMV's per group: scale * (16 sum f x
    # - (16 + zero) sum x)): within 2^-20 of sum |x| |w| (about 16 fp32 ulps; ~1e-7 seen).
    w = (q - zeros.repeat_interleave(group, 1)) * scales.repeat_interleave(group, 1)
    bound = 2.0**-20 * (x.abs() @ w.abs().t() + bias.abs())
    assert ((got - want).abs() <= bound).all(), float(((got - want).abs() / bound).max())


def test_desc_act_and_other_bits_are_refused(llama_ckpt, tmp_path):
    for i, (qcfg, message) in enumerate([
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}, "desc_act=true"),
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "bits=8"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 48}, "group_size=48"),  # not whole blocks of 32
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv_fast"}, "version 'gemv_fast'"),
    ]):
        dst = tmp_path / str(i)
        shutil.copytree(llama_ckpt, dst)
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**cfg, "quantization_config": qcfg}))
        with pytest.raises(UnsupportedModelError, match=message):
            radixlm.Engine(str(dst), log_level="warning")
    with pytest.raises(UnsupportedModelError, match="needs a checkpoint quantized with it"):
        radixlm.Engine(llama_ckpt, quantization="awq", log_level="warning")


def test_act_order_g_idx_is_named(wide_ckpt, tmp_path):
    dst = str(tmp_path / "gptq")
    write_int4_checkpoint(wide_ckpt, dst, "gptq")
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.g_idx"  # K = 256: two groups
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match=r"model.layers.1.mlp.down_proj.g_idx orders the inputs"):
        radixlm.Engine(dst, log_level="warning")


def test_kv_sizing_reserves_the_prefill_dequantization_buffer(wide_ckpt, tmp_path):
    """From 256 rows a 4-bit layer dequantizes its weight into a transient buffer of the model dtype: the
    KV pool's sizing must leave room for the largest (here gate_up, 512 x 128 fp32) beside the activations."""
    from radixlm.core.runtime.execution.model_runner import ModelRunner
    from radixlm.core.runtime.models.config import ModelConfig
    from radixlm.core.runtime.options import EngineOptions

    dst = str(tmp_path / "awq")
    write_int4_checkpoint(wide_ckpt, dst, "awq")
    opts = EngineOptions.from_kwargs({"device": "cpu", "max_total_tokens": 512})
    reserve = {path: ModelRunner(path, ModelConfig.from_dir(path), opts)._activation_reserve(opts)
               for path in (wide_ckpt, dst)}
    assert reserve[dst] - reserve[wide_ckpt] == 512 * 128 * 4
