"""The CLIP ViT image encoder of LLaVA: patch embedding, class token and learned positions, then
pre-norm transformer layers with full (bidirectional) attention over one image's patches.

Images are independent and all the same size, so a batch is one [B, 3, H, W] tensor and attention is
torch's scaled_dot_product_attention over [B, heads, patches + 1, head_dim]: no KV cache, no paging.
Parameter names follow transformers' CLIPVisionTransformer (core.runtime.models.registry maps checkpoints' prefixes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.core.runtime.models.config import VisionConfig

ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class VisionEmbeddings(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.class_embedding = nn.Parameter(torch.empty(cfg.hidden_size))
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, kernel_size=cfg.patch_size,
                                         stride=cfg.patch_size, bias=False)
        self.num_positions = cfg.num_patches + 1
        self.position_embedding = nn.Embedding(self.num_positions, cfg.hidden_size,
                                               _weight=torch.empty(self.num_positions, cfg.hidden_size))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        patches = patches.flatten(2).transpose(1, 2)  # [B, patches, hidden]
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.out_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, n, self.num_heads, d // self.num_heads).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)))
        return self.out_proj(out.transpose(1, 2).reshape(b, n, d))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionLayer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = VisionAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(cfg) for _ in range(cfg.num_layers))


class VisionTransformer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.embeddings = VisionEmbeddings(cfg)
        self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)  # (sic) CLIP's name
        self.encoder = VisionEncoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)  # pooling only: unused

    def hidden_state(self, pixel_values: torch.Tensor, layer: int) -> torch.Tensor:
        """The hidden states [B, patches + 1, hidden] after `layer` encoder layers, counted as
        transformers' hidden_states tuple is (0 is the normed embeddings; negative counts from the end)."""
        count = layer % (len(self.encoder.layers) + 1)
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        for block in self.encoder.layers[:count]:  # later layers do not contribute: not run
            x = block(x)
        return x
