"""Prefill attention through torch's FlashAttention (its variable-length kernel), for extend batches in
which no request has a cached prefix: each request's keys are then exactly its new tokens, packed like
its queries, and no paged gather is needed. On the H200 it runs a 16 x 1024 causal prefill in about half
the time of the paged Triton kernel (docs/benchmarks.md); extends over cached prefixes stay on that one.

The entry point is ``torch.ops.aten._flash_attention_forward``: the public wrapper
``torch.nn.attention.varlen.varlen_attn`` changed its signature between torch 2.10 and 2.12 (is_causal
became window_size, GQA became a flag), while the op's leading arguments have stayed the same.
"""

from __future__ import annotations

import torch


def available(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether this torch build runs FlashAttention for this device, dtype and head size."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16) or not torch.cuda.is_available():
        return False
    if head_dim % 8 or head_dim > 256 or not torch.backends.cuda.is_flash_attention_available():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index) >= (8, 0)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
                      sm_scale: float) -> torch.Tensor:
    """Causal attention of each request's tokens over themselves. q [T, H, D], k and v [T, KH, D] (H a
    multiple of KH), request after request; cu_seqlens [B + 1] int32 offsets of each request's first
    token (and the total); max_len the longest request. Returns [T, H, D]."""
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, 0.0, True, False,
                                                   scale=sm_scale)[0]
