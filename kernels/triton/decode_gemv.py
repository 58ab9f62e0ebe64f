"""Decode GEMV: out = x @ W.T for a few rows of x (small decode batches), W [N, K] row-major as
nn.Linear stores it, with the neighbouring row-wise op fused in front so that it costs no launch:

- ``gemv``: the plain product (o_proj).
- ``add_rms_norm_gemv``: residual add + RMSNorm, then the product (qkv_proj, gate_up_proj).
- ``silu_and_mul_gemv``: SiLU-and-mul, then the product (down_proj).

At a few rows the product is a stream of the weight: each program owns BLOCK_N output features and
walks all of K, loading [BLOCK_N, BLOCK_K] weight tiles (16-byte vectors along K, `stages` deep through
shared memory) and multiplying them by the x rows in fp32; partial products accumulate per lane and are
reduced once at the end. The x rows (at most GEMV_MAX_ROWS x K) are re-read by every program from L2,
and so is the prologue's work: a norm's sum of squares, a SiLU, cheap beside the weight tile each
program streams. The RMSNorm's scale is applied to the finished dot product
(out = rstd * sum_k(s_k * w_k * W_nk)), so one pass over K serves both; the result differs from the
reference (which rounds the normalized row to the activation dtype first) by rounding only. Launch
shapes come from `gemv_config` (benchmarks/bench_gemv.py measures them).
"""

from __future__ import annotations

import json
import os

import torch
import triton
import triton.language as tl

from radixlm.kernels.reference import GEMV_MAX_ROWS

# The prologues, a constexpr of the kernel.
_PLAIN, _NORM, _ADD_NORM, _SILU = 0, 1, 2, 3

# (rows rounded up to a power of two, N, K) -> (BLOCK_N, BLOCK_K, num_warps, stages), from bench_gemv's
# measurements; missing shapes take the guess in `gemv_config`. RADIXLM_GEMV_CONFIGS names a JSON file
# of more ({"rows,N,K": [block_n, block_k, warps, stages]}, what bench_gemv --configs-out writes): a tuned run
# without a code change.
CONFIGS: dict[tuple[int, int, int], tuple[int, int, int, int]] = {
    # One H200, bf16, the Llama-3-8B shapes at one row (2026-12-02, bench_gemv.py; docs/benchmarks.md).
    (1, 6144, 4096): (4, 2048, 4, 3), (1, 4096, 4096): (8, 512, 4, 3), (1, 28672, 4096): (4, 2048, 8, 3),
    (1, 4096, 14336): (8, 512, 4, 3), (1, 128256, 4096): (16, 1024, 8, 3),
}
# A norm prologue re-reads x, the residual and the norm weight with every weight tile: programs of at
# least this many output rows keep that under a quarter of the tile's bytes.
NORM_MIN_BLOCK_N = 16
if os.environ.get("RADIXLM_GEMV_CONFIGS"):
    with open(os.environ["RADIXLM_GEMV_CONFIGS"]) as f:
        CONFIGS.update({tuple(int(v) for v in key.split(",")): tuple(c) for key, c in json.load(f).items()})


def gemv_config(m: int, n: int, k: int, prologue: int = 0) -> tuple[int, int, int, int]:
    """The launch shape (BLOCK_N, BLOCK_K, num_warps, stages) for an [m, k] x [n, k].T product:
    RADIXLM_GEMV_CONFIG ("block_n,block_k,warps,stages", for ablations), else CONFIGS, else a guess:
    weight tiles of 16 KB (bf16) a step and 64 fp32 accumulator registers a thread, the loop's loads
    pipelined 3 deep through shared memory (cp.async), so that each SM has ~100 KB in flight; 8 output
    rows a program, 4 where that leaves under two programs per SM (132 on an H200). stages=1 is the
    plain loop (registers only)."""
    override = os.environ.get("RADIXLM_GEMV_CONFIG")
    if override:
        block_n, block_k, warps, stages = (int(v) for v in override.split(","))
        return block_n, block_k, warps, stages
    block_m = triton.next_power_of_2(m)
    if (block_m, n, k) in CONFIGS:
        block_n, block_k, warps, stages = CONFIGS[(block_m, n, k)]
    else:
        block_k = max(32, min(1024, triton.next_power_of_2(k)) // block_m)
        block_n, warps, stages = (8 if triton.cdiv(n, 8) >= 264 else 4), 4, 3
    if prologue in (_NORM, _ADD_NORM) and block_n < NORM_MIN_BLOCK_N:
        # Same accumulator size: the tile grows in N and shrinks in K.
        block_k, block_n = max(32, block_k * block_n // NORM_MIN_BLOCK_N), NORM_MIN_BLOCK_N
    return block_n, block_k, warps, stages


@triton.jit
def _gemv_kernel(
    X, Res, NormW, W, Bias, Out, SumOut,
    m, n, k, stride_xm, stride_rm, stride_wn, stride_om, stride_sm, eps,
    PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < m
    n_mask = offs_n < n
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    sumsq = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, k, BLOCK_K, num_stages=STAGES):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k
        x_mask = m_mask[:, None] & k_mask[None, :]
        x_ptrs = X + offs_m[:, None] * stride_xm + offs_k[None, :]
        if PROLOGUE == 3:
            # x holds [gate | up]; silu(gate) * up rounded to the activation dtype, as silu_and_mul's output.
            gate = tl.load(x_ptrs, mask=x_mask, other=0.0).to(tl.float32)
            up = tl.load(x_ptrs + k, mask=x_mask, other=0.0).to(tl.float32)
            x = (gate * tl.sigmoid(gate) * up).to(X.dtype.element_ty).to(tl.float32)
        else:
            x = tl.load(x_ptrs, mask=x_mask, other=0.0)
            if PROLOGUE == 2:
                r = tl.load(Res + offs_m[:, None] * stride_rm + offs_k[None, :], mask=x_mask, other=0.0)
                # The residual stream, rounded to its dtype as the reference's `x + residual` is; program 0
                # writes it out.
                x = (x.to(tl.float32) + r.to(tl.float32)).to(SumOut.dtype.element_ty)
                if pid == 0:
                    tl.store(SumOut + offs_m[:, None] * stride_sm + offs_k[None, :], x, mask=x_mask)
            x = x.to(tl.float32)
            if PROLOGUE != 0:
                sumsq += x * x
                x = x * tl.load(NormW + offs_k, mask=k_mask, other=0.0).to(tl.float32)[None, :]
        w = tl.load(W + offs_n[:, None] * stride_wn + offs_k[None, :],
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += x[:, None, :] * w.to(tl.float32)[None, :, :]
    out = tl.sum(acc, axis=2)
    if PROLOGUE == 1 or PROLOGUE == 2:
        rstd = tl.rsqrt(tl.sum(sumsq, axis=1) / k + eps)
        out = out * rstd[:, None]
    if HAS_BIAS:
        out += tl.load(Bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Out + offs_m[:, None] * stride_om + offs_n[None, :], out.to(Out.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def _launch(prologue: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
            summed: torch.Tensor | None = None) -> torch.Tensor:
    m = x.shape[0]
    n, k = weight.shape
    # More rows want a GEMM (and would spill the 3D accumulator).
    assert m <= GEMV_MAX_ROWS, f"the decode GEMV takes at most {GEMV_MAX_ROWS} rows (got {m})"
    assert weight.stride(1) == 1 and x.stride(-1) == 1, "weight and x must be contiguous along K"
    assert residual is None or residual.stride(-1) == 1, "residual must be contiguous along K"
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_n, block_k, warps, stages = gemv_config(m, n, k, prologue)
    res = residual if residual is not None else x
    sums = summed if summed is not None else out
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, res, norm_weight if norm_weight is not None else weight, weight,
        bias if bias is not None else weight, out, sums,
        m, n, k, x.stride(0), res.stride(0), weight.stride(0), out.stride(0), sums.stride(0), eps,
        PROLOGUE=prologue, HAS_BIAS=bias is not None,
        BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, num_warps=warps,
    )
    return out


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [M <= GEMV_MAX_ROWS, K]. Twin: ``reference.gemv``."""
    return _launch(_PLAIN, x, weight, bias)


def add_rms_norm_gemv(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor, bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(F.linear(rms_norm(x + residual), weight, bias), x + residual) in one launch; without a residual,
    (F.linear(rms_norm(x), ...), x). Twin: ``reference.add_rms_norm_gemv``."""
    if residual is None:
        return _launch(_NORM, x, weight, bias, norm_weight=norm_weight, eps=eps), x
    assert residual.dtype == x.dtype, "x and residual must share a dtype (the sum is stored in it)"
    summed = torch.empty_like(x)
    out = _launch(_ADD_NORM, x, weight, bias, residual, norm_weight, eps, summed)
    return out, summed


def silu_and_mul_gemv(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(silu_and_mul(gate_up), weight, bias), gate_up [M <= GEMV_MAX_ROWS, 2K] holding [gate | up], in one
    launch. Twin: ``reference.silu_and_mul_gemv``."""
    assert gate_up.shape[-1] == 2 * weight.shape[1], "gate_up must hold [gate | up] of the weight's K each"
    return _launch(_SILU, gate_up, weight, bias)
