"""Sampling helpers that pay as kernels: applying a packed allowed-token bitmask to the logits."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _token_bitmask_kernel(Logits, Bitmask, stride_l, stride_b, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = offs < vocab
    words = tl.load(Bitmask + row * stride_b + offs // 32, mask=in_vocab, other=-1)
    banned = ((words >> (offs % 32)) & 1) == 0
    # Only the banned positions are touched: the logits are never read.
    tl.store(Logits + row * stride_l + offs, float("-inf"), mask=in_vocab & banned)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: -inf where the token's bit is 0. Twin: ``reference.apply_token_bitmask``."""
    assert logits.stride(-1) == 1 and bitmask.stride(-1) == 1, "last dims must be contiguous"
    rows, vocab = logits.shape
    if rows == 0:
        return
    block = 4096
    _token_bitmask_kernel[(rows, triton.cdiv(vocab, block))](
        logits, bitmask, logits.stride(0), bitmask.stride(0), vocab, BLOCK=block, num_warps=8
    )
