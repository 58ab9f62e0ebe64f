"""What radixlm needs from a checkpoint's config.json, checked against what it supports."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from radixlm.core.errors import UnsupportedModelError
from radixlm.core.runtime.models.hub import find_gguf
from radixlm.core.runtime.models.qwen2_vl_config import qwen2_vl_parts

# HF architecture name -> model family. All three share one implementation (core.runtime.models.llama).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
MODEL_TYPES = {family: arch for arch, family in SUPPORTED_ARCHITECTURES.items()}
# Vision-language architectures: a Llama-family language model (its `text_config`) fed image features.
VISION_ARCHITECTURES = {"LlavaForConditionalGeneration": "llava", "Qwen2VLForConditionalGeneration": "qwen2_vl"}

# transformers' config-class defaults for the fields a config.json may leave out (tested against the
# classes themselves). Qwen2 ignores `sliding_window` unless `use_sliding_window`; Mistral always uses it.
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "tie_word_embeddings": False},
    "mistral": {"rms_norm_eps": 1e-6, "max_position_embeddings": 4096 * 32, "tie_word_embeddings": False,
                "sliding_window": 4096},
    "qwen2": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "tie_word_embeddings": False,
              "use_sliding_window": False},
}


@dataclass(frozen=True)
class VisionConfig:
    """A LLaVA checkpoint's image side: the CLIP ViT tower, the projector and how features enter the
    token sequence (transformers' LlavaConfig and CLIPVisionConfig fields)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str
    projector_act: str
    projector_bias: bool
    feature_layer: int  # which hidden state of the tower feeds the projector (-2: the penultimate layer's)
    select_strategy: str  # "default" drops the class token, "full" keeps it
    image_token_id: int  # the placeholder token that stands for one image in a prompt

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def tokens_per_image(self) -> int:
        """Positions one image takes in the token sequence: one per feature row."""
        return self.num_patches + (1 if self.select_strategy == "full" else 0)

    @classmethod
    def from_llava(cls, cfg: dict[str, Any]) -> "VisionConfig":
        """From a LlavaConfig as a dict (nested configs filled with their class defaults)."""
        v = cfg["vision_config"]
        if v.get("model_type", "clip_vision_model") != "clip_vision_model":
            raise UnsupportedModelError(f"LLaVA vision tower {v.get('model_type')!r} is not supported (CLIP only)")
        layer = cfg.get("vision_feature_layer", -2)
        if not isinstance(layer, int):
            raise UnsupportedModelError("LLaVA with several vision feature layers is not supported")
        strategy = cfg.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise UnsupportedModelError(f"vision_feature_select_strategy {strategy!r} is not supported")
        image_token = cfg.get("image_token_index", cfg.get("image_token_id"))
        return cls(
            hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
            num_layers=v["num_hidden_layers"], num_heads=v["num_attention_heads"], image_size=v["image_size"],
            patch_size=v["patch_size"], num_channels=v.get("num_channels", 3),
            layer_norm_eps=v.get("layer_norm_eps", 1e-5), hidden_act=v.get("hidden_act", "quick_gelu"),
            projector_act=cfg.get("projector_hidden_act", "gelu"),
            projector_bias=bool(cfg.get("multimodal_projector_bias", True)),
            feature_layer=layer, select_strategy=strategy, image_token_id=int(image_token),
        )


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    context_len: int
    bos_token_id: int | None
    eos_token_ids: list[int]
    # Set for vision-language checkpoints: VisionConfig (LLaVA) or Qwen2VisionConfig (Qwen2-VL).
    vision: Any = None
    # M-RoPE (Qwen2-VL): how many rotary frequencies (of head_dim / 2) follow each of the t, h and w
    # position components; None for 1-D rotary positions.
    mrope_section: tuple[int, ...] | None = None

    @classmethod
    def from_dir(cls, path: str) -> "ModelConfig":
        """The config of the checkpoint at path: an HF folder's config.json, or a GGUF file's metadata."""
        gguf_path = find_gguf(path)
        if gguf_path is not None:
            # Imported here: `gguf` only where a GGUF file is loaded.
            from radixlm.core.runtime.models.gguf_checkpoint import GGUFCheckpoint

            return cls(**GGUFCheckpoint(gguf_path).config_fields())
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        eos = _generation_eos(path)
        return cls.from_hf_dict(cfg, cfg.get("eos_token_id") if eos is None else eos)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], eos: int | list[int] | None) -> "ModelConfig":
        """Reads a config.json as transformers' own config classes do, written by transformers 4
        (top-level `rope_theta`, `rope_scaling`) or 5 (`rope_parameters` holding both), with the
        class defaults for what a file leaves out."""
        # Configs saved without `architectures` (a bare config.save_pretrained) name only the model type.
        arch = (cfg.get("architectures") or [MODEL_TYPES.get(cfg.get("model_type"), cfg.get("model_type"))])[0]
        if arch == "Qwen2VLForConditionalGeneration":
            return _qwen2_vl_config(arch, cfg, eos)
        if arch in VISION_ARCHITECTURES:
            return _llava_config(arch, cfg, eos)
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {arch!r} is not supported; supported: "
                f"{sorted([*SUPPORTED_ARCHITECTURES, *VISION_ARCHITECTURES])}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        cfg = {**FAMILY_DEFAULTS[family], **cfg}
        if cfg.get("hidden_act", "silu") != "silu" or cfg.get("mlp_bias"):
            raise UnsupportedModelError(
                f"only SiLU MLPs without bias are supported (hidden_act={cfg.get('hidden_act')!r}, "
                f"mlp_bias={cfg.get('mlp_bias')!r})"
            )
        num_heads = cfg["num_attention_heads"]
        max_pos = cfg["max_position_embeddings"]
        # A sliding window shorter than the context changes attention; cap the context to it so that
        # full attention stays exact instead of silently diverging from the checkpoint's behaviour.
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        rope_theta, rope_scaling = _rope(cfg)
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg["rms_norm_eps"],
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg["tie_word_embeddings"]),
            qkv_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
            context_len=min(max_pos, window) if window else max_pos,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
        )

    def layer_parameter_count(self) -> int:
        """Parameters of one decoder layer: attention (with the qkv bias where there is one), MLP, norms."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = q + 2 * kv if self.qkv_bias else 0
        return h * (q + 2 * kv) + bias + q * h + 3 * h * self.intermediate_size + 2 * h

    def parameter_count(self) -> int:
        """Parameters of the language model (a vision tower's left out): what its weights take in memory
        at one element each, before any quantization."""
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_layers * self.layer_parameter_count() + self.hidden_size

    def rope_cos_sin_cache(self, device: torch.device | str) -> torch.Tensor:
        """[context_len, head_dim] fp32 holding [cos | sin] of every position, with llama3/linear scaling
        or per-frequency divisors ("freq_factors")."""
        dim = self.head_dim
        inv_freq = 1.0 / (self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        positions = torch.arange(self.context_len, dtype=torch.float64)
        scaling = self.rope_scaling or {}
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "linear":
            positions = positions / scaling["factor"]
        elif kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif kind == "freq_factors":  # a GGUF's rope_freqs tensor: llama.cpp's precomputed llama3 scaling
            inv_freq = inv_freq / torch.tensor(scaling["factors"], dtype=torch.float64)
        freqs = torch.outer(positions, inv_freq)
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1).float().to(device)


def _llava_config(arch: str, cfg: dict[str, Any], eos: int | list[int] | None) -> ModelConfig:
    """A LLaVA config: its language model's config plus the vision side. Hub configs spell out only
    what differs from the nested classes' defaults, so transformers' LlavaConfig fills those in."""
    from transformers import LlavaConfig  # only where a LLaVA checkpoint is read

    full = LlavaConfig.from_dict(cfg).to_dict()
    text = dict(full["text_config"])
    text["architectures"] = [MODEL_TYPES.get(text.get("model_type"), text.get("model_type"))]
    if eos is None:
        eos = text.get("eos_token_id")
    base = ModelConfig.from_hf_dict(text, eos)
    return dataclasses.replace(base, architecture=arch, vision=VisionConfig.from_llava(full))


def _qwen2_vl_config(arch: str, cfg: dict[str, Any], eos: int | list[int] | None) -> ModelConfig:
    """A Qwen2-VL config: its Qwen2 language model's config, M-RoPE sections and the vision side."""
    text, vision, section = qwen2_vl_parts(cfg)
    base = ModelConfig.from_hf_dict(text, text.get("eos_token_id") if eos is None else eos)
    if 2 * sum(section) != base.head_dim:
        raise UnsupportedModelError(f"mrope_section {list(section)} does not cover head_dim {base.head_dim}")
    return dataclasses.replace(base, architecture=arch, vision=vision, mrope_section=section)


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope base, scaling or None). transformers 5 keeps both in `rope_parameters`; transformers 4
    has a top-level `rope_theta` and a `rope_scaling` dict (keyed `type` in older files)."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or params or None
    theta = params.get("rope_theta") or cfg.get("rope_theta") or 10000.0
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in ("default", "llama3", "linear"):
            raise UnsupportedModelError(f"rope scaling type {kind!r} is not supported (default, llama3, linear)")
        if kind == "default":
            scaling = None
    return float(theta), scaling


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths slowed by `factor`, short ones kept,
    a smooth blend in between."""
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_ctx = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    middle = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
    return torch.where(middle, blended, out)


def _generation_eos(path: str) -> int | list[int] | None:
    gen_path = os.path.join(path, "generation_config.json")
    if not os.path.exists(gen_path):
        return None
    with open(gen_path) as f:
        return json.load(f).get("eos_token_id")
