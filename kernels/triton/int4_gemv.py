"""The 4-bit product of the decode GEMVs (decode_gemv.py's kernels call `product_int4` where the weight is
4-bit): x [BLOCK_M, K] times pack_int4's words [N, K / 8] (kernels/triton/int4_layout.py) with per-group fp32
scales and zeros, in fp32 [BLOCK_M, BLOCK_N], for one program's BLOCK_N output features."""

from __future__ import annotations

import triton
import triton.language as tl

from radixlm.kernels.triton.elementwise import load_x
from radixlm.kernels.triton.int4_layout import add_f16x2, f16x2_sum, nibble_float, pair_f16x2, word_dot_f16x2

# Triton lays a load's lanes out along its pointers' most contiguous dim first; between dims of equal
# contiguity (a tile's rows and blocks, 1 each) up to 3.6 (the GPU image's) the first is fastest, in 3.9
# the last (3.7-3.8 not checked). The scales' loads are oriented so that their lanes run along the blocks,
# as the words' do: otherwise every step converts them through shared memory.
TIES_FIRST_FASTEST = tl.constexpr(tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 7))

@triton.jit
def _x_slices(X, offs, mask, k, SILU: tl.constexpr):
    """The activations of a step's eight nibble slices: slice j is columns 4j..4j+3 of each block (`offs`
    are slice 0's)."""
    return (load_x(X, offs, mask, k, SILU), load_x(X, offs + 4, mask, k, SILU),
            load_x(X, offs + 8, mask, k, SILU), load_x(X, offs + 12, mask, k, SILU),
            load_x(X, offs + 16, mask, k, SILU), load_x(X, offs + 20, mask, k, SILU),
            load_x(X, offs + 24, mask, k, SILU), load_x(X, offs + 28, mask, k, SILU))


@triton.jit
def _int4_step(X, W, Scale, Zero, rows, blocks, w_offs, x_offs, m_mask, num_blocks, num_groups, group, k,
               SILU: tl.constexpr, EVEN_K: tl.constexpr):
    """One step's loads: the words [BLOCK_N, BLOCKS, 4] (a block's four words, 16 bytes, in one lane), the
    scales and zeros [BLOCK_N, BLOCKS] and the eight activation slices [BLOCK_M, BLOCKS, 4]. Rows and blocks
    past the end are clamped to the last (their products are never stored, or meet zero activations), so
    only the activations are masked, and only where K ends inside a step (not EVEN_K)."""
    safe = tl.minimum(blocks, num_blocks - 1)
    # Contiguity 2 along the blocks (4 in truth along a block's words, the dim that sets the vector width,
    # 1 along rows and blocks) tells Triton to lay lanes out along the blocks before the rows.
    words = tl.load(W + tl.max_contiguous(w_offs + safe[None, :, None] * 4, [1, 2, 4]))
    if TIES_FIRST_FASTEST:  # scales [BLOCKS, BLOCK_N] put the blocks first, then transposed
        sz = rows[None, :] * num_groups + (safe * 32 // group)[:, None]
        scale, zero = tl.trans(tl.load(Scale + sz)), tl.trans(tl.load(Zero + sz))
    else:
        sz = rows[:, None] * num_groups + (safe * 32 // group)[None, :]
        scale, zero = tl.load(Scale + sz), tl.load(Zero + sz)
    if EVEN_K:  # a block past K is only ever a prefetch past the end, whose values go unused
        x = _x_slices(X, x_offs + safe[None, :, None] * 32, m_mask[:, None, None], k, SILU)
    else:
        x = _x_slices(X, x_offs + blocks[None, :, None] * 32,
                      m_mask[:, None, None] & (blocks < num_blocks)[None, :, None], k, SILU)
    return words, scale, zero, x


@triton.jit
def _int4_accumulate(acc, words, xs, scale, zero, ROWS: tl.constexpr):
    """acc plus each word's share of the product, [BLOCK_N, BLOCKS, 4] (one row of x) or [BLOCK_M, BLOCK_N,
    BLOCKS, 4] (ROWS: several): sum_j (q_j - zero) * scale * x_j = scale * (16 * sum_j f_j x_j - (16 + zero)
    * sum_j x_j) over its eight nibbles j, with f = 1 + q / 16 from the bits (a shift, a mask-and-or and an
    FMA a weight); the group's scale and zero enter once a word (two FMAs)."""
    x0, x1, x2, x3, x4, x5, x6, x7 = xs
    if ROWS:  # x [BLOCK_M, BLOCKS, 4] against words [BLOCK_N, BLOCKS, 4]
        words = words[None]
        x0, x1, x2, x3, x4, x5, x6, x7 = (x0[:, None], x1[:, None], x2[:, None], x3[:, None], x4[:, None],
                                          x5[:, None], x6[:, None], x7[:, None])
        a, c = (16.0 * scale)[None, :, :, None], ((16.0 + zero) * scale)[None, :, :, None]
    else:
        a, c = (16.0 * scale)[:, :, None], ((16.0 + zero) * scale)[:, :, None]
    fx = x0 * nibble_float(words, 0)
    fx += x1 * nibble_float(words, 1)
    fx += x2 * nibble_float(words, 2)
    fx += x3 * nibble_float(words, 3)
    fx += x4 * nibble_float(words, 4)
    fx += x5 * nibble_float(words, 5)
    fx += x6 * nibble_float(words, 6)
    fx += x7 * nibble_float(words, 7)
    acc += fx * a
    acc -= (x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7) * c
    return acc


@triton.jit
def _row_scale(X, k, SILU: tl.constexpr, CHUNK: tl.constexpr):
    """(f, 1 / f) for a row of x (the packed path): the power of two that puts its largest |x| in [64, 128),
    so that a block's fp16 sums (a half: 16 products of |q - 8| <= 8 and (8 - zero) times 16 x's) stay
    under 2^15, below fp16's 65,504, whatever the row's range (Llama's large activations reach thousands). A pass over the row
    before the loop (K values, read from L2 while the first step's weights are on their way)."""
    offs = tl.arange(0, CHUNK)
    top = tl.zeros((CHUNK,), dtype=tl.float32)
    for k0 in tl.range(0, k, CHUNK):
        top = tl.maximum(top, tl.abs(load_x(X, k0 + offs, k0 + offs < k, k, SILU)))
    # Its biased exponent e, kept in [7, 255] so that both powers are normal floats (an all-zero row
    # takes 2^127; inf or NaN propagates through the products as in the fp32 path).
    e = tl.minimum(tl.maximum(tl.max(top, axis=0).to(tl.int32, bitcast=True) >> 23, 7), 255)
    return ((260 - e) << 23).to(tl.float32, bitcast=True), ((e - 6) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _int4_accumulate_f16x2(acc, words, xs, scale, zero, f):
    """acc [BLOCK_N, BLOCKS] plus the step's share of the product on the packed path (one row of x, CUDA), in
    units of the row's f: a block's sum of (q - zero) * x * f in fp16x2 (`word_dot_f16x2`, then the block's
    four words: a half sums 16 products and 16 x's times 8 - zero), its halves in fp32, times the scale."""
    x0, x1, x2, x3, x4, x5, x6, x7 = xs
    p0, p1 = pair_f16x2(x0 * f, x4 * f), pair_f16x2(x1 * f, x5 * f)
    p2, p3 = pair_f16x2(x2 * f, x6 * f), pair_f16x2(x3 * f, x7 * f)
    psum = add_f16x2(add_f16x2(p0, p1), add_f16x2(p2, p3))
    c = pair_f16x2(8.0 - zero, 8.0 - zero)[:, :, None]
    sums = word_dot_f16x2(words, p0, p1, p2, p3, psum, c)
    return acc + scale * f16x2_sum(tl.reduce(sums, 2, add_f16x2))


@triton.jit
def _int4_add(acc, words, xs, scale, zero, f, ROWS: tl.constexpr, F16X2: tl.constexpr):
    """A step's products into acc on the packed path (F16X2) or the fp32 one."""
    if F16X2:
        acc = _int4_accumulate_f16x2(acc, words, xs, scale, zero, f)
    else:
        acc = _int4_accumulate(acc, words, xs, scale, zero, ROWS)
    return acc


@triton.jit
def product_int4(X, W, Scale, Zero, offs_m, offs_n, m_mask, n_mask, k, group, num_groups, stride_xm, stride_wn,
                  SILU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  STAGES: tl.constexpr, EVEN_K: tl.constexpr, PACKED: tl.constexpr):
    """_product for a 4-bit W: pack_int4's words [N, K / 8] with fp32 Scale and Zero [N, K / group], a
    step of BLOCK_K / 32 blocks (`_int4_terms`). A lane holds a block's four words (one 16-byte load) of
    each of its rows. At one row of x (batch-1 decode) the weight tile's layout is the compute layout: the
    activation slices [1, BLOCKS, 4] (fewer values than lanes, see `gemv_config`) load straight into it,
    shared by the rows a lane holds, so no tile goes through shared memory for a layout; several rows of x
    take a 4D product (Triton converts the words' layout there). STAGES 1: the next step's loads are
    issued before this step's products (registers, a step ahead); more: Triton's pipeliner stages the
    loads through shared memory (cp.async), read back in the same layout. PACKED: one row's nibble math in
    fp16x2 (`_int4_accumulate_f16x2`, CUDA only), x scaled by `_row_scale`'s power of two first."""
    BLOCKS: tl.constexpr = BLOCK_K // 32
    ROWS: tl.constexpr = BLOCK_M > 1
    F16X2: tl.constexpr = PACKED and not ROWS
    offs_b = tl.arange(0, BLOCKS)
    offs_s = tl.arange(0, 4)  # a block's words
    num_blocks = k // 32
    rows = tl.minimum(offs_n, tl.max(tl.where(n_mask, offs_n, 0)))  # rows past N read the last one
    w_offs = rows[:, None, None] * stride_wn + offs_s[None, None, :]
    x_offs = offs_m[:, None, None] * stride_xm + offs_s[None, None, :]
    if F16X2:
        acc = tl.zeros((BLOCK_N, BLOCKS), dtype=tl.float32)
    elif ROWS:
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCKS, 4), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCKS, 4), dtype=tl.float32)
    f, inv_f = 1.0, 1.0
    if STAGES == 1:
        words, scale, zero, xs = _int4_step(X, W, Scale, Zero, rows, offs_b, w_offs, x_offs, m_mask, num_blocks,
                                            num_groups, group, k, SILU, EVEN_K)
        if F16X2:
            f, inv_f = _row_scale(X, k, SILU, 1024)
        for b0 in tl.range(0, num_blocks, BLOCKS, loop_unroll_factor=2):
            n_words, n_scale, n_zero, n_xs = _int4_step(X, W, Scale, Zero, rows, b0 + BLOCKS + offs_b, w_offs,
                                                        x_offs, m_mask, num_blocks, num_groups, group, k, SILU, EVEN_K)
            acc = _int4_add(acc, words, xs, scale, zero, f, ROWS, F16X2)
            words, scale, zero, xs = n_words, n_scale, n_zero, n_xs
    else:
        if F16X2:
            f, inv_f = _row_scale(X, k, SILU, 1024)
        for b0 in tl.range(0, num_blocks, BLOCKS, num_stages=STAGES):
            words, scale, zero, xs = _int4_step(X, W, Scale, Zero, rows, b0 + offs_b, w_offs, x_offs, m_mask,
                                                num_blocks, num_groups, group, k, SILU, EVEN_K)
            acc = _int4_add(acc, words, xs, scale, zero, f, ROWS, F16X2)
    if F16X2:
        out = (tl.sum(acc, axis=1) * inv_f)[None, :]
    elif ROWS:
        out = tl.sum(tl.sum(acc, axis=3), axis=2)
    else:
        out = tl.sum(tl.sum(acc, axis=2), axis=1)[None, :]
    return out
