"""EAGLE draft heads (EAGLE-1/2, SafeAILab/EAGLE's published layout), on top of a Llama-family target.

The head predicts the target's next final hidden state: at position i it takes the target's final
(normed) hidden state h_i and the embedding of the token after it, x_{i+1}, maps their concatenation
(embedding first) to the hidden size with `fc` (2H -> H, bias optional), and runs one Llama decoder
layer over it, without that layer's input norm (the published checkpoints have none), attending over the
head's own KV of earlier positions. Its output f_i, through the target's LM head, guesses x_{i+2}; fed
back with that guess it drafts the next token, and so on (a chain). The token embedding and the LM head
are the target's.

Checkpoint: config.json as the EAGLE repository writes it (a Llama config with num_hidden_layers 1) and
model.safetensors or pytorch_model.bin holding fc.weight (+ fc.bias) and layers.0.{self_attn.{q,k,v,o}_proj,
mlp.{gate,up,down}_proj, post_attention_layernorm}.weight (q/k/v biases where the config has
attention_bias). An embed_tokens.weight beside them is the target's copy, ignored.
"""

from __future__ import annotations

import json
import os
from types import ModuleType

import torch
from torch import nn

from radixlm.core.errors import UnsupportedModelError
from radixlm.core.runtime.layers.forward_batch import ForwardBatch
from radixlm.core.runtime.models.config import ModelConfig
from radixlm.core.runtime.models.llama import DecoderLayer

# Tensors a published head may hold that are not the head's: the target's embedding, cached rotary tables.
_IGNORED = ("embed_tokens.weight", "rotary_emb.inv_freq")


class EagleHead(nn.Module):
    """The head over a target model (`target`: its embed_tokens and compute_logits serve the head). Set
    `features` (the [tokens, hidden] inputs h of the next forward, in the batch's token order) before each
    forward."""

    def __init__(self, cfg: ModelConfig, ops: ModuleType, target: nn.Module, fc_bias: bool) -> None:
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=fc_bias)
        self.layers = nn.ModuleList([DecoderLayer(cfg, 0, ops)])
        self.layers[0].input_layernorm = nn.Identity()
        object.__setattr__(self, "target", target)  # not a submodule: its weights are the target's
        self.features: torch.Tensor | None = None

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        embeds = self.target.embed_tokens(fb.input_ids)
        x = self.fc(torch.cat([embeds, self.features.to(embeds.dtype)], dim=-1))
        h, residual = self.layers[0](x, None, fb)
        return h + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden)


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    safetensors, binary = os.path.join(path, "model.safetensors"), os.path.join(path, "pytorch_model.bin")
    if os.path.exists(safetensors):
        from safetensors.torch import load_file

        return load_file(safetensors)
    if os.path.exists(binary):
        return torch.load(binary, map_location="cpu", weights_only=True)
    raise UnsupportedModelError(f"EAGLE head {path} has neither model.safetensors nor pytorch_model.bin")


def _expected_shapes(cfg: ModelConfig, fc_bias: bool) -> dict[str, tuple[int, ...]]:
    h, q, kv, i = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    shapes = {"fc.weight": (h, 2 * h), "layers.0.self_attn.q_proj.weight": (q, h),
              "layers.0.self_attn.k_proj.weight": (kv, h), "layers.0.self_attn.v_proj.weight": (kv, h),
              "layers.0.self_attn.o_proj.weight": (h, q), "layers.0.mlp.gate_proj.weight": (i, h),
              "layers.0.mlp.up_proj.weight": (i, h), "layers.0.mlp.down_proj.weight": (h, i),
              "layers.0.post_attention_layernorm.weight": (h,)}
    if fc_bias:
        shapes["fc.bias"] = (h,)
    if cfg.qkv_bias:
        shapes.update({"layers.0.self_attn.q_proj.bias": (q,), "layers.0.self_attn.k_proj.bias": (kv,),
                       "layers.0.self_attn.v_proj.bias": (kv,)})
    return shapes


def load_eagle_head(path: str, target: nn.Module, dtype: torch.dtype, device: torch.device,
                    ops: ModuleType) -> tuple[EagleHead, ModelConfig]:
    """The head at `path` over `target`; UnsupportedModelError naming the tensor when one is missing,
    unexpected or of the wrong shape, or when the head's hidden size is not the target's."""
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    cfg = ModelConfig.from_hf_dict({**raw, "architectures": ["LlamaForCausalLM"]}, raw.get("eos_token_id"))
    if cfg.num_layers != 1:
        raise UnsupportedModelError(f"EAGLE head {path}: num_hidden_layers is {cfg.num_layers}; heads of one "
                                    "layer (EAGLE-1/2) are built")
    if cfg.hidden_size != target.config.hidden_size:
        raise UnsupportedModelError(f"EAGLE head {path}: hidden_size {cfg.hidden_size} is not the target's "
                                    f"{target.config.hidden_size}")
    tensors = {k: v for k, v in _read_tensors(path).items() if not k.endswith(_IGNORED)}
    shapes = _expected_shapes(cfg, "fc.bias" in tensors)
    for name, shape in shapes.items():
        if name not in tensors:
            raise UnsupportedModelError(f"EAGLE head {path} lacks tensor {name!r}")
        if tuple(tensors[name].shape) != shape:
            raise UnsupportedModelError(f"EAGLE head {path}: tensor {name!r} has shape {tuple(tensors[name].shape)}, "
                                        f"expected {shape}")
    extra = sorted(set(tensors) - set(shapes))
    if extra:
        raise UnsupportedModelError(f"EAGLE head {path}: unexpected tensor {extra[0]!r}")
    with torch.device("meta"):  # no random init: every parameter comes from the file
        head = EagleHead(cfg, ops, target, "fc.bias" in tensors)
    layer = "layers.0."
    fused = {f"{layer}self_attn.qkv_proj.weight": [f"{layer}self_attn.{p}_proj.weight" for p in "qkv"],
             f"{layer}mlp.gate_up_proj.weight": [f"{layer}mlp.gate_proj.weight", f"{layer}mlp.up_proj.weight"]}
    if cfg.qkv_bias:
        fused[f"{layer}self_attn.qkv_proj.bias"] = [f"{layer}self_attn.{p}_proj.bias" for p in "qkv"]
    state = {name: torch.cat([tensors[p] for p in parts]) for name, parts in fused.items()}
    state.update({k: v for k, v in tensors.items() if not any(k in parts for parts in fused.values())})
    head.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in state.items()}, strict=True, assign=True)
    return head.eval(), cfg
