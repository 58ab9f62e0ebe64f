"""FP8 W8A8 linear layers on CUDA (compute capability 8.9+): activations quantized to e4m3 a token at a
time by one Triton launch, then one cuBLASLt fp8 GEMM (torch._scaled_mm) with row-wise scales: the
token's on one side, each output feature's on the other, applied to the fp32 accumulator.
Batch-1 decode does not come here: it streams the fp8 weight through the decode GEMVs (decode_gemv.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixlm.kernels.quant_reference import FP8, FP8_MAX, MIN_SCALE


@triton.jit
def _quantize_rows_kernel(X, Q, Scale, k, stride_xm, stride_qm, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        x = tl.load(X + row * stride_xm + k0 + offs, mask=k0 + offs < k, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX, MIN_SCALE)
    tl.store(Scale + row, scale)
    for k0 in range(0, k, BLOCK_K):
        x = tl.load(X + row * stride_xm + k0 + offs, mask=k0 + offs < k, other=0.0).to(tl.float32)
        q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
        tl.store(Q + row * stride_qm + k0 + offs, q.to(Q.dtype.element_ty), mask=k0 + offs < k)


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [M, K], fp32 scale [M]) of x, one scale a row. Twin: ``quant_reference.quantize_fp8_rows``."""
    m, k = x.shape
    assert x.stride(-1) == 1, "x must be contiguous along K"
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    scale = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        _quantize_rows_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE,
                                    BLOCK_K=min(4096, triton.next_power_of_2(k)), num_warps=8)
    return q, scale


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8 product of x [M, K] (bf16/fp16) and an e4m3 weight [N, K] with per-row scales [N].
    Twin: ``quant_reference.fp8_linear``."""
    xq, x_scale = quantize_fp8_rows(x)
    # Row-wise scaled fp8 GEMMs write bf16 (cuBLASLt's rule); fp16 models get a cast.
    out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale[:, None], scale_b=weight_scale[None, :],
                           out_dtype=torch.bfloat16).to(x.dtype)
    return out if bias is None else out + bias
