"""M-RoPE (Qwen2-VL): each token has three rotary positions (temporal, height, width), and each rotary
frequency takes its angle from one of them: the first mrope_section[0] frequencies from t, the next
mrope_section[1] from h, the rest from w. Text tokens have t = h = w, which is plain 1-D rotary.

Rather than teach every rotary kernel 3-D positions, a step with M-RoPE positions builds one [cos | sin]
row per token here and hands the kernels that table with positions 0..T-1: the kernels (Triton fused
rotary + KV store on CUDA, torch on CPU) run unchanged.
"""

from __future__ import annotations

import numpy as np
import torch


def mrope_cos_sin(cache: torch.Tensor, positions: torch.Tensor, section: tuple[int, ...]) -> torch.Tensor:
    """[T, head_dim] rows of [cos | sin] for positions [3, T] (t, h, w), from the 1-D cache
    [context, head_dim] of [cos | sin] per position."""
    half = cache.shape[1] // 2
    component = torch.repeat_interleave(torch.arange(len(section), device=cache.device),
                                        torch.tensor(section, device=cache.device))  # [half]: which of t/h/w
    per_component = cache[positions]  # [3, T, head_dim]
    index = torch.cat((component, component)).view(1, 1, 2 * half).expand(1, positions.shape[1], 2 * half)
    return per_component.gather(0, index).squeeze(0)


def mrope_positions(length: int, spans: list[tuple[int, int, tuple[int, int, int]]]) -> tuple[np.ndarray, int]:
    """The rotary positions [3, length] of a prompt whose vision spans are (offset, count, (t, h, w) in
    merged units, count = t*h*w), as transformers' Qwen2-VL get_rope_index computes them: text counts on
    by one on all three; a span's tokens take (start + frame, start + row, start + column) and text after
    it resumes at start + max(h, w). Returns them and the delta of later positions (max + 1 - length)."""
    out = np.empty((3, length), dtype=np.int64)
    index = position = 0
    for offset, count, (t, h, w) in sorted(spans):
        out[:, index:offset] = position + np.arange(offset - index)
        position += offset - index
        grid = np.stack(np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")).reshape(3, -1)
        out[:, offset:offset + count] = position + grid
        position += max(h, w)
        index = offset + count
    out[:, index:] = position + np.arange(length - index)
    return out, int(out.max(initial=-1)) + 1 - length
