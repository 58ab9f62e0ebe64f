"""GGUF weights kept quantized on the CPU (quantization="gguf", core.runtime.quantization.gguf_kept):
each quantized layer against the dequantized weight (gguf's own numpy dequantizer), and the engine on
files written with gguf's writer (Q4_0, Q4_1 and Q8_0 projections, a tied Q8_0 LM head, a fused layer
of mixed types that stays dequantized) against transformers' loading of the same file (fp32)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # the 4-bit Triton kernels on the CPU

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402
from test_gguf import GGUFOracle, write_gguf  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import radixlm  # noqa: E402
from radixlm.core.errors import UnsupportedModelError  # noqa: E402
from radixlm.core.runtime.models import gguf_dequant  # noqa: E402
from radixlm.core.runtime.quantization.gguf_kept import Int4GroupLinear, Int8GroupLinear, int4_layer  # noqa: E402
from radixlm.kernels import quant_reference  # noqa: E402

LAYER_TYPES = [
    {"attn_q": Q.Q4_1, "attn_k": Q.Q4_1, "attn_v": Q.Q4_1, "attn_output": Q.Q4_0,
     "ffn_gate": Q.Q8_0, "ffn_up": Q.Q8_0, "ffn_down": Q.Q4_1},
    {"attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q4_0, "attn_output": Q.Q8_0,  # qkv of mixed types
     "ffn_gate": Q.Q4_0, "ffn_up": Q.Q4_0, "ffn_down": Q.Q8_0},
]
PROMPTS = ["In a quiet village by the sea, the old lighthouse keeper told every visitor", "x y z"]


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
def test_quantized_layer_against_dequantized_weight(qtype):
    """The layer on the file's blocks against x @ W.T with W from gguf's dequantizer, in fp32: within
    the bf16 rounding of activations, scales and output (|err| <= 2^-7 of sum |x||W| + 2^-8 |out|)."""
    rng = np.random.default_rng(0)
    rows, cols = 48, 96
    raw = gguf.quants.quantize(rng.normal(0, 0.2, (rows, cols)).astype(np.float32), qtype)
    w = torch.from_numpy(gguf.quants.dequantize(raw, qtype)).reshape(rows, cols)
    q, d, m = gguf_dequant.integer_blocks(torch.from_numpy(raw.reshape(-1)), qtype, (rows, cols))
    if qtype == Q.Q8_0:
        layer = Int8GroupLinear(q, d, None)
    else:
        layer = Int4GroupLinear(q, d, torch.zeros_like(d) if m is None else m + 8 * d, None)
    x = torch.randn(5, cols)
    want = x @ w.t()
    bound = 2 ** -7 * (x.abs() @ w.abs().t()) + 2 ** -8 * want.abs()
    assert bool(((layer(x) - want).abs() <= bound).all())
    assert layer(x).dtype == torch.float32


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
@pytest.mark.parametrize("kernels,rows", [("twin", 5), ("triton", 1), ("triton", 5)])
def test_cuda_layer_form_equals_the_dequantized_weight(qtype, kernels, rows):
    """On CUDA a Q4_0 / Q4_1 weight runs as the AWQ/GPTQ layer ((q - zero) * scale, groups of 32): its
    product equals x @ W.T with W from gguf's dequantizer to fp32 rounding, a Q4_1 block of d = 0 (m
    alone) included: the kernels' fp32 twin, and the Triton kernels themselves (interpreted on the CPU:
    the decode GEMV at one row, the GEMM at five)."""
    rng = np.random.default_rng(1)
    rows, cols = 24, 128
    w = rng.normal(0, 0.2, (rows, cols)).astype(np.float32)
    w[3, 32:64] = 0.125  # one constant block: Q4_1 stores d = 0, m = 0.125
    raw = gguf.quants.quantize(w, qtype)
    want_w = torch.from_numpy(gguf.quants.dequantize(raw, qtype)).reshape(rows, cols)
    q, d, m = gguf_dequant.integer_blocks(torch.from_numpy(raw.reshape(-1)), qtype, (rows, cols))
    if qtype == Q.Q4_1:
        assert float(d[3, 1]) == 0 and float(m[3, 1]) != 0
    if kernels == "triton":
        from radixlm.kernels import triton as ops
    else:
        ops = quant_reference
    layer = int4_layer(q, d, m, None, ops)
    x = torch.randn(rows, cols)
    torch.testing.assert_close(layer(x), x @ want_w.t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_engine_keeps_gguf_quantized(arch, tmp_path):
    """Llama (rows of q and k unpermuted, untied Q6_K output: stays dequantized) and Qwen2 (q/k/v biases,
    the tied Q8_0 embedding as an int8 LM head): prompt logprobs as close to transformers' fp32 run on the
    dequantized file as transformers' own bf16 run is (the products round activations, scales and outputs
    to bf16; these random models amplify that), mean and max each within 1.5x of it + 0.01; the same
    greedy tokens where the fp32 top-2 margin exceeds twice the bf16 run's largest error."""
    path = write_gguf(str(tmp_path / f"{arch}.gguf"), arch, seed=3, tie=arch == "qwen2", layer_types=LAYER_TYPES)
    oracle = GGUFOracle(path)
    bf16 = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=f"{arch}.gguf", dtype=torch.bfloat16).eval()
    with radixlm.Engine(path, quantization="gguf", log_level="warning", max_total_tokens=1024) as engine:
        model = engine._runner.model
        kinds = {name: type(m).__name__ for name, m in model.named_modules()}
        outs = engine.generate(PROMPTS, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
                               return_logprob=True, logprob_start_len=0)
    assert kinds["layers.0.self_attn.qkv_proj"] == "Int4GroupLinear"
    assert kinds["layers.0.mlp.gate_up_proj"] == kinds["layers.1.self_attn.o_proj"] == "Int8GroupLinear"
    assert kinds["layers.1.self_attn.qkv_proj"] == "PrepackedLinear"  # q Q4_0, k Q4_1: mixed, dequantized
    assert kinds["lm_head"] == ("Int8GroupLinear" if arch == "qwen2" else "PrepackedLinear")
    for out in outs:
        ids = [t for _, t, _ in out["meta_info"]["input_token_logprobs"]] + out["output_ids"]
        ref = oracle.logprobs(ids)
        ours = torch.tensor([lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]])
        want = ref[torch.arange(len(ours)), torch.tensor(ids[1:len(ours) + 1])]
        with torch.no_grad():
            hf_bf16 = torch.log_softmax(bf16(torch.tensor([ids])).logits[0].float(), -1)
        hf_delta = (hf_bf16[torch.arange(len(ours)), torch.tensor(ids[1:len(ours) + 1])] - want).abs()
        delta = (ours - want).abs()
        assert float(delta.mean()) <= 1.5 * float(hf_delta.mean()) + 0.01, (delta, hf_delta)
        assert float(delta.max()) <= 1.5 * float(hf_delta.max()) + 0.01, (delta, hf_delta)
        n = len(ours) + 1
        for j, tok in enumerate(out["output_ids"]):
            top = ref[n - 1 + j].topk(2)
            if float(top.values[0] - top.values[1]) > 2 * float(hf_delta.max()):
                assert tok == int(top.indices[0])
            else:
                break  # a near tie: the rest of the continuation may differ


def test_gguf_quantization_needs_a_gguf_file(llama_ckpt):
    with pytest.raises(UnsupportedModelError, match="not a GGUF file"):
        radixlm.Engine(llama_ckpt, quantization="gguf", log_level="warning")
