"""The tensors one model forward needs, built by the model runner from a scheduled batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


class KVBuffers(Protocol):
    """What attention reads of the engine's KV pool (core.runtime.memory.memory_pool.KVPool): one K and one V
    buffer per layer, indexed by KV slot."""

    k_buffers: list[torch.Tensor]
    v_buffers: list[torch.Tensor]


class Attention(Protocol):
    """Applies the rotary embedding to a layer's new q and k, stores k and v into their pool slots and
    attends (core.runtime.layers.attention_backend)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                fb: "ForwardBatch") -> torch.Tensor: ...


@dataclass
class ImageBatch:
    """The images of an extend step and the new tokens that take their features instead of token
    embeddings: token_index[k] gets row feature_index[k] of the images' features, all images' rows in
    one sequence (image after image)."""

    # LLaVA: [images, channels, height, width]; Qwen2-VL: [patches of all images, patch values]
    pixel_values: torch.Tensor
    token_index: torch.Tensor  # [K] indices into the step's new tokens
    feature_index: torch.Tensor  # [K]
    grid_thw: list[tuple[int, int, int]] | None = None  # Qwen2-VL: each image's patch grid


@dataclass
class ForwardBatch:
    is_decode: bool
    input_ids: torch.Tensor  # [T] new tokens, request after request
    positions: torch.Tensor  # [T]
    out_cache_loc: torch.Tensor  # [T] KV slot of each new token
    req_pool_indices: torch.Tensor  # [B] request-to-token rows
    seq_lens: torch.Tensor  # [B] total length after this step
    extend_lens: torch.Tensor  # [B] new tokens per request (all 1 when decoding)
    req_to_token: torch.Tensor
    kv_pool: KVBuffers
    attn_backend: Attention
    cos_sin_cache: torch.Tensor
    # Extend only, when known on the host: offsets of each request's first new token, and the
    # longest extend (kernels that size their grid by it then need no device sync).
    extend_start_loc: torch.Tensor | None = None
    max_extend_len: int | None = None
    # The attention kernels' layout of this batch, where their set plans one (kernels.cpu): made by the
    # attention backend at the first layer, reused by the others.
    attn_plan: Any = None
    images: ImageBatch | None = None  # extend steps over image positions (vision-language models)
    # M-RoPE steps (core.runtime.layers.mrope): the rotary uses these indices into cos_sin_cache (then a table
    # of one row per token) instead of `positions`, which stay the KV table's positions.
    rope_positions: torch.Tensor | None = None
    features: torch.Tensor | None = None  # [T, width]: BatchInput.features (an EAGLE head's input)
    # Extends of draft trees: each new token's ancestor bits (kernels.reference.extend_attention's tree_mask).
    tree_mask: torch.Tensor | None = None

    @property
    def rotary_positions(self) -> torch.Tensor:
        """The rows of cos_sin_cache the rotary reads, token by token."""
        return self.positions if self.rope_positions is None else self.rope_positions
