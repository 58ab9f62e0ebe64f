"""Pure-torch reference twins of the quantized-weight kernels (fp8 W8A8 linears; 4-bit group-quantized
weights), run by the CPU kernel set and used as the oracle of the Triton ones."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# Rows whose largest magnitude is below this get this scale (an all-zero row would divide by zero).
MIN_SCALE = 1e-12


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, fp32 scale [M]) of x [M, K], one scale a row: its largest magnitude maps to 448,
    values round to nearest (never past 448: torch's cast would make NaN of them)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / FP8_MAX).clamp_min(MIN_SCALE)
    return (xf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8: x [M, K] quantized to e4m3 a token at a time (dynamic scales), times the e4m3 weight [N, K]
    with its per-row fp32 scales [N], accumulated in fp32, plus bias; returned in x's dtype. The same
    rounding as the CUDA kernel's (torch._scaled_mm with row-wise scales), up to the order of the sum."""
    xq, x_scale = quantize_fp8_rows(x)
    out = (xq.float() @ weight.float().t()) * x_scale[:, None] * weight_scale[None, :]
    return (out if bias is None else out + bias.float()).to(x.dtype)
