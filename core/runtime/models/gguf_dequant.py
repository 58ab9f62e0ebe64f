"""Torch dequantizers for GGUF's plain block types (F32, F16, BF16, Q8_0, Q4_0, Q4_1), the ones llama.cpp
uses for small models such as the default SmolLM2 file. They compute exactly what the `gguf` package's
numpy dequantizers compute (the same float32 products and sums, equal to the bit: the tests compare
them), in a few torch ops over many tensors at once, where gguf loops in Python over groups of 16 rows
(2.5 CPU seconds of the default model's start-up). Every other type goes to `gguf`.

Many tensors at once, because each torch op over a large tensor opens a parallel region, and on a
loaded 2-core machine each region waits for the second core: per tensor (210 Q4_1 tensors, 5 ops
each) those waits cost 8 to 14 s where the work is 1 s.
"""

from __future__ import annotations

import gguf
import torch

_Q = gguf.GGMLQuantizationType


def dequantizes(qtype: _Q) -> bool:
    """Whether `dequantize` handles this type."""
    return qtype == _Q.F32 or qtype in _BLOCKS or qtype in _FLOATS


def dequantize(raws: list[torch.Tensor], qtype: _Q, shapes: list[tuple[int, ...]],
               out: torch.Tensor | None = None) -> list[torch.Tensor]:
    """float32 tensors of `shapes` from tensors' bytes (uint8, 1-D each), all of one handled type: views
    of `out` (a float32 buffer of at least their total size, reused by the caller from run to run) when
    given, else of a new tensor. F32 tensors are views of their bytes."""
    if qtype == _Q.F32:
        return [raw.view(torch.float32).reshape(shape) for raw, shape in zip(raws, shapes)]
    counts = [torch.Size(shape).numel() for shape in shapes]
    values = torch.empty(sum(counts)) if out is None else out[: sum(counts)]
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    joined = raws[0] if len(raws) == 1 else torch.cat(raws)
    if qtype in _FLOATS:
        values.copy_(joined.view(_FLOATS[qtype]))
    else:
        blocks = joined.view(-1, type_size)
        _BLOCKS[qtype](blocks, values.view(blocks.shape[0], -1))
    return [v.view(shape) for v, shape in zip(values.split(counts), shapes)]


def _scale(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 field at byte `at` of every block, as a float32 column."""
    return blocks[:, at : at + 2].view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[n, 16] bytes -> [n, 32] values: the low nibbles are elements 0-15, the high ones 16-31."""
    return torch.cat((packed & 0x0F, packed >> 4), dim=1)


# Each writes its float32 values into `out` [blocks, 32]: the integers are converted by one contiguous
# copy, then scaled in place, the same float32 products and sums as gguf's (a mixed-type product, uint8
# by float32 into fresh memory, took twice as long).
def _q8_0(blocks: torch.Tensor, out: torch.Tensor) -> None:  # d (fp16), 32 x int8: d * q
    out.copy_(blocks[:, 2:].view(torch.int8)).mul_(_scale(blocks, 0))


def _q4_0(blocks: torch.Tensor, out: torch.Tensor) -> None:  # d (fp16), 16 bytes of nibbles: d * (q - 8)
    out.copy_(_nibbles(blocks[:, 2:])).sub_(8).mul_(_scale(blocks, 0))


def _q4_1(blocks: torch.Tensor, out: torch.Tensor) -> None:  # d, m (fp16), 16 bytes of nibbles: d * q + m
    out.copy_(_nibbles(blocks[:, 4:])).mul_(_scale(blocks, 0)).add_(_scale(blocks, 2))


_BLOCKS = {_Q.Q8_0: _q8_0, _Q.Q4_0: _q4_0, _Q.Q4_1: _q4_1}
_FLOATS = {_Q.F16: torch.float16, _Q.BF16: torch.bfloat16}


def integer_blocks(raw: torch.Tensor, qtype: _Q, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor,
                                                                                    torch.Tensor | None]:
    """A Q8_0, Q4_0 or Q4_1 tensor's fields as they are stored, for products on the quantized values:
    (integers [rows, cols] (int8 for Q8_0, 0..15 as uint8 for Q4_x), scales d [rows, cols/32] (fp32, from
    fp16), mins m [rows, cols/32] (Q4_1; else None)). The real weight is d * q (Q8_0), d * (q - 8)
    (Q4_0), d * q + m (Q4_1), 32 values a block."""
    if qtype not in _BLOCKS:
        raise ValueError(f"{qtype.name} has no integer-block form here (Q8_0, Q4_0 and Q4_1 do)")
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = shape[0], shape[-1]
    blocks = raw.view(-1, type_size)
    d = _scale(blocks, 0).view(rows, cols // 32)
    if qtype == _Q.Q8_0:
        return blocks[:, 2:].view(torch.int8).reshape(rows, cols), d, None
    first = 4 if qtype == _Q.Q4_1 else 2
    q = _nibbles(blocks[:, first:]).reshape(rows, cols)
    return q, d, _scale(blocks, 2).view(rows, cols // 32) if qtype == _Q.Q4_1 else None
