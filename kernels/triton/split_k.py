"""Split-K for the decode GEMVs: a product's K split over SPLIT programs (grid axis 1) per block of output
features, so that a small N still puts enough programs, and so bytes in flight, on every SM. Each program
stores its fp32 partial [BLOCK_M, BLOCK_N] in its own slot and counts itself in; the last of a block's
programs to arrive adds the SPLIT partials in slot order (the same sum whichever arrives last: outputs are
deterministic) and runs the block's epilogue, so the fused epilogues stay one launch and exact up to the
fp32 sum's order. The last program puts the count back to zero, so that a CUDA graph replays the launch
as it was captured."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Counters a launch may use (one per block of output features): the LM head's 128,256 rows at 2 a program.
MAX_BLOCKS = 1 << 16
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def split_buffers(m: int, n: int, split: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The partials [split, m, n] fp32 of one launch and the device's counters (zero between launches).
    The counters are the device's own: split launches on one device must not run on two streams at once
    (decode steps never do). Allocated at a launch's first eager run, so never inside a graph capture
    (cuda_graph_runner warms each graph up first)."""
    counters = _COUNTERS.get(device)
    if counters is None:
        counters = _COUNTERS[device] = torch.zeros(MAX_BLOCKS, dtype=torch.int32, device=device)
    return torch.empty((split, m, n), dtype=torch.float32, device=device), counters


def slice_len(k: int, block_k: int, split: int) -> int:
    """Columns of K a program of a SPLIT-way product walks: a whole number of steps (so that only the last
    slice may end inside a step)."""
    return triton.cdiv(triton.cdiv(k, block_k), split) * block_k


@triton.jit
def split_sum(out, Partials, Counters, block, offs_m, offs_n, mn_mask, m, n, SPLIT: tl.constexpr):
    """This program's partial `out` stored and counted; returns (the sum of the block's SPLIT partials,
    whether this program arrived last): only the last one's sum is complete, and only it goes on."""
    slot = Partials + offs_m[:, None] * n + offs_n[None, :]
    tl.store(slot + tl.program_id(1) * m * n, out, mask=mn_mask)
    # Every lane's partial is written before the count says so (a barrier, then one lane's release);
    # the count's acquire orders the last program's reads of the others' partials after their writes.
    tl.debug_barrier()
    last = tl.atomic_add(Counters + block, 1, sem="acq_rel") == SPLIT - 1
    total = tl.zeros_like(out)
    if last:
        for s in tl.static_range(SPLIT):  # from L2 (.cg): the partials of other SMs
            total += tl.load(slot + s * m * n, mask=mn_mask, other=0.0, cache_modifier=".cg")
        tl.store(Counters + block, 0)
    return total, last
