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
               bias: torch.Tensor | None = None, rounded: bool = True) -> torch.Tensor:
    """W8A8: x [M, K] quantized to e4m3 a token at a time (dynamic scales), times the e4m3 weight [N, K]
    with its per-row fp32 scales [N], accumulated in fp32, written in bf16, then in x's dtype plus bias.
    The same rounding as the CUDA kernel's (torch._scaled_mm with row-wise scales writes bf16), up to the
    order of the sum, so that a float32 run on the CPU has the numerics of one on the GPU. `rounded=False`
    keeps the fp32 product (to measure what that rounding alone moves)."""
    xq, x_scale = quantize_fp8_rows(x)
    out = (xq.float() @ weight.float().t()) * x_scale[:, None] * weight_scale[None, :]
    out = out.to(torch.bfloat16).to(x.dtype) if rounded else out.to(x.dtype)
    return out if bias is None else out + bias


# 4-bit weights are packed in blocks of INT4_BLOCK columns: 4 int32 words a block, word s of a block
# holding its columns s, 4 + s, ..., 28 + s (nibble j, bits 4j..4j+3, is column 4j + s). A kernel that
# shifts nibble j out of a tile of words gets the columns 4j..4j+3 of every block, whose x it loads as
# they lie: no interleave of the unpacked values. 32 is GGUF's block and divides every AWQ/GPTQ group,
# so a block lies in one group: one layout for all of them.
INT4_BLOCK = 32
_NIBBLE_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int64)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[N, K / 8] int32 (pack_int4's layout) -> [N, K] uint8 of values 0..15."""
    n, words = packed.shape
    nibbles = (packed.to(torch.int64)[..., None] >> _NIBBLE_SHIFTS.to(packed.device)) & 0xF  # [N, K / 8, 8]: nibble j of each word
    return nibbles.view(n, words // 4, 4, 8).transpose(2, 3).reshape(n, -1).to(torch.uint8)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """unpack_int4's inverse: q [N, K] of values 0..15 (K a multiple of INT4_BLOCK) -> [N, K / 8] int32."""
    n, k = q.shape
    if k % INT4_BLOCK:
        raise ValueError(f"4-bit weights pack in blocks of {INT4_BLOCK} columns; got {k} columns")
    q = q.to(torch.int64).view(n, k // INT4_BLOCK, 8, 4).transpose(2, 3)  # [N, blocks, word s, nibble j]
    words = (q << _NIBBLE_SHIFTS.to(q.device)).sum(-1).reshape(n, -1)
    return (words - ((words >> 31) << 32)).to(torch.int32)  # two's complement into int32


def quantize_int4_rows(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed [N, K / 8], fp32 scales [N, K / group], fp32 zeros) of w: asymmetric min-max 4-bit per
    group (AWQ's and GPTQ's grid; for random weights of benchmarks, which no checkpoint gives)."""
    n, k = w.shape
    g = w.float().view(n, k // group, group)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp_min(MIN_SCALE)
    zero = (-lo / scale).round().clamp(0, 15)
    q = (g / scale[..., None] + zero[..., None]).round().clamp(0, 15).view(n, k)
    return pack_int4(q), scale, zero


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """4-bit weight-only product (AWQ, GPTQ, GGUF Q4 on CUDA): the weight [N, K] is (q - zero) * scale with
    q the unpacked `packed` [N, K / 8] (pack_int4's layout) and one fp32 scale and zero per row and group
    of K / scales.shape[1] columns; x [M, K] times its transpose, accumulated in fp32, plus bias, returned
    in x's dtype."""
    q = unpack_int4(packed).float()
    group = q.shape[1] // scales.shape[1]
    w = (q - zeros.repeat_interleave(group, 1)) * scales.repeat_interleave(group, 1)
    out = x.float() @ w.t()
    return (out if bias is None else out + bias.float()).to(x.dtype)
