"""Decode GEMV: out = x @ W.T for a few rows of x (small decode batches), W [N, K] row-major as
nn.Linear stores it, with the row-wise ops around a decoder layer's projections fused in, so that at
batch 1 a layer takes four GEMV launches and no norm or activation launch of its own:

- ``gemv``: the plain product (the LM head; the first layer's qkv after its norm).
- ``residual_gemv``: the product that ends a sublayer (o_proj; down_proj with SiLU-and-mul in front),
  with the residual add and the first half of the next RMSNorm in its epilogue: it stores the residual
  stream h, h times the norm's weight, and each program's part of h's sum of squares.
- ``rms_scaled_gemv``: the product after that norm (qkv_proj, gate_up_proj) over the weighted row,
  scaled at the end by the norm's rsqrt(mean square + eps) from those partial sums:
  rms_norm(h) @ W.T = rstd * ((h * w) @ W.T). The result differs from the reference (which rounds the
  normalized row to the activation dtype first) by rounding only.

At a few rows the product is a stream of the weight: each program owns BLOCK_N output features and
walks all of K, loading [BLOCK_N, BLOCK_K] weight tiles (16-byte vectors along K, `stages` deep through
shared memory) and multiplying them by the x rows in fp32; partial products accumulate per lane and are
reduced once at the end. The x rows (at most GEMV_MAX_ROWS x K) are re-read by every program from L2,
so the epilogues are where the neighbouring ops go: a norm in a prologue would re-read the residual
and the norm weight with every weight tile (measured slower:
benchmarks/results/2026-12-02-h200-decode-gemv-fp8-kv.md), an epilogue touches only the program's own
BLOCK_N outputs once. Launch shapes come from `gemv_config` (benchmarks/bench_gemv.py measures them).

Weights: bf16/fp16/fp32; fp8 (e4m3, with per-row `weight_scale`); 4-bit (`weight_zero` given: AWQ, GPTQ
and GGUF Q4 in quant_reference.pack_int4's words, per-group scales and zeros; int4_gemv.py), so that
a 4-bit model's decode layers take the same fused launches.
"""

from __future__ import annotations

import json
import os

import torch
import triton
import triton.language as tl

from radixlm.kernels.reference import GEMV_MAX_ROWS
from radixlm.kernels.triton.elementwise import kv_limit, load_x, silu_and_mul, to_kv
from radixlm.kernels.triton.int4_gemv import product_int4

# (rows rounded up to a power of two, N, K) -> (BLOCK_N, BLOCK_K, num_warps, stages), from bench_gemv's
# measurements; missing shapes take the guess in `gemv_config`. RADIXLM_GEMV_CONFIGS names a JSON file
# of more ({"rows,N,K": [block_n, block_k, warps, stages]}, what bench_gemv --configs-out writes): a tuned run
# without a code change.
CONFIGS: dict[tuple[int, int, int], tuple[int, int, int, int]] = {
    # One H200, bf16, the Llama-3-8B shapes at one row (bench_gemv.py;
    # benchmarks/results/2026-12-02-h200-decode-gemv-fp8-kv.md).
    (1, 6144, 4096): (4, 2048, 4, 3), (1, 4096, 4096): (8, 512, 4, 3), (1, 28672, 4096): (4, 2048, 8, 3),
    (1, 4096, 14336): (8, 512, 4, 3), (1, 128256, 4096): (16, 1024, 8, 3),
}
# The same for fp8 weights (quantization="fp8"), measured apart: a step of BLOCK_K fp8 values is half the bytes.
CONFIGS_FP8: dict[tuple[int, int, int], tuple[int, int, int, int]] = {
    # One H100, the 8B shapes at one row, timed from CUDA graphs (bench_quant.py --sweep-gemv;
    # benchmarks/results/2026-12-07-h100-run4.md): the same shape won on all four, 2.7-2.9 TB/s.
    (1, 6144, 4096): (8, 1024, 4, 3), (1, 4096, 4096): (8, 1024, 4, 3), (1, 28672, 4096): (8, 1024, 4, 3),
    (1, 4096, 14336): (8, 1024, 4, 3),
}
# The same for 4-bit weights (AWQ/GPTQ, GGUF Q4 on CUDA: pack_int4's words with per-group scales and zeros),
# BLOCK_K in columns (a multiple of 32, the layout's block). Measured shapes by (rows, N, K); others take
# INT4_DEFAULTS by rows. bench_quant.py --sweep-gemv measures and prints them.
CONFIGS_INT4: dict[tuple[int, int, int], tuple[int, int, int, int]] = {
    # One H100 (triton 3.6.0), one row on the packed path, each timed as the fused op it runs in
    # (bench_quant.py --sweep-gemv; benchmarks/results/2026-12-07-quantization.md, session 9): the register
    # prefetch (stages 1) wins on every shape. The 8B shapes (groups of 128), SmolLM2's (32). 6144 x 4096 keeps
    # 192 programs (9.1 us) over the winner's 96 (64, 1024, 8, 1: 8.7 us), so that every shape fills the GPU.
    (1, 6144, 4096): (32, 512, 4, 1), (1, 4096, 4096): (32, 1024, 8, 1), (1, 28672, 4096): (32, 256, 2, 1),
    (1, 4096, 14336): (32, 1024, 8, 1), (1, 960, 576): (16, 512, 4, 1), (1, 576, 576): (16, 512, 4, 1),
    (1, 3072, 576): (8, 256, 2, 1), (1, 576, 1536): (16, 512, 4, 1),
}
INT4_DEFAULTS: dict[int, tuple[int, int, int, int]] = {
    # One row: the winner of the two largest 8B shapes. Several rows take the 4D product (its layout goes
    # through shared memory) with run 5's small programs (H100: latency-bound; fewer columns a step at more
    # rows, each lane's sums in registers).
    1: (32, 512, 4, 1), 2: (8, 1024, 4, 3), 4: (8, 512, 4, 3), 8: (8, 256, 4, 2), 16: (4, 256, 4, 2),
}
# Whether a one-row 4-bit product with SiLU-and-mul in front (down_proj) computes it inside (each lane
# evaluates the SiLU of the activations it holds, once for its rows: BLOCK_K / 8 lanes a value) or takes a
# silu_and_mul launch first (SiLU-and-mul evaluated once a value, at the cost of a launch; the default:
# on one H100, 4096 x 14336, 18.8 us against 30.5 inside; SmolLM2's 576 x 1536, 4.5 against 6.4);
# bench_quant.py --sweep-gemv times both.
INT4_FUSED_SILU = False
# Whether a one-row 4-bit product runs its nibble math in fp16x2 (int4_gemv.py's packed path: inline PTX,
# so never under TRITON_INTERPRET) or in fp32. On one H100 the packed path took 8.7 / 6.3 / 27.8 / 16.4 us
# against 10.0 / 6.8 / 34.6 / 18.8 on the four 8B projections, and the 8B shape's batch-1 decode 2.83 against
# 3.01 ms/token (session 9); bench_quant.py --sweep-gemv times both.
INT4_PACKED = True
if os.environ.get("RADIXLM_GEMV_CONFIGS"):
    with open(os.environ["RADIXLM_GEMV_CONFIGS"]) as f:
        CONFIGS.update({tuple(int(v) for v in key.split(",")): tuple(c) for key, c in json.load(f).items()})


def int4_packed(dtype: torch.dtype) -> bool:
    """The PACKED constexpr of a launch on activations of `dtype`: INT4_PACKED where the kernels compile for
    CUDA and x is bf16 or fp16 (exact in fp16 after its power-of-two scale; fp32 x keeps the fp32 path)."""
    return INT4_PACKED and dtype in (torch.bfloat16, torch.float16) and os.environ.get("TRITON_INTERPRET") != "1"


def gemv_config(m: int, n: int, k: int, weight_bytes: float = 2) -> tuple[int, int, int, int]:
    """The launch shape (BLOCK_N, BLOCK_K, num_warps, stages) for an [m, k] x [n, k].T product:
    RADIXLM_GEMV_CONFIG ("block_n,block_k,warps,stages", for ablations), else CONFIGS, else a guess:
    weight tiles of 16 KB (bf16) a step and 64 fp32 accumulator registers a thread, the loop's loads
    pipelined 3 deep through shared memory (cp.async), so that each SM has ~100 KB in flight; 8 output
    rows a program, 4 where that leaves under two programs per SM (132 on an H200). stages=1 is the
    plain loop (registers only). A weight of `weight_bytes` 1 (fp8) takes CONFIGS_FP8's shape, else the
    bf16 one with BLOCK_K doubled (the same bytes a step), BLOCK_N halved where that keeps 64
    accumulators a thread. A 4-bit weight (`weight_bytes` 0.5) takes CONFIGS_INT4's shape, else
    INT4_DEFAULTS' for its rows (fewer rows a program where N leaves under a program an SM), its step no
    longer than K."""
    override = os.environ.get("RADIXLM_GEMV_CONFIG")
    if override:
        block_n, block_k, warps, stages = (int(v) for v in override.split(","))
        return block_n, block_k, warps, stages
    block_m = triton.next_power_of_2(m)
    if weight_bytes < 1:
        if (block_m, n, k) in CONFIGS_INT4:
            return CONFIGS_INT4[(block_m, n, k)]
        block_n, block_k, warps, stages = INT4_DEFAULTS[block_m]
        while block_n > 8 and triton.cdiv(n, block_n) < 132:  # small N (SmolLM2's): a program an SM
            block_n //= 2
        return block_n, max(32, min(block_k, triton.next_power_of_2(k))), warps, stages
    if weight_bytes == 1 and (block_m, n, k) in CONFIGS_FP8:
        return CONFIGS_FP8[(block_m, n, k)]
    if (block_m, n, k) in CONFIGS:
        block_n, block_k, warps, stages = CONFIGS[(block_m, n, k)]
    else:
        block_k = max(32, min(1024, triton.next_power_of_2(k)) // block_m)
        block_n, warps, stages = (8 if triton.cdiv(n, 8) >= 264 else 4), 4, 3
    if weight_bytes == 1:
        block_k *= 2
        if block_m * block_n * block_k > 64 * 32 * warps and block_n > 1:
            block_n //= 2
    return block_n, block_k, warps, stages


@triton.jit
def _product(X, W, offs_m, offs_n, m_mask, n_mask, k, stride_xm, stride_wn,
             SILU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             STAGES: tl.constexpr):
    """x[offs_m] @ W[offs_n].T in fp32 [BLOCK_M, BLOCK_N] (of silu_and_mul(x) with SILU)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, k, BLOCK_K, num_stages=STAGES):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k
        x = load_x(X, offs_m[:, None] * stride_xm + offs_k[None, :], m_mask[:, None] & k_mask[None, :], k, SILU)
        w = tl.load(W + offs_n[:, None] * stride_wn + offs_k[None, :],
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += x[:, None, :] * w.to(tl.float32)[None, :, :]
    return tl.sum(acc, axis=2)


@triton.jit
def _weight_product(X, W, WScale, WZero, offs_m, offs_n, m_mask, n_mask, k, group, num_groups, stride_xm, stride_wn,
                    SILU: tl.constexpr, INT4: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, STAGES: tl.constexpr, EVEN_K: tl.constexpr, PACKED: tl.constexpr):
    """The product for the weight's kind: 4-bit (INT4: scales and zeros applied inside; EVEN_K: K a
    multiple of BLOCK_K; PACKED: one row's product in fp16x2, see int4_gemv.py), else bf16/fp8."""
    if INT4:
        out = product_int4(X, W, WScale, WZero, offs_m, offs_n, m_mask, n_mask, k, group, num_groups, stride_xm,
                           stride_wn, SILU, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, EVEN_K, PACKED)
    else:
        out = _product(X, W, offs_m, offs_n, m_mask, n_mask, k, stride_xm, stride_wn, SILU, BLOCK_M, BLOCK_N,
                       BLOCK_K, STAGES)
    return out


@triton.jit
def _load_sums(Sums, offs_m, m_mask, num_sums, stride_sm, SCALED: tl.constexpr, BLOCK_S: tl.constexpr):
    """The partial sums of squares a scaled product reads (before its loop, so that their latency hides
    under it); zeros, never read, where the product is not scaled."""
    offs_s = tl.arange(0, BLOCK_S)
    sums = tl.zeros((offs_m.shape[0], BLOCK_S), dtype=tl.float32)
    if SCALED:
        sums = tl.load(Sums + offs_m[:, None] * stride_sm + offs_s[None, :],
                       mask=m_mask[:, None] & (offs_s < num_sums)[None, :], other=0.0)
    return sums


@triton.jit
def _scale_and_bias(out, sums, Bias, WScale, offs_n, n_mask, k, eps, SCALED: tl.constexpr, HAS_BIAS: tl.constexpr,
                    W_SCALED: tl.constexpr):
    """The epilogue of a product before any residual: with W_SCALED, the weight held fp8 values and each
    output feature takes its row's scale; with SCALED, x was an RMSNorm's input times its weight
    (`residual_gemv`'s second output) and the norm's scale comes from the partial sums of squares the
    producer left, one per producer program; then the bias."""
    if W_SCALED:
        out = out * tl.load(WScale + offs_n, mask=n_mask, other=0.0)[None, :]
    if SCALED:
        out = out * tl.rsqrt(tl.sum(sums, axis=1) / k + eps)[:, None]
    if HAS_BIAS:
        out += tl.load(Bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    return out


@triton.jit
def _gemv_kernel(
    X, Res, NormW, W, Bias, WScale, WZero, Out, Summed, Sums,
    m, n, k, group, num_groups, num_sums, stride_xm, stride_rm, stride_wn, stride_om, stride_hm, stride_sm, eps,
    SILU: tl.constexpr, HAS_BIAS: tl.constexpr, SCALED: tl.constexpr, RESIDUAL: tl.constexpr,
    W_SCALED: tl.constexpr, INT4: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_S: tl.constexpr,
    STAGES: tl.constexpr, EVEN_K: tl.constexpr, PACKED: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < m
    n_mask = offs_n < n
    mn_mask = m_mask[:, None] & n_mask[None, :]
    # The epilogues' inputs are loaded before the loop, so that their latency hides under it.
    sums = _load_sums(Sums, offs_m, m_mask, num_sums, stride_sm, SCALED, BLOCK_S)
    if RESIDUAL:
        r = tl.load(Res + offs_m[:, None] * stride_rm + offs_n[None, :], mask=mn_mask, other=0.0)
        norm_w = tl.load(NormW + offs_n, mask=n_mask, other=0.0)
    out = _weight_product(X, W, WScale, WZero, offs_m, offs_n, m_mask, n_mask, k, group, num_groups, stride_xm,
                          stride_wn, SILU, INT4, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, EVEN_K, PACKED)
    out = _scale_and_bias(out, sums, Bias, WScale, offs_n, n_mask, k, eps, SCALED, HAS_BIAS, W_SCALED)
    if RESIDUAL:
        # h = product + residual is the residual stream (rounded to its dtype, as the reference's sum is);
        # Out gets h times the next RMSNorm's weight, Sums this program's part of h's sum of squares.
        h = (out + r.to(tl.float32)).to(Summed.dtype.element_ty)
        tl.store(Summed + offs_m[:, None] * stride_hm + offs_n[None, :], h, mask=mn_mask)
        h = tl.where(mn_mask, h.to(tl.float32), 0.0)
        tl.store(Sums + offs_m * stride_sm + pid, tl.sum(h * h, axis=1), mask=m_mask)
        out = h * norm_w.to(tl.float32)[None, :]
    tl.store(Out + offs_m[:, None] * stride_om + offs_n[None, :], out.to(Out.dtype.element_ty), mask=mn_mask)


@triton.jit
def _rotary_qkv_kernel(
    X, W, Bias, WScale, WZero, Sums, Q, KBuf, VBuf, Positions, CosSin, Loc,
    m, n, k, group, num_groups, num_sums, stride_xm, stride_wn, stride_sm, stride_qm, stride_kbs, stride_kbh,
    stride_vbs, stride_vbh, stride_cp, eps,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_BIAS: tl.constexpr,
    SCALED: tl.constexpr, W_SCALED: tl.constexpr, INT4: tl.constexpr, BLOCK_M: tl.constexpr, PAIRS: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr, STAGES: tl.constexpr, SAT: tl.constexpr, EVEN_K: tl.constexpr,
    PACKED: tl.constexpr,
):
    """The qkv projection with the rotary and the KV store in its epilogue. A program owns PAIRS pairs of
    rotate-half partners (d, d + HEAD_DIM/2) of one head, interleaved, so that its outputs rotate among
    themselves; q heads land in Q, k (rotated) and v heads in their pool slots."""
    HALF: tl.constexpr = HEAD_DIM // 2
    pid = tl.program_id(0)
    head = pid * PAIRS // HALF  # HALF % PAIRS == 0: a program's pairs lie in one head
    offs_d = pid * PAIRS % HALF + tl.arange(0, PAIRS)
    offs_j = tl.arange(0, 2 * PAIRS)
    offs_n = head * HEAD_DIM + pid * PAIRS % HALF + offs_j // 2 + (offs_j % 2) * HALF
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < m
    n_mask = offs_n < n
    sums = _load_sums(Sums, offs_m, m_mask, num_sums, stride_sm, SCALED, BLOCK_S)
    pos = tl.load(Positions + offs_m, mask=m_mask, other=0).to(tl.int64)
    out = _weight_product(X, W, WScale, WZero, offs_m, offs_n, m_mask, n_mask, k, group, num_groups, stride_xm,
                          stride_wn, False, INT4, BLOCK_M, 2 * PAIRS, BLOCK_K, STAGES, EVEN_K, PACKED)
    # Rounded where the reference's projection output is, then split into the partners' halves.
    out = _scale_and_bias(out, sums, Bias, WScale, offs_n, n_mask, k, eps, SCALED, HAS_BIAS, W_SCALED)
    out = out.to(X.dtype.element_ty).to(tl.float32)
    x1, x2 = tl.split(tl.reshape(out, (BLOCK_M, PAIRS, 2)))
    mask = m_mask[:, None] & (offs_d < HALF)[None, :]
    if head < NUM_HEADS + NUM_KV_HEADS:
        cos_sin = CosSin + pos[:, None] * stride_cp + offs_d[None, :]
        cos = tl.load(cos_sin, mask=mask, other=0.0).to(tl.float32)
        sin = tl.load(cos_sin + HALF, mask=mask, other=0.0).to(tl.float32)
        x1, x2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    x1 = x1.to(X.dtype.element_ty)
    x2 = x2.to(X.dtype.element_ty)
    if head < NUM_HEADS:
        q_dst = Q + offs_m[:, None] * stride_qm + head * HEAD_DIM + offs_d[None, :]
        tl.store(q_dst, x1, mask=mask)
        tl.store(q_dst + HALF, x2, mask=mask)
    else:  # (the pool's pointers may be of another dtype than Q's: names of their own in this branch)
        slot = tl.load(Loc + offs_m, mask=m_mask, other=0).to(tl.int64)
        if head < NUM_HEADS + NUM_KV_HEADS:
            kv_dst = KBuf + slot[:, None] * stride_kbs + (head - NUM_HEADS) * stride_kbh + offs_d[None, :]
        else:
            kv_dst = VBuf + slot[:, None] * stride_vbs + (head - NUM_HEADS - NUM_KV_HEADS) * stride_vbh + offs_d[None, :]
        tl.store(kv_dst, to_kv(x1, kv_dst, SAT), mask=mask)
        tl.store(kv_dst + HALF, to_kv(x2, kv_dst, SAT), mask=mask)


def _weight_kind(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None,
                 weight_zero: torch.Tensor | None) -> tuple[int, int, int, int, float]:
    """(N, K, group, groups, bytes a weight) of a bf16/fp8 weight [N, K] or a 4-bit one (`weight_zero`
    given: pack_int4's int32 [N, K / 8] with fp32 scales and zeros [N, K / group]), checked."""
    # More rows want a GEMM (and would spill the 3D accumulator).
    assert x.shape[0] <= GEMV_MAX_ROWS, f"the decode GEMV takes at most {GEMV_MAX_ROWS} rows (got {x.shape[0]})"
    assert weight.stride(1) == 1 and x.stride(-1) == 1, "weight and x must be contiguous along K"
    n = weight.shape[0]
    if weight_zero is None:
        assert weight_scale is None or (weight_scale.dtype == torch.float32 and weight_scale.shape == (n,)), \
            "weight_scale must be fp32 [N]"
        return n, weight.shape[1], 1, 1, weight.element_size()
    k, groups = weight.shape[1] * 8, weight_zero.shape[1]
    assert (weight.dtype == torch.int32 and weight_scale is not None and weight_scale.dtype == torch.float32
            and weight_zero.dtype == torch.float32 and weight_scale.shape == weight_zero.shape == (n, groups)
            and k % groups == 0 and (k // groups) % 32 == 0), \
        "a 4-bit weight is pack_int4's int32 [N, K / 8], fp32 scales and zeros [N, K / group], group a multiple of 32"
    return n, k, k // groups, groups, 0.5


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, silu: bool = False,
            residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
            sums: torch.Tensor | None = None, eps: float = 0.0, weight_scale: torch.Tensor | None = None,
            weight_zero: torch.Tensor | None = None):
    """One launch: the product (of silu_and_mul(x) with `silu`; each output feature times its
    `weight_scale` where the weight is fp8; 4-bit with `weight_zero`); with `sums`, scaled by the RMSNorm
    of those sums of squares; with `residual`, the residual epilogue (returns h, h * norm_weight, sums)."""
    m = x.shape[0]
    n, k, group, groups, weight_bytes = _weight_kind(x, weight, weight_scale, weight_zero)
    if silu:
        assert x.shape[-1] == 2 * k, "gate_up must hold [gate | up] of the weight's K each"
    if silu and weight_zero is not None and m == 1 and not INT4_FUSED_SILU:
        x, silu = silu_and_mul(x), False
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = gemv_config(m, n, k, weight_bytes)
    programs = triton.cdiv(n, block_n)
    summed = out
    if residual is not None:
        assert residual.dtype == x.dtype and residual.shape == (m, n) and residual.stride(-1) == 1, \
            "residual must be [M, N], contiguous along N, in x's dtype"
        summed = torch.empty_like(out)
        sums = torch.empty((m, programs), dtype=torch.float32, device=x.device)
    if m:
        scaled = residual is None and sums is not None
        res, held = residual if residual is not None else x, sums if sums is not None else out
        _gemv_kernel[(programs,)](
            x, res, norm_weight if norm_weight is not None else weight, weight,
            bias if bias is not None else weight, weight_scale if weight_scale is not None else out,
            weight_zero if weight_zero is not None else out, out, summed, held,
            m, n, k, group, groups, held.shape[1], x.stride(0), res.stride(0), weight.stride(0), out.stride(0),
            summed.stride(0), held.stride(0), eps,
            SILU=silu, HAS_BIAS=bias is not None, SCALED=scaled, RESIDUAL=residual is not None,
            W_SCALED=weight_scale is not None and weight_zero is None, INT4=weight_zero is not None,
            BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k,
            # Only a scaled product reads the partial sums; elsewhere a constant, so that no other launch
            # compiles a variant per N.
            BLOCK_S=triton.next_power_of_2(held.shape[1]) if scaled else 1, STAGES=stages,
            EVEN_K=weight_zero is not None and k % block_k == 0, PACKED=int4_packed(x.dtype), num_warps=warps,
        )
    return (summed, out, sums) if residual is not None else out


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         weight_scale: torch.Tensor | None = None, weight_zero: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [M <= GEMV_MAX_ROWS, K]; an fp8 weight streams as it is, each row
    times its `weight_scale` [N]; a 4-bit one (with `weight_zero`: pack_int4's words [N, K / 8], fp32
    scales and zeros [N, K / group]) as its words. Twin: ``reference.gemv``."""
    return _launch(x, weight, bias, weight_scale=weight_scale, weight_zero=weight_zero)


def residual_gemv(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, silu: bool = False,
    weight_scale: torch.Tensor | None = None, weight_zero: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A projection that ends a sublayer (o_proj, down_proj) with the residual add and the next RMSNorm's
    first half in its epilogue: h = F.linear(x, weight) + residual (the residual stream), h times
    `norm_weight`, and h's sum of squares as [M, S] partial sums (for ``rms_scaled_gemv``). With
    `silu`, x holds [gate | up] and silu_and_mul goes first. Twin: ``reference.residual_gemv``."""
    return _launch(x, weight, silu=silu, residual=residual, norm_weight=norm_weight, weight_scale=weight_scale,
                   weight_zero=weight_zero)


def rms_scaled_gemv(x: torch.Tensor, sums: torch.Tensor, eps: float, weight: torch.Tensor,
                    bias: torch.Tensor | None = None, weight_scale: torch.Tensor | None = None,
                    weight_zero: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x * rsqrt(sums.sum(-1) / K + eps), weight, bias): the projection after an RMSNorm whose
    input times weight is x and whose input's sums of squares are `sums` (``residual_gemv``'s outputs),
    so that the norm costs no launch. Twin: ``reference.rms_scaled_gemv``."""
    return _launch(x, weight, bias, sums=sums, eps=eps, weight_scale=weight_scale, weight_zero=weight_zero)


def rotary_qkv_gemv(
    x: torch.Tensor, sums: torch.Tensor | None, eps: float, weight: torch.Tensor, bias: torch.Tensor | None,
    positions: torch.Tensor, cos_sin_cache: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
    loc: torch.Tensor, num_heads: int, num_kv_heads: int, weight_scale: torch.Tensor | None = None,
    weight_zero: torch.Tensor | None = None,
) -> torch.Tensor:
    """The qkv projection (``rms_scaled_gemv``, or ``gemv`` of an already normed x where `sums` is None)
    with ``apply_rotary_store_kv`` in its epilogue: returns the rotated q [M, H, D]; k, rotated, and v go
    into pool slots `loc`. One launch where the two took two. Twin: ``reference.rotary_qkv_gemv``."""
    m = x.shape[0]
    head_dim = cos_sin_cache.shape[-1]
    n, k, group, groups, weight_bytes = _weight_kind(x, weight, weight_scale, weight_zero)
    assert x.shape[1] == k, "x must have the weight's K columns"
    assert n == (num_heads + 2 * num_kv_heads) * head_dim and head_dim % 2 == 0, \
        "weight must hold q, k and v heads of the rotary cache's head_dim"
    assert cos_sin_cache.stride(-1) == 1, "cos_sin_cache must be contiguous along its last dim"
    assert k_buffer.stride(-1) == 1 and v_buffer.stride(-1) == 1, "pool rows must be contiguous along D"
    q = torch.empty((m, num_heads, head_dim), dtype=x.dtype, device=x.device)
    if m == 0:
        return q
    block_n, block_k, warps, stages = gemv_config(m, n, k, weight_bytes)
    half = head_dim // 2
    pairs = max(1, block_n // 2)
    while half % pairs:  # a program's pairs must lie in one head
        pairs //= 2
    held = sums if sums is not None else x
    _rotary_qkv_kernel[(n // 2 // pairs,)](
        x, weight, bias if bias is not None else weight, weight_scale if weight_scale is not None else q,
        weight_zero if weight_zero is not None else q, held, q, k_buffer, v_buffer, positions, cos_sin_cache,
        loc, m, n, k, group, groups, held.shape[1], x.stride(0), weight.stride(0), held.stride(0), q.stride(0),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1), cos_sin_cache.stride(0),
        eps, NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HAS_BIAS=bias is not None,
        SCALED=sums is not None, W_SCALED=weight_scale is not None and weight_zero is None,
        INT4=weight_zero is not None, BLOCK_M=triton.next_power_of_2(m), PAIRS=pairs, BLOCK_K=block_k,
        BLOCK_S=triton.next_power_of_2(held.shape[1]) if sums is not None else 1, STAGES=stages,
        EVEN_K=weight_zero is not None and k % block_k == 0,
        SAT=kv_limit(k_buffer), PACKED=int4_packed(x.dtype), num_warps=warps,
    )
    return q
