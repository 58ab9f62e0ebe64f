"""LLaVA-1.5: a CLIP ViT image encoder, a two-layer MLP projector and a Llama-family language model.

A prompt holds one placeholder position per image feature row. In an extend step the model encodes the
step's images (one batched pass of the tower) and uses their projected features as the input embeddings
of those positions; every other position, and every decode step, is the plain language model.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from radixlm.core.runtime.layers.forward_batch import ImageBatch
from radixlm.core.runtime.models.clip_vision import ACTIVATIONS, VisionTransformer
from radixlm.core.runtime.models.config import ModelConfig, VisionConfig
from radixlm.core.runtime.models.llama import LlamaForCausalLM


class MultiModalProjector(nn.Module):
    def __init__(self, vision: VisionConfig, text_hidden: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(vision.hidden_size, text_hidden, bias=vision.projector_bias)
        self.act = ACTIVATIONS[vision.projector_act]
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=vision.projector_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, ops: ModuleType) -> None:
        super().__init__(cfg, ops)
        self.vision_tower = VisionTransformer(cfg.vision)
        self.multi_modal_projector = MultiModalProjector(cfg.vision, cfg.hidden_size)

    def image_features(self, images: ImageBatch) -> torch.Tensor:
        """The step's images (preprocessed, batched) as language-model inputs: one row per image position."""
        vision = self.config.vision
        dtype = self.vision_tower.pre_layrnorm.weight.dtype
        hidden = self.vision_tower.hidden_state(images.pixel_values.to(dtype), vision.feature_layer)
        if vision.select_strategy == "default":
            hidden = hidden[:, 1:]  # the class token is not an image token
        return self.multi_modal_projector(hidden).flatten(0, 1)
