"""What radixlm reads of a Qwen2-VL checkpoint's config.json: the vision tower and how images and videos
enter the token sequence; its language model is Qwen2 with M-RoPE (3-component rotary positions)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixlm.core.errors import UnsupportedModelError


@dataclass(frozen=True)
class Qwen2VisionConfig:
    """transformers' Qwen2VLVisionConfig fields, plus the placeholder tokens of Qwen2VLConfig."""

    depth: int
    embed_dim: int
    num_heads: int
    mlp_ratio: int
    hidden_act: str
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int  # the language model's hidden size: what the merger outputs
    rope_theta: float
    image_token_id: int  # <|image_pad|>: one per image in a prompt, widened to its feature rows
    video_token_id: int  # <|video_pad|>
    vision_start_token_id: int
    vision_end_token_id: int

    tokens_per_image = None  # dynamic resolution: the image processor decides each image's grid

    @classmethod
    def from_dict(cls, full: dict[str, Any]) -> "Qwen2VisionConfig":
        v = full["vision_config"]
        return cls(
            depth=v["depth"], embed_dim=v["embed_dim"], num_heads=v["num_heads"], mlp_ratio=int(v["mlp_ratio"]),
            hidden_act=v.get("hidden_act", "quick_gelu"), in_channels=v.get("in_channels", 3),
            patch_size=v["patch_size"], temporal_patch_size=v["temporal_patch_size"],
            spatial_merge_size=v["spatial_merge_size"], out_hidden_size=v["hidden_size"],
            rope_theta=float((v.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            image_token_id=full["image_token_id"], video_token_id=full["video_token_id"],
            vision_start_token_id=full["vision_start_token_id"], vision_end_token_id=full["vision_end_token_id"],
        )


def qwen2_vl_parts(cfg: dict[str, Any]) -> tuple[dict[str, Any], Qwen2VisionConfig, tuple[int, ...]]:
    """A Qwen2-VL config.json (transformers 4's flat layout or 5's text_config), normalised by
    transformers' Qwen2VLConfig: its Qwen2 language model's config (a plain Qwen2 config.json), the
    vision side and the M-RoPE sections."""
    from transformers import Qwen2VLConfig  # only where a Qwen2-VL checkpoint is read

    full = Qwen2VLConfig.from_dict(cfg).to_dict()
    text = dict(full["text_config"])
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    section = rope.get("mrope_section")
    if not section or rope.get("rope_type", rope.get("type", "default")) not in ("default", "mrope"):
        raise UnsupportedModelError(f"Qwen2-VL rope parameters {rope!r} are not supported (M-RoPE with sections)")
    theta = rope.get("rope_theta") or text.get("rope_theta") or 1000000.0
    # transformers 5 keeps tie_word_embeddings on the outer config (Qwen2-VL-2B ties them)
    tied = full.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    text.update(architectures=["Qwen2ForCausalLM"], rope_parameters={"rope_theta": theta}, rope_scaling=None,
                rope_theta=theta, tie_word_embeddings=tied)
    return text, Qwen2VisionConfig.from_dict(full), tuple(section)
