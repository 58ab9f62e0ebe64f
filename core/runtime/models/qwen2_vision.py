"""The Qwen2-VL image encoder: a ViT over variable-size images (dynamic resolution).

The image processor cuts each image (or video) into patches of temporal_patch_size frames x
patch_size x patch_size pixels, ordered so that each 2x2 block of neighbouring patches (spatial_merge_size)
is contiguous; grid_thw says how many patches each has along t, h and w. The tower embeds the patches
(a Conv3d that is one matmul per patch), runs pre-norm blocks whose attention spans one frame of one
image and whose q/k carry a 2-D rotary embedding of the patch's (row, column), then the merger maps
each 2x2 block of patches to one language-model input row.
Parameter names follow transformers' Qwen2VisionTransformerPretrainedModel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.core.runtime.models.clip_vision import ACTIVATIONS
from radixlm.core.runtime.models.qwen2_vl_config import Qwen2VisionConfig


class PatchEmbed(nn.Module):
    def __init__(self, cfg: Qwen2VisionConfig) -> None:
        super().__init__()
        self.kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.in_channels = cfg.in_channels
        self.proj = nn.Conv3d(cfg.in_channels, cfg.embed_dim, kernel_size=self.kernel, stride=self.kernel, bias=False)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        x = patches.view(-1, self.in_channels, *self.kernel).to(self.proj.weight.dtype)
        return self.proj(x).flatten(1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary on x [N, heads, D] with cos/sin [N, 1, D], in fp32 as transformers does."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return (x.float() * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, cfg: Qwen2VisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.embed_dim, 3 * cfg.embed_dim)
        self.proj = nn.Linear(cfg.embed_dim, cfg.embed_dim)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                frames: list[torch.Tensor]) -> torch.Tensor:
        n, d = x.shape
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)
        q, k = _rotate(q, *rope), _rotate(k, *rope)
        out = torch.empty_like(q)
        for rows in frames:  # [frames, length]: the rows of same-size frames, attended as one batch
            def heads(t: torch.Tensor) -> torch.Tensor:
                return t[rows].transpose(1, 2)  # [frames, heads, length, head_dim]

            out[rows] = F.scaled_dot_product_attention(heads(q), heads(k), heads(v)).transpose(1, 2)
        return self.proj(out.reshape(n, d))


class VisionMlp(nn.Module):
    def __init__(self, cfg: Qwen2VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.embed_dim, cfg.embed_dim * cfg.mlp_ratio)
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.fc2 = nn.Linear(cfg.embed_dim * cfg.mlp_ratio, cfg.embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, cfg: Qwen2VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.embed_dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.embed_dim, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMlp(cfg)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                frames: list[torch.Tensor]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, frames)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each spatial_merge_size**2 neighbouring patches (contiguous rows) -> one language-model row."""

    def __init__(self, cfg: Qwen2VisionConfig) -> None:
        super().__init__()
        self.width = cfg.embed_dim * cfg.spatial_merge_size**2
        self.ln_q = nn.LayerNorm(cfg.embed_dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, cfg.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class Qwen2VisionTransformer(nn.Module):
    def __init__(self, cfg: Qwen2VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)

    def forward(self, patches: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        """patches [sum of t*h*w, channels*temporal*patch*patch] of several images in order -> their
        language-model inputs [sum of t*h*w / merge**2, out_hidden]."""
        x = self.patch_embed(patches)
        rope = self._rope(grid_thw, x.device)
        frames = _frames_by_size(grid_thw, x.device)
        for block in self.blocks:
            x = block(x, rope, frames)
        return self.merger(x)

    def _rope(self, grid_thw: list[tuple[int, int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [patches, 1, head_dim] of each patch's (row, column), in the processor's patch order
        (merge blocks contiguous)."""
        m = self.cfg.spatial_merge_size
        rows = []
        for t, h, w in grid_thw:
            hh, ww = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
            blocks = (h // m, m, w // m, m)
            hw = torch.stack([hh.reshape(blocks).transpose(1, 2).flatten(), ww.reshape(blocks).transpose(1, 2).flatten()], -1)
            rows.append(hw.repeat(t, 1))
        spatial = self.cfg.embed_dim // self.cfg.num_heads // 2  # half the head dim rotates by row, half by column
        inv_freq = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, spatial, 2, device=device).float() / spatial))
        freqs = (torch.cat(rows)[..., None].float() * inv_freq).flatten(1)  # [N, spatial]: rows', then columns'

        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
        return emb.cos(), emb.sin()


def _frames_by_size(grid_thw: list[tuple[int, int, int]], device: torch.device) -> list[torch.Tensor]:
    """Attention spans one frame of one image: for each frame size, the rows [frames, h * w] of the
    frames of that size (images of one size, a video's frames, attend in one batched call)."""
    starts: dict[int, list[int]] = {}
    row = 0
    for t, h, w in grid_thw:
        for _ in range(t):
            starts.setdefault(h * w, []).append(row)
            row += h * w
    return [(torch.tensor(first, device=device)[:, None] + torch.arange(length, device=device)).to(torch.int64)
            for length, first in starts.items()]
