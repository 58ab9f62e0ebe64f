"""The 4-bit weights' packed layout (``quant_reference.pack_int4``) read in Triton: int32 words of eight
nibbles in blocks of 32 columns, word s of a block holding columns s, 4 + s, ..., 28 + s (nibble j, bits
4j..4j+3, is column 4j + s). Shifting nibble j out of a tile of words gives columns 4j..4j+3 of every
block, whose activations a kernel loads where they lie: no unpacked values are interleaved."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def nibble_float(words, J: tl.constexpr):
    """f = 1 + q / 16 in fp32 for nibble J of each int32 word: q moved to mantissa bits 19..22 and OR'ed
    into 1.0's bits, so no int-to-float convert (exact for q in 0..15); (q - zero) * scale is then
    (16 f - 16 - zero) * scale."""
    if J <= 4:
        bits = words << (19 - 4 * J)
    else:
        bits = words >> (4 * J - 19)  # (the sign bits shifted in are masked off)
    return ((bits & 0x780000) | 0x3F800000).to(tl.float32, bitcast=True)


# A word's nibbles j and j + 4 (columns 4j + s and 16 + 4j + s) sit 16 bits apart, so one mask-and-or puts
# both in the mantissas of an fp16 pair: (word >> 8i) & 0x000F000F | 0x64006400 is 1024 + q in each half,
# & 0x00F000F0 gives 1024 + 16 q; one HSUB2 (or HFMA2 by 1/16) makes them q - 8, exactly (integers
# below 2048), and one HFMA2 multiplies them into the word's sums with x's pair.
_WORD_DOT = tl.constexpr("""{
    .reg .b32 t, u, c1032, c16th, cm72;
    mov.b32 c1032, 0x64086408;
    mov.b32 c16th, 0x2c002c00;
    mov.b32 cm72, 0xd480d480;
    lop3.b32 t, $1, 0x000f000f, 0x64006400, 0xea;
    sub.rn.f16x2 t, t, c1032;
    mul.rn.f16x2 $0, t, $2;
    lop3.b32 t, $1, 0x00f000f0, 0x64006400, 0xea;
    fma.rn.f16x2 t, t, c16th, cm72;
    fma.rn.f16x2 $0, t, $3, $0;
    shr.u32 u, $1, 8;
    lop3.b32 t, u, 0x000f000f, 0x64006400, 0xea;
    sub.rn.f16x2 t, t, c1032;
    fma.rn.f16x2 $0, t, $4, $0;
    lop3.b32 t, u, 0x00f000f0, 0x64006400, 0xea;
    fma.rn.f16x2 t, t, c16th, cm72;
    fma.rn.f16x2 $0, t, $5, $0;
    fma.rn.f16x2 $0, $6, $7, $0;
}""")


@triton.jit
def word_dot_f16x2(words, p0, p1, p2, p3, psum, c):
    """The fp16x2 sums (as int32) of (q - zero) * x over each word's eight nibbles, nibble j in the low half
    and j + 4 in the high half (CUDA only: inline PTX): p_i are the fp16x2 activation pairs (x[4i + s],
    x[16 + 4i + s]) of the word's columns (`pair_f16x2`), psum their sum, c the pair (8 - zero, 8 - zero):
    sum_j (q_j - 8) x_j + (8 - zero) sum_j x_j. 1.75 instructions a weight: a shift, four LOP3, four HSUB2
    or HFMA2 and five HFMA2 a word."""
    return tl.inline_asm_elementwise(_WORD_DOT, "=r,r,r,r,r,r,r,r", [words, p0, p1, p2, p3, psum, c],
                                     dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def pair_f16x2(lo, hi):
    """fp16x2 (as int32) of two fp32 tensors, lo in the low half: one cvt.rn.f16x2.f32 a pair."""
    return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [lo, hi], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton.jit
def add_f16x2(a, b):
    """a + b of fp16x2 pairs held in int32 (HADD2)."""
    return tl.inline_asm_elementwise("add.rn.f16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True,
                                     pack=1)


@triton.jit
def f16x2_sum(pairs):
    """The sum of each fp16x2 pair's halves in fp32."""
    return tl.inline_asm_elementwise("{.reg .f16 lo, hi; .reg .f32 a, b; mov.b32 {lo, hi}, $1; cvt.f32.f16 a, lo; "
                                     "cvt.f32.f16 b, hi; add.f32 $0, a, b;}", "=f,r", [pairs], dtype=tl.float32,
                                     is_pure=True, pack=1)
