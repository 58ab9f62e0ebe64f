"""Applying per-row token masks to a batch of logits where only some rows are constrained."""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
import torch

from radixlm.kernels.registry import get_ops


class MaskCache:
    """Token masks per automaton state and logits width, least recently used first out. A mask is
    bool [vocab_size], or packed int32 [ceil(vocab_size / 32)] with token i at bit i % 32 of word
    i // 32; it is shared between requests: never write to it."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._masks: OrderedDict[tuple[int, int, bool], torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, state: int, vocab_size: int, packed: bool,
            allowed: Callable[[int], np.ndarray]) -> torch.Tensor:
        """The mask of `state`, built on a miss from allowed(vocab_size): packed bits, uint8 [4 * words]
        (token i at bit i % 8 of byte i // 8)."""
        key = (state, vocab_size, packed)
        with self._lock:
            found = self._masks.get(key)
            if found is not None:
                self._masks.move_to_end(key)
                return found
        bits = allowed(vocab_size)
        if packed:
            tensor = torch.from_numpy(bits.view(np.int32))
        else:
            tensor = torch.from_numpy(np.unpackbits(bits, count=vocab_size, bitorder="little").view(bool))
        with self._lock:
            self._masks[key] = tensor
            if len(self._masks) > self.size:
                self._masks.popitem(last=False)
        return tensor


@functools.lru_cache(maxsize=8)
def _bit_positions(vocab_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.arange(vocab_size, device=device)
    return ids // 32, (ids % 32).to(torch.int32)


def unpack_bitmask(packed: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [..., vocab_size] from packed int32 words [..., ceil(vocab_size / 32)] (bit i % 32 of word i // 32)."""
    word, bit = _bit_positions(vocab_size, packed.device)
    return ((packed[..., word] >> bit) & 1).bool()


def apply_token_masks(
    logits: torch.Tensor, masks: Sequence[torch.Tensor | None], rescue_banned_rows: bool = True
) -> torch.Tensor:
    """Sets logits[i, t] = -inf wherever masks[i] forbids t; rows whose mask is None are left alone.

    A mask is bool [V] (True = allowed) or packed int32 [ceil(V / 32)] (see GrammarIndex.mask). On the CPU
    each row is masked in place (no [B, V] temporaries); on a GPU the batch's masks go over in one copy,
    packed ones 32x smaller, and are unpacked and applied there. A row left with no finite logit (a
    penalty or bias had banned every allowed token) gets 0 on its allowed tokens, so sampling still
    picks an allowed one; callers that banned nothing themselves pass rescue_banned_rows=False, which on
    a GPU with packed masks applies the whole batch in one kernel. In place; returns `logits`."""
    if len(masks) != logits.shape[0]:
        raise ValueError(f"{len(masks)} masks for {logits.shape[0]} rows of logits")
    rows = [i for i, m in enumerate(masks) if m is not None]
    if not rows:
        return logits
    vocab_size = logits.shape[1]
    neg_inf = torch.full((), float("-inf"), dtype=logits.dtype, device=logits.device)
    zero = torch.zeros((), dtype=logits.dtype, device=logits.device)
    if logits.device.type == "cpu":
        for i in rows:
            mask = masks[i]
            allowed = mask if mask.dtype == torch.bool else unpack_bitmask(mask, vocab_size)
            row = logits[i]
            torch.where(allowed, row, neg_inf, out=row)
            if float(row.amax()) == float("-inf"):
                torch.where(allowed, zero, neg_inf, out=row)
        return logits
    if len({masks[i].dtype == torch.bool for i in rows}) != 1:
        raise ValueError("masks of one batch must be all bool or all packed")
    if not rescue_banned_rows and masks[rows[0]].dtype == torch.int32:
        # One [B, words] bitmask (unconstrained rows all ones), one small copy, one kernel.
        # Pinned, so the copy stays asynchronous: from pageable memory CUDA may first wait for the
        # stream, i.e. for the forward pass this step's sampling is queued behind.
        host = torch.empty((logits.shape[0], masks[rows[0]].shape[0]), dtype=torch.int32, pin_memory=True)
        if len(rows) == len(masks):  # every row constrained (a JSON batch): one pass over the bits
            torch.stack(masks, out=host)
        else:
            host.fill_(-1)
            host[rows] = torch.stack([masks[i] for i in rows])
        get_ops(logits.device).apply_token_bitmask(logits, host.to(logits.device, non_blocking=True))
        return logits
    stacked = torch.stack([masks[i] for i in rows]).pin_memory().to(logits.device, non_blocking=True)
    allowed = stacked if stacked.dtype == torch.bool else unpack_bitmask(stacked, vocab_size)
    whole = len(rows) == logits.shape[0]
    index = None if whole else torch.tensor(rows, device=logits.device)
    sub = logits if whole else logits[index]
    torch.where(allowed, sub, neg_inf, out=sub)
    stuck = sub.amax(dim=-1, keepdim=True) == float("-inf")
    torch.where(stuck & allowed, zero, sub, out=sub)
    if not whole:
        logits[index] = sub
    return logits
