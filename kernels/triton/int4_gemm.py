"""4-bit weight-only products on CUDA (AWQ and GPTQ checkpoints, GGUF Q4_0/Q4_1 kept quantized): the
weight streams as int32 words of 8 nibbles in `quant_reference.pack_int4`'s layout (kernels/triton/
int4_layout.py) with one fp32 scale and zero per row and group, dequantized in registers. Twin:
``quant_reference.int4_linear``. By the batch's rows:

- up to GEMV_MAX_ROWS (decode): decode_gemv's GEMV on the 4-bit weight (a tl.dot pads a few rows to 16
  and its tiles leave too few programs to stream the weight: 82.96 ms/token at batch 1 on the 8B shape,
  an H100, benchmarks/results/2026-12-07-h100-run3.md);
- up to DEQUANT_MIN_ROWS: a GEMM whose K step runs eight tl.dot's, one per nibble: each of the slice's
  [BLOCK_N, BLOCK_K / 8] weights dequantized in registers (f * 16 scale - (16 + zero) * scale, one FMA a
  weight, the two coefficients per word) against x's matching columns, so nothing is interleaved;
- from DEQUANT_MIN_ROWS (prefill): the weight dequantized into a transient buffer, then torch's product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixlm.kernels.quant_reference import INT4_BLOCK
from radixlm.kernels.triton.decode_gemv import gemv
from radixlm.kernels.triton.int4_layout import nibble_float

# Decode batches up to this many rows take the GEMV.
GEMV_MAX_ROWS = 4
# Batches of at least this many rows (prefill) dequantize the weight into a transient [N, K] buffer of x's
# dtype and multiply through torch (cuBLAS), as vLLM's AWQ path does from 256 tokens: there the product is
# compute-bound and cuBLAS's GEMM outruns a Triton one that dequantizes inside its loop, while the extra
# pass (reading K / 2 and writing 2K bytes a row of the weight) costs about what M = 4 rows of the product do.
DEQUANT_MIN_ROWS = 256


@triton.jit
def _int4_gemm_kernel(X, W, Scale, Zero, Bias, Out, m, n, k, group, num_groups, stride_xm, stride_wn, stride_om,
                      HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    WORDS: tl.constexpr = BLOCK_K // 8
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < m, offs_n < n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        word = k0 // 8 + tl.arange(0, WORDS)  # word 4b + s of the matrix row: block b, columns 32b + 4j + s
        k_mask = word < k // 8
        w_mask = n_mask[:, None] & k_mask[None, :]
        words = tl.load(W + offs_n[:, None] * stride_wn + word[None, :], mask=w_mask, other=0)
        col = word // 4 * 32 + word % 4  # the column of nibble 0
        sz = offs_n[:, None] * num_groups + (col // group)[None, :]
        scale = tl.load(Scale + sz, mask=w_mask, other=0.0)
        zero = tl.load(Zero + sz, mask=w_mask, other=0.0)
        a, c = 16.0 * scale, -(16.0 + zero) * scale
        x_ptrs = X + offs_m[:, None] * stride_xm + col[None, :]
        x_mask = m_mask[:, None] & k_mask[None, :]
        for j in tl.static_range(8):
            w = (nibble_float(words, j) * a + c).to(X.dtype.element_ty)
            x = tl.load(x_ptrs + 4 * j, mask=x_mask, other=0.0)
            acc = tl.dot(x, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Out + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(Out.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _int4_dequant_kernel(W, Scale, Zero, Out, n, k, group, num_groups, stride_wn, stride_on,
                         BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr):
    """Out [N, K] = (q - zero) * scale in Out's dtype, a [BLOCK_N, BLOCKS * 32] tile a program."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    blocks = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    offs_s = tl.arange(0, 4)
    mask = (offs_n < n)[:, None] & (blocks < k // 32)[None, :]
    words = tl.load(W + offs_n[:, None, None] * stride_wn + blocks[None, :, None] * 4 + offs_s[None, None, :],
                    mask=mask[:, :, None], other=0)
    sz = offs_n[:, None] * num_groups + (blocks * 32 // group)[None, :]
    scale = tl.load(Scale + sz, mask=mask, other=0.0)
    zero = tl.load(Zero + sz, mask=mask, other=0.0)
    a, c = (16.0 * scale)[:, :, None], (-(16.0 + zero) * scale)[:, :, None]
    out_ptrs = Out + offs_n[:, None, None] * stride_on + blocks[None, :, None] * 32 + offs_s[None, None, :]
    for j in tl.static_range(8):
        tl.store(out_ptrs + 4 * j, (nibble_float(words, j) * a + c).to(Out.dtype.element_ty), mask=mask[:, :, None])


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ ((unpack(packed) - zeros) * scales).T + bias, packed [N, K / 8] int32 in pack_int4's
    layout, scales and zeros fp32 [N, K / group] with group a multiple of 32. Twin:
    ``quant_reference.int4_linear``."""
    m, k = x.shape
    n, num_groups = scales.shape
    assert packed.dtype == torch.int32 and packed.shape == (n, k // 8) and k % INT4_BLOCK == 0, \
        "packed must be pack_int4's [N, K / 8] int32"
    assert x.stride(-1) == 1 and packed.stride(-1) == 1, "x and packed must be contiguous along K"
    group = k // num_groups
    assert group * num_groups == k and group % INT4_BLOCK == 0, f"groups must be of a multiple of {INT4_BLOCK} columns"
    if 0 < m <= GEMV_MAX_ROWS:
        return gemv(x, packed, bias, scales, zeros)
    if m >= DEQUANT_MIN_ROWS:
        w = torch.empty((n, k), dtype=x.dtype, device=x.device)
        _int4_dequant_kernel[(triton.cdiv(n, 16), triton.cdiv(k // INT4_BLOCK, 32))](
            packed, scales, zeros, w, n, k, group, num_groups, packed.stride(0), w.stride(0), BLOCK_N=16, BLOCKS=32,
            num_warps=4)
        return torch.nn.functional.linear(x, w, bias)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m = max(16, min(64, triton.next_power_of_2(m)))
    block_n, block_k = (32, 256) if m <= 16 else (64, 128)  # each nibble's tl.dot spans BLOCK_K / 8 >= 16 columns
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int4_gemm_kernel[grid](x, packed, scales, zeros, bias if bias is not None else scales, out, m, n, k, group,
                            num_groups, x.stride(0), packed.stride(0), out.stride(0), HAS_BIAS=bias is not None,
                            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=3)
    return out
