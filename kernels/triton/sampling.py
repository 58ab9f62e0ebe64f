"""Sampling helpers that pay as kernels: applying a packed allowed-token bitmask to the logits, and the
seeded Exp(1) noise of the sampler's exponential race."""

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


@triton.jit
def _seeded_exponential_kernel(Keys, Out, stride_o, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    key = tl.load(Keys + row)
    x = (key + offs.to(tl.int64) * 0x9E3779B1) & 0xFFFFFFFF  # the reference's int64 arithmetic
    x = ((x ^ (x >> 16)) * 0x045D9F3B) & 0xFFFFFFFF
    x = ((x ^ (x >> 16)) * 0x045D9F3B) & 0xFFFFFFFF
    x = x ^ (x >> 16)
    u = ((x >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    tl.store(Out + row * stride_o + offs, -tl.log(u), mask=offs < vocab)


def seeded_exponential(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Twin: ``reference.seeded_exponential`` (one kernel instead of a dozen [S, V] int64 passes)."""
    out = torch.empty((keys.shape[0], vocab), dtype=torch.float32, device=keys.device)
    if keys.shape[0]:
        block = 2048
        _seeded_exponential_kernel[(keys.shape[0], triton.cdiv(vocab, block))](
            keys, out, out.stride(0), vocab, BLOCK=block, num_warps=4
        )
    return out
