"""Qwen2-VL: the Qwen2 language model fed by a dynamic-resolution ViT (core.runtime.models.qwen2_vision).

As for LLaVA, an extend step over image (or video) positions encodes the step's images in one pass of
the tower and uses their merged features as those positions' input embeddings. The language model
differs from Qwen2 only in its rotary positions (M-RoPE, three components per token), which the engine
computes per request and hands over as the step's cos/sin table (core.runtime.layers.mrope): the layers here
are the Llama family's.
"""

from __future__ import annotations

from types import ModuleType

import torch

from radixlm.core.runtime.layers.forward_batch import ImageBatch
from radixlm.core.runtime.models.config import ModelConfig
from radixlm.core.runtime.models.llama import LlamaForCausalLM
from radixlm.core.runtime.models.qwen2_vision import Qwen2VisionTransformer


class Qwen2VLForConditionalGeneration(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, ops: ModuleType) -> None:
        super().__init__(cfg, ops)
        self.visual = Qwen2VisionTransformer(cfg.vision)

    def image_features(self, images: ImageBatch) -> torch.Tensor:
        """The step's images and video frames, merged patches as language-model inputs."""
        return self.visual(images.pixel_values, images.grid_thw)
