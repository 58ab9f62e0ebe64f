"""4-bit weight-only products on CUDA (AWQ and GPTQ checkpoints, GGUF Q4_0/Q4_1 kept quantized): the
weight streams as int32 words of 8 nibbles in `quant_reference.pack_int4`'s layout (blocks of 32
columns, word s of a block holding columns s, 4 + s, ..., 28 + s) with one fp32 scale and zero per row
and group, and is dequantized in registers, so that no dequantized copy is ever written. Twin:
``quant_reference.int4_linear``.

Nibble j of a tile of words is the columns 4j..4j+3 of each block: a shift and a mask give it, and x is
loaded at those columns, so no unpacked values are interleaved (no layout conversion). The float is
built from the bits, not converted: the nibble q placed in mantissa bits 19..22 of 1.0 is f = 1 + q / 16
exactly, so (q - zero) * scale = (16 f - 16 - zero) * scale.

- Prefill (DEQUANT_MIN_ROWS rows or more): the weight dequantized into a transient buffer, then torch's
  (cuBLAS's) product.
- GEMM (more than GEMV_MAX_ROWS rows, fewer than DEQUANT_MIN_ROWS): per K step, eight tl.dot's, one per nibble, each of the
  slice's dequantized [BLOCK_N, BLOCK_K / 8] weights (f * 16 scale - (16 + zero) * scale: one FMA a
  weight, the two coefficients per word) against x's matching columns.
- GEMV (decode): a tl.dot pads a few rows to 16 and its tiles leave too few programs to stream the weight
  (82.96 ms/token at batch 1 on the 8B shape, an H100: benchmarks/results/2026-12-07-h100-run3.md).
  Each program owns BLOCK_N output features and walks K BLOCKS blocks a step; a lane holds one word,
  whose eight nibbles are one group's, and sums f_j * x_j over them before the group's scale enters:
  sum_j (q_j - zero) * scale * x_j = scale * (16 * sum_j f_j x_j - (16 + zero) * sum_j x_j), so a weight
  costs a shift, a mask-and-or and one FMA; the scale, the zero and the sums of x once a word. Lanes
  accumulate and are reduced once at the end (decode_gemv's layout). Launch shapes: INT4_GEMV_CONFIGS
  (bench_quant.py --sweep-gemv measures them).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from radixlm.kernels.quant_reference import INT4_BLOCK

# Decode batches up to this many rows take the GEMV.
GEMV_MAX_ROWS = 4
# Batches of at least this many rows (prefill) dequantize the weight into a transient [N, K] buffer of x's
# dtype and multiply through torch (cuBLAS), as vLLM's AWQ path does from 256 tokens: there the product is
# compute-bound and cuBLAS's GEMM outruns a Triton one that dequantizes inside its loop, while the extra
# pass (reading K / 2 and writing 2K bytes a row of the weight) costs about what M = 4 rows of the product do.
DEQUANT_MIN_ROWS = 256

# The GEMV's launch shape (BLOCK_N, BLOCKS of 32 columns a step, num_warps, stages): by (rows rounded up to
# a power of two, N, K), else by rows alone (INT4_GEMV_DEFAULTS). RADIXLM_INT4_GEMV_CONFIG
# ("block_n,blocks,warps,stages") overrides both (the sweep's candidates, ablations).
INT4_GEMV_CONFIGS: dict[tuple[int, int, int], tuple[int, int, int, int]] = {}
INT4_GEMV_DEFAULTS: dict[int, tuple[int, int, int, int]] = {
    # 8 KB of words a step at one row (the fp8 GEMV's winner streams 8 KB a step too); fewer columns a
    # step at more rows, so that the per-lane sums stay in registers.
    1: (8, 64, 4, 3), 2: (8, 32, 4, 3), 4: (8, 16, 4, 3),
}


def int4_gemv_config(m: int, n: int, k: int) -> tuple[int, int, int, int]:
    override = os.environ.get("RADIXLM_INT4_GEMV_CONFIG")
    if override:
        block_n, blocks, warps, stages = (int(v) for v in override.split(","))
        return block_n, blocks, warps, stages
    rows = triton.next_power_of_2(m)
    if (rows, n, k) in INT4_GEMV_CONFIGS:
        return INT4_GEMV_CONFIGS[(rows, n, k)]
    block_n, blocks, warps, stages = INT4_GEMV_DEFAULTS[rows]
    return block_n, min(blocks, triton.next_power_of_2(k // INT4_BLOCK)), warps, stages  # no step past K


@triton.jit
def _nibble_float(words, J: tl.constexpr):
    """1 + q / 16 in fp32 for nibble J (bits 4J..4J+3) of each int32 word: q moved to mantissa bits
    19..22 and OR'ed into 1.0's bits (no int-to-float convert; exact for q in 0..15)."""
    if J <= 4:
        bits = words << (19 - 4 * J)
    else:
        bits = words >> (4 * J - 19)  # (the sign bits shifted in are masked off)
    return ((bits & 0x780000) | 0x3F800000).to(tl.float32, bitcast=True)


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
            w = (_nibble_float(words, j) * a + c).to(X.dtype.element_ty)
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
        tl.store(out_ptrs + 4 * j, (_nibble_float(words, j) * a + c).to(Out.dtype.element_ty), mask=mask[:, :, None])


@triton.jit
def _int4_gemv_kernel(X, W, Scale, Zero, Bias, Out, m, n, k, group, num_groups, stride_xm, stride_wn, stride_om,
                      HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr,
                      STAGES: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, ROWS)
    offs_s = tl.arange(0, 4)  # a block's words
    n_mask, r_mask = offs_n < n, offs_r < m
    num_blocks = k // 32
    acc = tl.zeros((ROWS, BLOCK_N, BLOCKS, 4), dtype=tl.float32)
    for b0 in tl.range(0, num_blocks, BLOCKS, num_stages=STAGES):
        blocks = b0 + tl.arange(0, BLOCKS)
        b_mask = blocks < num_blocks
        words = tl.load(W + offs_n[:, None, None] * stride_wn + blocks[None, :, None] * 4 + offs_s[None, None, :],
                        mask=n_mask[:, None, None] & b_mask[None, :, None], other=0)
        sz_mask = n_mask[:, None] & b_mask[None, :]
        sz = offs_n[:, None] * num_groups + (blocks * 32 // group)[None, :]
        scale = tl.load(Scale + sz, mask=sz_mask, other=0.0)
        zero = tl.load(Zero + sz, mask=sz_mask, other=0.0)
        x_ptrs = X + offs_r[:, None, None] * stride_xm + blocks[None, :, None] * 32 + offs_s[None, None, :]
        x_mask = r_mask[:, None, None] & b_mask[None, :, None]
        x = tl.load(x_ptrs, mask=x_mask, other=0.0).to(tl.float32)  # nibble 0's columns: [ROWS, BLOCKS, 4]
        fx = x[:, None] * _nibble_float(words, 0)[None]  # sum_j f_j x_j, a lane per word
        x_sum = x
        for j in tl.static_range(1, 8):
            x = tl.load(x_ptrs + 4 * j, mask=x_mask, other=0.0).to(tl.float32)
            fx += x[:, None] * _nibble_float(words, j)[None]
            x_sum += x
        acc += fx * (16.0 * scale)[None, :, :, None] - x_sum[:, None] * ((16.0 + zero) * scale)[None, :, :, None]
    out = tl.sum(tl.sum(acc, axis=3), axis=2)
    if HAS_BIAS:
        out += tl.load(Bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Out + offs_r[:, None] * stride_om + offs_n[None, :], out.to(Out.dtype.element_ty),
             mask=r_mask[:, None] & n_mask[None, :])


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
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    args = (x, packed, scales, zeros, bias if bias is not None else scales, out, m, n, k, group, num_groups,
            x.stride(0), packed.stride(0), out.stride(0))
    if m <= GEMV_MAX_ROWS:
        block_n, blocks, warps, stages = int4_gemv_config(m, n, k)
        _int4_gemv_kernel[(triton.cdiv(n, block_n),)](
            *args, HAS_BIAS=bias is not None, ROWS=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCKS=blocks,
            STAGES=stages, num_warps=warps)
        return out
    if m >= DEQUANT_MIN_ROWS:
        w = torch.empty((n, k), dtype=x.dtype, device=x.device)
        _int4_dequant_kernel[(triton.cdiv(n, 16), triton.cdiv(k // INT4_BLOCK, 32))](
            packed, scales, zeros, w, n, k, group, num_groups, packed.stride(0), w.stride(0), BLOCK_N=16, BLOCKS=32,
            num_warps=4)
        return torch.nn.functional.linear(x, w, bias)
    block_m = max(16, min(64, triton.next_power_of_2(m)))
    block_n, block_k = (32, 256) if m <= 16 else (64, 128)  # each nibble's tl.dot spans BLOCK_K / 8 >= 16 columns
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int4_gemm_kernel[grid](*args, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                            num_warps=4, num_stages=3)
    return out
