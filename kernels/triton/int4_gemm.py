"""4-bit weight-only products on CUDA (AWQ and GPTQ checkpoints): the weight streams as packed nibbles
[N, K / 2] (two values a byte) with one fp32 scale and zero per row and group, and is dequantized to the
activation dtype in registers, a [BLOCK_N, BLOCK_K] tile at a time, inside the GEMM's K loop (tl.dot),
so that no dequantized copy is ever written. Decode batches of at most GEMV_MAX_ROWS rows take a GEMV
instead: a tl.dot pads them to 16 rows and its tiles leave too few programs to stream the weight (82.96
ms/token at batch 1 on the 8B shape, an H100: benchmarks/results/2026-12-07-h100-run3.md).
Twin: ``quant_reference.int4_linear``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _int4_gemm_kernel(X, W, Scale, Zero, Bias, Out, m, n, k, group, num_groups, stride_xm, stride_wn, stride_om,
                      HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_b = tl.arange(0, BLOCK_K // 2)  # bytes of a K step
    m_mask, n_mask = offs_m < m, offs_n < n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        packed = tl.load(W + offs_n[:, None] * stride_wn + k0 // 2 + offs_b[None, :],
                         mask=n_mask[:, None] & (k0 // 2 + offs_b < k // 2)[None, :], other=0)
        q = tl.reshape(tl.join(packed & 0x0F, packed >> 4), (BLOCK_N, BLOCK_K)).to(tl.float32)
        g = offs_k // group
        sz_mask = n_mask[:, None] & (offs_k < k)[None, :]
        scale = tl.load(Scale + offs_n[:, None] * num_groups + g[None, :], mask=sz_mask, other=0.0)
        zero = tl.load(Zero + offs_n[:, None] * num_groups + g[None, :], mask=sz_mask, other=0.0)
        w = ((q - zero) * scale).to(X.dtype.element_ty)
        x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None] & (offs_k < k)[None, :],
                    other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Out + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(Out.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


# Decode batches up to this many rows take the GEMV.
GEMV_MAX_ROWS = 4


@triton.jit
def _int4_gemv_kernel(X, W, Scale, Zero, Bias, Out, m, n, k, num_groups, stride_xm, stride_wn, stride_om,
                      HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP: tl.constexpr):
    """Each program owns BLOCK_N output features and walks K BLOCK_K columns (BLOCK_K / GROUP groups) a
    step: the nibbles of a [BLOCK_N, BLOCK_K] tile are dequantized in registers ((q - zero) * scale, one
    scale and zero per row and group) and multiplied by the x rows in fp32; partial products accumulate
    per lane and are reduced once at the end (decode_gemv's layout), so that each step streams
    BLOCK_N * BLOCK_K / 2 bytes of the weight."""
    G: tl.constexpr = BLOCK_K // GROUP
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, ROWS)
    offs_b = tl.arange(0, BLOCK_K // 2)
    offs_g = tl.arange(0, G)
    n_mask, r_mask = offs_n < n, offs_r < m
    acc = tl.zeros((ROWS, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, k, BLOCK_K):
        packed = tl.load(W + offs_n[:, None] * stride_wn + k0 // 2 + offs_b[None, :],
                         mask=n_mask[:, None] & (k0 // 2 + offs_b < k // 2)[None, :], other=0)
        q = tl.reshape(tl.join(packed & 0x0F, packed >> 4), (BLOCK_N, G, GROUP)).to(tl.float32)
        groups = k0 // GROUP + offs_g
        sz_mask = n_mask[:, None] & (groups < num_groups)[None, :]
        scale = tl.load(Scale + offs_n[:, None] * num_groups + groups[None, :], mask=sz_mask, other=0.0)
        zero = tl.load(Zero + offs_n[:, None] * num_groups + groups[None, :], mask=sz_mask, other=0.0)
        w = tl.reshape((q - zero[:, :, None]) * scale[:, :, None], (BLOCK_N, BLOCK_K))
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + offs_r[:, None] * stride_xm + offs_k[None, :], mask=r_mask[:, None] & (offs_k < k)[None, :],
                    other=0.0).to(tl.float32)
        acc += x[:, None, :] * w[None, :, :]
    out = tl.sum(acc, axis=2)
    if HAS_BIAS:
        out += tl.load(Bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Out + offs_r[:, None] * stride_om + offs_n[None, :], out.to(Out.dtype.element_ty),
             mask=r_mask[:, None] & n_mask[None, :])


def _gemv_fits(m: int, group: int) -> bool:
    """The GEMV walks whole groups a step: a power-of-two group of 16 to 512 columns (GGUF's 32, AWQ's and
    GPTQ's 32 to 128 are)."""
    return m <= GEMV_MAX_ROWS and 16 <= group <= 512 and group & (group - 1) == 0


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ ((unpack(packed) - zeros) * scales).T + bias. Twin: ``quant_reference.int4_linear``."""
    m, k = x.shape
    n, num_groups = scales.shape
    assert packed.shape == (n, k // 2) and x.stride(-1) == 1 and packed.stride(-1) == 1, "packed must be [N, K / 2]"
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    group = k // num_groups
    if _gemv_fits(m, group):
        # 8 features a program (512 programs for a 4096-feature projection, several per SM) and 64 fp32
        # accumulators a thread: 1,024 columns a step at one row (4 KB of nibbles), fewer at more rows.
        rows, block_n = triton.next_power_of_2(m), 8
        block_k = max(group, 1024 // rows)
        _int4_gemv_kernel[(triton.cdiv(n, block_n),)](
            x, packed, scales, zeros, bias if bias is not None else scales, out, m, n, k, num_groups, x.stride(0),
            packed.stride(0), out.stride(0), HAS_BIAS=bias is not None, ROWS=rows,
            BLOCK_N=block_n, BLOCK_K=block_k, GROUP=group, num_warps=4, num_stages=3)
        return out
    block_m = max(16, min(64, triton.next_power_of_2(m)))
    block_n, block_k = (32, 128) if m <= 16 else (64, 64)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int4_gemm_kernel[grid](x, packed, scales, zeros, bias if bias is not None else scales, out, m, n, k,
                            group, num_groups, x.stride(0), packed.stride(0), out.stride(0),
                            HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                            num_warps=4, num_stages=3)
    return out
