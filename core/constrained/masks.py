"""Applying per-row token masks to a batch of logits where only some rows are constrained."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch


@functools.lru_cache(maxsize=8)
def _bit_positions(vocab_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.arange(vocab_size, device=device)
    return ids // 32, (ids % 32).to(torch.int32)


def unpack_bitmask(packed: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [..., vocab_size] from packed int32 words [..., ceil(vocab_size / 32)] (bit i % 32 of word i // 32)."""
    word, bit = _bit_positions(vocab_size, packed.device)
    return ((packed[..., word] >> bit) & 1).bool()


def apply_token_masks(logits: torch.Tensor, masks: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """Sets logits[i, t] = -inf wherever masks[i] forbids t; rows whose mask is None are left alone.

    A mask is bool [V] (True = allowed) or packed int32 [ceil(V / 32)] (see TokenIndex.mask). On a GPU,
    pass packed masks: one small host-to-device copy, unpacked and applied on the device. In place;
    returns `logits`."""
    if len(masks) != logits.shape[0]:
        raise ValueError(f"{len(masks)} masks for {logits.shape[0]} rows of logits")
    rows = [i for i, m in enumerate(masks) if m is not None]
    if not rows:
        return logits
    vocab_size = logits.shape[1]
    if logits.device.type == "cpu" and len(rows) <= 8 and all(masks[i].dtype == torch.bool for i in rows):
        # A few rows: one pass each, no stacking copy.
        neg_inf = logits.new_tensor(float("-inf"))
        for i in rows:
            row = logits[i]
            torch.where(masks[i], row, neg_inf, out=row)
        return logits
    packed = [masks[i] for i in rows if masks[i].dtype != torch.bool]
    if packed and len(packed) != len(rows):
        raise ValueError("masks of one batch must be all bool or all packed")
    stacked = torch.stack([masks[i] for i in rows]).to(logits.device, non_blocking=True)
    allowed = unpack_bitmask(stacked, vocab_size) if packed else stacked
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return logits
