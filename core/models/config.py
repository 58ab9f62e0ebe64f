"""What radixlm needs from a checkpoint's config.json, checked against what it supports."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from radixlm.core.errors import UnsupportedModelError
from radixlm.core.models.hub import find_gguf

# HF architecture name -> model family. All three share one implementation (core.models.llama).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
MODEL_TYPES = {family: arch for arch, family in SUPPORTED_ARCHITECTURES.items()}

# transformers' config-class defaults for the fields a config.json may leave out (tested against the
# classes themselves). Qwen2 ignores `sliding_window` unless `use_sliding_window`; Mistral always uses it.
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "tie_word_embeddings": False},
    "mistral": {"rms_norm_eps": 1e-6, "max_position_embeddings": 4096 * 32, "tie_word_embeddings": False,
                "sliding_window": 4096},
    "qwen2": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "tie_word_embeddings": False,
              "use_sliding_window": False},
}


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

    @classmethod
    def from_dir(cls, path: str) -> "ModelConfig":
        """The config of the checkpoint at path: an HF folder's config.json, or a GGUF file's metadata."""
        gguf_path = find_gguf(path)
        if gguf_path is not None:
            # Imported here: `gguf` only where a GGUF file is loaded.
            from radixlm.core.models.gguf_checkpoint import GGUFCheckpoint

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
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {arch!r} is not supported; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
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
