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

    A mask is bool [V] (True = allowed) or packed int32 [ceil(V / 32)] (see TokenIndex.mask); one batch
    uses one kind. On a GPU pass packed masks: one small host-to-device copy, unpacked on the device.
    A row left with no finite logit (a penalty or bias had banned every allowed token) gets 0 on its
    allowed tokens, so sampling still picks an allowed one. In place; returns `logits`."""
    if len(masks) != logits.shape[0]:
        raise ValueError(f"{len(masks)} masks for {logits.shape[0]} rows of logits")
    rows = [i for i, m in enumerate(masks) if m is not None]
    if not rows:
        return logits
    kinds = {masks[i].dtype == torch.bool for i in rows}
    if len(kinds) != 1:
        raise ValueError("masks of one batch must be all bool or all packed")
    stacked = torch.stack([masks[i] for i in rows]).to(logits.device, non_blocking=True)
    allowed = stacked if kinds == {True} else unpack_bitmask(stacked, logits.shape[1])
    whole = len(rows) == logits.shape[0]
    index = None if whole else torch.tensor(rows, device=logits.device)
    sub = logits if whole else logits[index]
    sub = sub.masked_fill(~allowed, float("-inf"))
    stuck = torch.isneginf(sub).all(dim=-1, keepdim=True)
    sub = torch.where(stuck & allowed, torch.zeros((), dtype=sub.dtype, device=sub.device), sub)
    if whole:
        logits.copy_(sub)
    else:
        logits[index] = sub
    return logits
