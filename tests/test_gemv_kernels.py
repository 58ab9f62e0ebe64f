"""The decode GEMV kernels (kernels/triton/decode_gemv.py) against their pure-torch twins, and a Llama decoder
layer with them (`fused_gemv_rows`) against the same layer on the unfused ops.

As in test_kernels.py, on CPU the kernels run under Triton's interpreter. Shapes have tails: N and K
are not multiples of any block, so every mask is exercised; launch shapes are forced small through
RADIXLM_GEMV_CONFIG so that one product spans several programs and several K steps.
"""

from __future__ import annotations

import os
import zlib

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from paged_kv import PagedBatch  # noqa: E402
from test_kernels import DEVICE, assert_close, randn  # noqa: E402

import radixlm  # noqa: E402
from radixlm.core.runtime.layers.attention_backend import AttentionBackend  # noqa: E402
from radixlm.core.runtime.layers.forward_batch import ForwardBatch  # noqa: E402
from radixlm.core.runtime.models.config import ModelConfig  # noqa: E402
from radixlm.core.runtime.models.llama import LlamaForCausalLM  # noqa: E402
from radixlm.kernels import quant_reference as qref  # noqa: E402
from radixlm.kernels import reference as ref  # noqa: E402
from radixlm.kernels import triton as tri  # noqa: E402
from radixlm.kernels.triton import decode_gemv as gemv_module  # noqa: E402
from radixlm.kernels.triton import int4_gemv  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
N, K = 37, 100  # tails against BLOCK_N 8 and BLOCK_K 32 below


@pytest.fixture(autouse=True)
def _seed_and_small_blocks(request, monkeypatch):
    torch.manual_seed(zlib.crc32(request.node.name.encode()))
    monkeypatch.setenv("RADIXLM_GEMV_CONFIG", "8,32,4,2")


def weights(dtype, bias: bool):
    # Scaled like a trained layer's (outputs of order 1), so that the tolerances mean the same per dtype.
    w = (torch.randn(N, K, device=DEVICE) / K**0.5).to(dtype)
    return w, (randn(N, dtype=dtype) if bias else None)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_gemv(dtype, rows, bias):
    w, b = weights(dtype, bias)
    x = randn(rows, K, dtype=dtype)
    assert_close(tri.gemv(x, w, b), ref.gemv(x, w, b))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("silu", [False, True], ids=["o_proj", "down_proj"])
def test_residual_gemv(dtype, rows, silu):
    w, _ = weights(dtype, bias=False)
    x = randn(rows, 2 * K if silu else K, dtype=dtype)
    residual = randn(rows, N, dtype=dtype)
    norm_w = (torch.rand(N, device=DEVICE) + 0.5).to(dtype)
    summed, normed, sums = tri.residual_gemv(x, w, residual, norm_w, silu=silu)
    ref_summed, ref_normed, ref_sums = ref.residual_gemv(x, w, residual, norm_w, silu=silu)
    assert_close(summed, ref_summed)
    assert_close(normed, ref_normed)
    # One partial sum per program (BLOCK_N 8 from the fixture): 37 outputs -> 5.
    assert sums.shape == (rows, 5) and sums.dtype == torch.float32
    # The sums are of the stored h (rounded once, where the reference rounds the product and the sum).
    torch.testing.assert_close(sums.sum(-1), summed.float().pow(2).sum(-1), rtol=1e-5, atol=0)
    torch.testing.assert_close(sums.sum(-1), ref_sums.sum(-1), rtol=2e-2, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 3])
def test_norm_split_across_two_gemvs_equals_the_norm(dtype, rows):
    """o_proj's residual_gemv then qkv's rms_scaled_gemv against the unfused ops they replace
    (gemv, fused_add_rms_norm, gemv), with a bias on the second as Qwen2's qkv has."""
    w1, _ = weights(dtype, bias=False)  # [N, K]: K -> N
    w2 = (torch.randn(K, N, device=DEVICE) / N**0.5).to(dtype)  # N -> K, after the norm over N
    b2 = randn(K, dtype=dtype)
    x, residual = randn(rows, K, dtype=dtype), randn(rows, N, dtype=dtype)
    norm_w = (torch.rand(N, device=DEVICE) + 0.5).to(dtype)
    summed, normed, sums = tri.residual_gemv(x, w1, residual, norm_w)
    out = tri.rms_scaled_gemv(normed, sums, 1e-6, w2, b2)

    def unfused(*tensors):
        x, w1, residual, norm_w, w2, b2 = tensors
        h, summed = ref.fused_add_rms_norm(ref.gemv(x, w1), residual, norm_w, 1e-6)
        return ref.gemv(h, w2, b2), summed

    exact_out, exact_summed = unfused(*(t.float() for t in (x, w1, residual, norm_w, w2, b2)))
    plain_out, plain_summed = unfused(x, w1, residual, norm_w, w2, b2)
    # Both round at different points: the fused pair must be about as close to fp32 as the unfused ops
    # (within half their error and two roundings of the largest output more).
    for got, plain, exact in ((out, plain_out, exact_out), (summed, plain_summed, exact_summed)):
        plain_err = (plain.float() - exact).abs().max().item()
        ulp = exact.abs().max().item() * torch.finfo(dtype).eps
        assert (got.float() - exact).abs().max().item() <= 1.5 * plain_err + 2 * ulp, (got, plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("scaled", [False, True], ids=["normed", "scaled"])
@pytest.mark.parametrize("shape", [(4, 2, 24), (2, 1, 16)], ids=lambda s: f"H{s[0]}-KH{s[1]}-D{s[2]}")
def test_rotary_qkv_gemv(dtype, rows, scaled, shape):
    """The qkv projection with the rotary and the KV store in its epilogue against the reference's
    projection, rotary and store: q returned, the new tokens' k and v in their slots, every other slot
    untouched. Launch shapes put 4 pairs in a program (D 24: 3 programs a head) and 2 K steps; a bias
    as Qwen2's qkv has."""
    num_heads, num_kv_heads, head_dim = shape
    n, k = (num_heads + 2 * num_kv_heads) * head_dim, 48
    w = (torch.randn(n, k, device=DEVICE) / k**0.5).to(dtype)
    b = randn(n, dtype=dtype)
    x = randn(rows, k, dtype=dtype)
    sums = (torch.rand(rows, 3, device=DEVICE) * k) if scaled else None
    cache = torch.randn(64, head_dim, device=DEVICE)
    positions = torch.randint(0, 64, (rows,), device=DEVICE)
    loc = torch.randperm(12, device=DEVICE)[:rows].to(torch.int32)
    pool = [torch.randn(12, num_kv_heads, head_dim, device=DEVICE).to(dtype) for _ in range(2)]
    pools = [[t.clone() for t in pool] for _ in range(2)]
    args = (positions, cache)

    def run(ops, pool, *tensors):
        x, w, b = tensors
        return [ops.rotary_qkv_gemv(x, sums, 1e-6, w, b, *args, *pool, loc, num_heads, num_kv_heads), *pool]

    got = run(tri, pools[0], x, w, b)
    plain = run(ref, pools[1], x, w, b)
    if dtype == torch.float32 or not scaled:
        for ours, theirs in zip(got, plain):
            assert_close(ours, theirs)
        return
    # Scaled, the kernel rounds once where the reference rounds the normed row first: as close to the
    # fp32 result as the reference (half its error and two roundings of the largest output more).
    exact = run(ref, [t.float() for t in pool], x.float(), w.float(), b.float())
    for ours, theirs, truth in zip(got, plain, exact):
        ulp = truth.abs().max().item() * torch.finfo(dtype).eps
        plain_err = (theirs.float() - truth).abs().max().item()
        assert (ours.float() - truth).abs().max().item() <= 1.5 * plain_err + 2 * ulp


# ----------------------------------------------------------------------------- 4-bit weights
K4 = 96  # three blocks of 32: three K steps at the fixture's BLOCK_K


def int4_weight(n: int, k: int, group: int = 32):
    """A 4-bit weight as the AWQ/GPTQ/GGUF layers hold it (pack_int4's words, fp32 scales and zeros per
    group), scaled like a trained layer's."""
    packed = qref.pack_int4(torch.randint(0, 16, (n, k))).to(DEVICE)
    scales = torch.rand(n, k // group, device=DEVICE) / (4 * k**0.5)
    return packed, scales, torch.randint(0, 16, (n, k // group), device=DEVICE).float()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_gemv_int4(dtype, rows):
    """A 4-bit weight through the same GEMV (weight_zero given): against the twin (the dequantized fp32
    product, quant_reference.int4_linear); N has a tail, K three steps."""
    w, scales, zeros = int4_weight(N, K4)
    b, x = randn(N, dtype=dtype), randn(rows, K4, dtype=dtype)
    assert_close(tri.gemv(x, w, b, scales, zeros), ref.gemv(x, w, b, scales, zeros))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("silu", [False, True], ids=["o_proj", "down_proj"])
def test_residual_and_scaled_gemv_int4(dtype, silu):
    """The epilogues on a 4-bit weight: residual_gemv (SiLU-and-mul first for down_proj) then
    rms_scaled_gemv over its outputs, against the twins."""
    w, scales, zeros = int4_weight(N, K4)
    x, residual = randn(2, 2 * K4 if silu else K4, dtype=dtype), randn(2, N, dtype=dtype)
    norm_w = (torch.rand(N, device=DEVICE) + 0.5).to(dtype)
    got = tri.residual_gemv(x, w, residual, norm_w, silu=silu, weight_scale=scales, weight_zero=zeros)
    want = ref.residual_gemv(x, w, residual, norm_w, silu=silu, weight_scale=scales, weight_zero=zeros)
    assert_close(got[0], want[0])
    assert_close(got[1], want[1])
    w2, scales2, zeros2 = int4_weight(K4, 64)  # a projection after a norm: 64 inputs, 96 outputs
    h = randn(2, 64, dtype=dtype)
    sums = torch.rand(2, 3, device=DEVICE) * 64
    assert_close(tri.rms_scaled_gemv(h, sums, 1e-6, w2, None, scales2, zeros2),
                 ref.rms_scaled_gemv(h, sums, 1e-6, w2, None, scales2, zeros2))


@pytest.mark.parametrize("group", [32, 64, 128])
def test_one_row_int4_with_a_partial_step(group, monkeypatch):
    """Batch-1 decode's product (the weight tile's layout, blocks of four words a lane) where K ends
    inside a step (12 blocks of 32 at 8 a step) and N inside a program, groups of 32, 64 and 128: the
    plain, SiLU-residual (SiLU inside, and a silu_and_mul launch first) and norm-scaled products against
    their twins (bf16 activations)."""
    monkeypatch.setenv("RADIXLM_GEMV_CONFIG", "16,256,4,1")
    k = 384
    w, scales, zeros = int4_weight(N, k, group)
    x, gate_up = randn(1, k, dtype=torch.bfloat16), randn(1, 2 * k, dtype=torch.bfloat16)
    assert_close(tri.gemv(x, w, None, scales, zeros), ref.gemv(x, w, None, scales, zeros))
    residual, norm_w = randn(1, N, dtype=torch.bfloat16), (torch.rand(N, device=DEVICE) + 0.5).to(torch.bfloat16)
    got = tri.residual_gemv(gate_up, w, residual, norm_w, silu=True, weight_scale=scales, weight_zero=zeros)
    want = ref.residual_gemv(gate_up, w, residual, norm_w, silu=True, weight_scale=scales, weight_zero=zeros)
    for ours, theirs in zip(got[:2], want[:2]):
        assert_close(ours, theirs)
    monkeypatch.setattr(gemv_module, "INT4_FUSED_SILU", not gemv_module.INT4_FUSED_SILU)  # the other SiLU route
    got = tri.residual_gemv(gate_up, w, residual, norm_w, silu=True, weight_scale=scales, weight_zero=zeros)
    for ours, theirs in zip(got[:2], want[:2]):
        assert_close(ours, theirs)
    sums = torch.rand(1, 3, device=DEVICE) * k
    assert_close(tri.rms_scaled_gemv(x, sums, 1e-6, w, None, scales, zeros),
                 ref.rms_scaled_gemv(x, sums, 1e-6, w, None, scales, zeros))
    # The scales' other load orientation (the one older Tritons take, int4_gemv.TIES_FIRST_FASTEST).
    monkeypatch.setattr(int4_gemv, "TIES_FIRST_FASTEST", triton.language.constexpr(not int4_gemv.TIES_FIRST_FASTEST))
    assert_close(tri.gemv(x, w, None, scales, zeros), ref.gemv(x, w, None, scales, zeros))
    # K a multiple of the step: no activation masks, the last step's prefetch clamped inside K.
    monkeypatch.setenv("RADIXLM_GEMV_CONFIG", "16,128,4,1")
    assert_close(tri.gemv(x, w, None, scales, zeros), ref.gemv(x, w, None, scales, zeros))


def test_packed_int4_switch(monkeypatch):
    """The packed path (inline PTX) is taken only where the kernels compile for CUDA and x is bf16/fp16:
    with INT4_PACKED on, the interpreter and fp32 activations keep the fp32 path (and its result)."""
    monkeypatch.setattr(gemv_module, "INT4_PACKED", True)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    assert gemv_module.int4_packed(torch.bfloat16) is (not interpreted)
    assert not gemv_module.int4_packed(torch.float32)
    w, scales, zeros = int4_weight(N, 64)
    x = randn(1, 64, dtype=torch.float32)
    assert_close(tri.gemv(x, w, None, scales, zeros), ref.gemv(x, w, None, scales, zeros))


def test_rotary_qkv_gemv_int4():
    """The qkv projection with the rotary and KV store in its epilogue, on a 4-bit weight (fp32)."""
    num_heads, num_kv_heads, head_dim = 4, 2, 16
    n, k = (num_heads + 2 * num_kv_heads) * head_dim, 64
    w, scales, zeros = int4_weight(n, k)
    x, b, sums = randn(3, k, dtype=torch.float32), randn(n, dtype=torch.float32), torch.rand(3, 2, device=DEVICE) * k
    cache = torch.randn(64, head_dim, device=DEVICE)
    positions, loc = torch.randint(0, 64, (3,), device=DEVICE), torch.randperm(12, device=DEVICE)[:3].to(torch.int32)
    pools = [[torch.zeros(12, num_kv_heads, head_dim, device=DEVICE) for _ in range(2)] for _ in range(2)]
    got, want = (ops.rotary_qkv_gemv(x, sums, 1e-6, w, b, positions, cache, *pool, loc, num_heads, num_kv_heads,
                                     scales, zeros) for ops, pool in ((tri, pools[0]), (ref, pools[1])))
    assert_close(got, want)
    for ours, theirs in zip(pools[0], pools[1]):
        assert_close(ours, theirs)


def test_default_configs_cover_the_8b_shapes(monkeypatch):
    """Without the override: every launch shape fills the GPU (>= 128 programs) and divides K, and
    bad input is refused with a message naming it."""
    monkeypatch.delenv("RADIXLM_GEMV_CONFIG")
    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]:
        for m in (1, 4, 8):
            block_n, block_k, _, _ = gemv_module.gemv_config(m, n, k)
            assert -(-n // block_n) >= 128 and k % block_k == 0, (m, n, k)
            block_n, block_k, _, _ = gemv_module.gemv_config(m, n, k, 0.5)  # 4-bit: steps of whole blocks of 32
            assert -(-n // block_n) >= 128 and k % block_k == 0 and block_k % 32 == 0, (m, n, k)
    w = torch.zeros(4, 8, device=DEVICE)
    with pytest.raises(AssertionError, match="at most"):
        tri.gemv(torch.zeros(17, 8, device=DEVICE), w)
    with pytest.raises(AssertionError, match="gate_up"):
        tri.residual_gemv(torch.zeros(1, 8, device=DEVICE), w, torch.zeros(1, 4, device=DEVICE), w[0], silu=True)
    with pytest.raises(AssertionError, match="residual"):
        tri.residual_gemv(torch.zeros(1, 8, device=DEVICE), w, torch.zeros(1, 5, device=DEVICE), w[0])


def run_layers(model: LlamaForCausalLM, dtype: torch.dtype, fused_rows: int) -> torch.Tensor:
    """The model's final hidden states for 3 decoding requests (their KV in a paged pool) in `dtype`,
    and layer 1's pool afterwards, as one flat fp32 tensor."""
    cfg, seq_lens = model.config, [9, 4, 13]
    torch.manual_seed(1)  # the same pool and tokens for every call
    batch = PagedBatch(seq_lens, cfg.num_kv_heads, cfg.head_dim, dtype, torch.int32, DEVICE)
    rows = batch.req_to_token[batch.req_pool_indices.long()]
    pool = type("Pool", (), {"k_buffers": [batch.k_buffer.clone() for _ in range(2)],
                             "v_buffers": [batch.v_buffer.clone() for _ in range(2)]})()
    fb = ForwardBatch(
        is_decode=True, input_ids=torch.randint(0, cfg.vocab_size, (3,), device=DEVICE),
        positions=torch.tensor(seq_lens, device=DEVICE) - 1,
        out_cache_loc=torch.stack([rows[b, s - 1] for b, s in enumerate(seq_lens)]),
        req_pool_indices=batch.req_pool_indices, seq_lens=batch.seq_lens,
        extend_lens=torch.ones(3, dtype=torch.int32, device=DEVICE), req_to_token=batch.req_to_token,
        kv_pool=pool, attn_backend=AttentionBackend(tri), cos_sin_cache=cfg.rope_cos_sin_cache(DEVICE),
    )
    assert model.enable_fused_gemv(fused_rows)
    with torch.no_grad():
        hidden = model.to(dtype)(fb)
    return torch.cat([hidden.flatten(), pool.k_buffers[1].flatten(), pool.v_buffers[1].flatten()]).float()


def two_layer_model(intermediate: int, qkv_bias: bool) -> LlamaForCausalLM:
    """Two Llama layers of a tiny model on the Triton set, random weights: norm weights near 1, projections
    scaled to keep activations O(1)."""
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=96, intermediate_size=intermediate,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=24, rms_norm_eps=1e-5,
                      rope_theta=10000.0, rope_scaling=None, max_position_embeddings=64, tie_word_embeddings=False,
                      qkv_bias=qkv_bias, context_len=64, bos_token_id=None, eos_token_ids=[0])
    model = LlamaForCausalLM(cfg, tri).to(DEVICE)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5 + (1.0 if p.dim() == 1 and p.shape[0] == 96 else 0))
    return model


@pytest.mark.parametrize("qkv_bias", [False, True], ids=["llama", "qwen2"])
def test_decoder_layers_fused_equal_unfused(qkv_bias):
    """Two Llama layers of a tiny model on the Triton set, decoding 3 requests: with fused_gemv_rows the
    layers run four GEMV launches in place of seven ops; hidden states and the KV written must match the
    unfused layers: in fp32 within 1e-4, in fp16 as close to the fp32 result as the unfused fp16 run is
    (the two round at different points, so they differ from each other by a few fp16 ulps)."""
    model = two_layer_model(136, qkv_bias)
    exact = run_layers(model, torch.float32, 0)
    torch.testing.assert_close(run_layers(model, torch.float32, 8), exact, atol=1e-4, rtol=1e-4)
    plain_err = (run_layers(model, torch.float16, 0) - exact).abs().max()
    fused_err = (run_layers(model, torch.float16, 8) - exact).abs().max()
    assert 0 < plain_err < 0.05 and fused_err <= 1.5 * plain_err, (fused_err, plain_err)


def test_decoder_layers_fused_equal_unfused_int4():
    """The same two layers with every projection 4-bit (groups of 32, as GGUF's Q4 on CUDA), fused GEMVs
    (8 rows) against the unfused layers (the 4-bit GEMV or GEMM per projection), fp32: within 1e-4."""
    from radixlm.core.runtime.quantization.int4 import Int4Linear, quantize_random_int4

    model = two_layer_model(128, True)
    assert quantize_random_int4(model, tri, group=32) == 8
    assert isinstance(model.layers[0].mlp.down_proj, Int4Linear)
    torch.testing.assert_close(run_layers(model, torch.float32, 8), run_layers(model, torch.float32, 0),
                               atol=1e-4, rtol=1e-4)


def test_engine_greedy_tokens_fused_equal_unfused(llama_ckpt, monkeypatch):
    """The engine on the tiny Llama with the Triton kernel set (interpreted on the CPU, about a minute):
    with decode_fused_gemv=4 against 0, the greedy tokens of 3 requests (each decode step fused; the
    prefills are longer than 4 tokens) and of 5 (more rows than the bound: unfused) must be equal."""
    from radixlm.core.runtime.execution import model_runner

    monkeypatch.setattr(model_runner.kernels, "get_ops", lambda device: tri)  # on the CPU too
    prompts = [[5, 9, 13], [7] * 11, list(range(20, 32))]
    params = {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}
    tokens = {}
    for rows in (0, 4):
        with radixlm.Engine(llama_ckpt, device=DEVICE, dtype="float32", decode_fused_gemv=rows,
                            disable_cpu_prepack=True, max_total_tokens=512, log_level="warning") as engine:
            assert engine._runner.model.fused_gemv_rows == rows
            tokens[rows] = [[o["output_ids"] for o in engine.generate(input_ids=batch, sampling_params=params)]
                            for batch in (prompts, prompts + [[3, 4], [8] * 6])]
    assert tokens[4] == tokens[0]
