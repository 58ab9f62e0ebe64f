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
