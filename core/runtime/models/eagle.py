"""EAGLE draft heads (SafeAILab/EAGLE's published layouts), on top of a Llama-family target.

EAGLE-1/2 (`EagleHead`): the head predicts the target's next final hidden state. At position i it takes
the target's final (normed) hidden state h_i and the embedding of the token after it, x_{i+1}, maps
their concatenation (embedding first) to the hidden size with `fc` (2H -> H, bias optional), and runs
one Llama decoder layer over it, without that layer's input norm (the published checkpoints have
none), attending over the head's own KV of earlier positions. Its output f_i, through the target's LM
head, guesses x_{i+2}; fed back in h's place with that guess it drafts the next token (a chain).
Files: fc.weight (+ fc.bias), layers.0.{self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj,
post_attention_layernorm}.weight (q/k/v biases where the config has attention_bias).

EAGLE-3 (`Eagle3Head`): the target's state at position i is its residual stream entering layers 2,
L // 2 and L - 3 (of L), concatenated; `fc` (3H -> H, no bias) maps it to the hidden size. The layer
(`midlayer`) normalises the embedding (input_layernorm) and the state (hidden_norm) apart and attends
over their concatenation (q/k/v of 2H inputs), with the state as the residual; the output, through
`norm` and the head's own `lm_head` over a draft vocabulary (`d2t[j]`: target id j + d2t[j]), guesses
the token; fed back un-normed (H wide, so `fc` is skipped) it drafts the next. Files: fc.weight,
midlayer.{self_attn.*, mlp.*, hidden_norm, input_layernorm, post_attention_layernorm}.weight, norm.weight,
lm_head.weight, d2t (t2d ignored); config.json with draft_vocab_size.

Both: config.json as the EAGLE repository writes it (a Llama config with num_hidden_layers 1),
model.safetensors or pytorch_model.bin; the token embedding is the target's (an embed_tokens.weight in
the file is ignored).
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
from radixlm.core.runtime.models.llama import MLP, Attention, DecoderLayer, RMSNorm

# Tensors a published head may hold that are not the head's: the target's embedding, cached rotary
# tables, EAGLE-3's target-to-draft vocabulary mask.
_IGNORED = ("embed_tokens.weight", "rotary_emb.inv_freq", "t2d")


class EagleHead(nn.Module):
    """The EAGLE-1/2 head over a target model (`target`: its embed_tokens and compute_logits serve the
    head). Each forward reads the batch's `features` ([tokens, hidden], in the token order): the target's
    final hidden states or the head's own outputs. `feature_width`: the features of a chain (decode) step,
    which the decode CUDA graphs hold a static buffer of."""

    def __init__(self, cfg: ModelConfig, ops: ModuleType, target: nn.Module, fc_bias: bool) -> None:
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=fc_bias)
        self.layers = nn.ModuleList([DecoderLayer(cfg, 0, ops)])
        self.layers[0].input_layernorm = nn.Identity()
        object.__setattr__(self, "target", target)  # not a submodule: its weights are the target's
        self.feature_width = cfg.hidden_size

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        embeds = self.target.embed_tokens(fb.input_ids)
        x = self.fc(torch.cat([embeds, fb.features.to(embeds.dtype)], dim=-1))
        h, residual = self.layers[0](x, None, fb)
        return h + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden)


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: ModuleType) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, 0)
        self.self_attn.qkv_proj = nn.Linear(2 * cfg.hidden_size, self.self_attn.q_size + 2 * self.self_attn.kv_size,
                                            bias=cfg.qkv_bias)
        self.mlp = MLP(cfg, ops)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)

    def forward(self, embeds: torch.Tensor, h: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        x = self.self_attn(torch.cat([self.input_layernorm(embeds), self.hidden_norm(h)], dim=-1), fb)
        x, residual = self.post_attention_layernorm(x, h)
        return self.mlp(x) + residual


class Eagle3Head(nn.Module):
    """The EAGLE-3 head over a target model (its embed_tokens serve the head); `features` as EagleHead's:
    the target's states (3 x its hidden size) or the head's own outputs (its hidden size: a chain step's,
    `feature_width`)."""

    def __init__(self, cfg: ModelConfig, ops: ModuleType, target: nn.Module, draft_vocab: int) -> None:
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(3 * target.config.hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(cfg, ops)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.lm_head = nn.Linear(cfg.hidden_size, draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.int64))
        object.__setattr__(self, "target", target)
        self.feature_width = cfg.hidden_size

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        embeds = self.target.embed_tokens(fb.input_ids)
        h = fb.features.to(embeds.dtype)
        if h.shape[-1] != self.config.hidden_size:
            h = self.fc(h)
        return self.midlayer(embeds, h, fb)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary: the draft vocabulary's at their target ids, -inf elsewhere."""
        draft = self.lm_head(self.norm(hidden)).float()
        full = draft.new_full((draft.shape[0], self.target.config.vocab_size), float("-inf"))
        full[:, torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t] = draft
        return full


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    safetensors, binary = os.path.join(path, "model.safetensors"), os.path.join(path, "pytorch_model.bin")
    if os.path.exists(safetensors):
        from safetensors.torch import load_file

        return load_file(safetensors)
    if os.path.exists(binary):
        return torch.load(binary, map_location="cpu", weights_only=True)
    raise UnsupportedModelError(f"EAGLE head {path} has neither model.safetensors nor pytorch_model.bin")


def _layer_shapes(cfg: ModelConfig, prefix: str, attn_in: int) -> dict[str, tuple[int, ...]]:
    h, q, kv, i = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    shapes = {f"{prefix}self_attn.q_proj.weight": (q, attn_in), f"{prefix}self_attn.k_proj.weight": (kv, attn_in),
              f"{prefix}self_attn.v_proj.weight": (kv, attn_in), f"{prefix}self_attn.o_proj.weight": (h, q),
              f"{prefix}mlp.gate_proj.weight": (i, h), f"{prefix}mlp.up_proj.weight": (i, h),
              f"{prefix}mlp.down_proj.weight": (h, i), f"{prefix}post_attention_layernorm.weight": (h,)}
    if cfg.qkv_bias:
        shapes.update({f"{prefix}self_attn.{p}_proj.bias": (n,) for p, n in (("q", q), ("k", kv), ("v", kv))})
    return shapes


def _expected_shapes(cfg: ModelConfig, version: int, tensors: dict[str, torch.Tensor],
                     target: ModelConfig, draft_vocab: int) -> dict[str, tuple[int, ...]]:
    h = cfg.hidden_size
    if version == 1:
        shapes = {"fc.weight": (h, 2 * h), **_layer_shapes(cfg, "layers.0.", h)}
        if "fc.bias" in tensors:
            shapes["fc.bias"] = (h,)
        return shapes
    shapes = {"fc.weight": (h, 3 * target.hidden_size), **_layer_shapes(cfg, "midlayer.", 2 * h),
              "midlayer.hidden_norm.weight": (h,), "midlayer.input_layernorm.weight": (h,), "norm.weight": (h,),
              "lm_head.weight": (draft_vocab, h)}
    if "d2t" in tensors or draft_vocab != target.vocab_size:
        shapes["d2t"] = (draft_vocab,)
    return shapes


def _checked(path: str, tensors: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]]) -> None:
    for name, shape in shapes.items():
        if name not in tensors:
            raise UnsupportedModelError(f"EAGLE head {path} lacks tensor {name!r}")
        if tuple(tensors[name].shape) != shape:
            raise UnsupportedModelError(f"EAGLE head {path}: tensor {name!r} has shape {tuple(tensors[name].shape)}, "
                                        f"expected {shape}")
    extra = sorted(set(tensors) - set(shapes))
    if extra:
        raise UnsupportedModelError(f"EAGLE head {path}: unexpected tensor {extra[0]!r}")


def _fused_state(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under our names: q/k/v and gate/up concatenated as the layers hold them."""
    fused = {f"{prefix}self_attn.qkv_proj.weight": [f"{prefix}self_attn.{p}_proj.weight" for p in "qkv"],
             f"{prefix}self_attn.qkv_proj.bias": [f"{prefix}self_attn.{p}_proj.bias" for p in "qkv"],
             f"{prefix}mlp.gate_up_proj.weight": [f"{prefix}mlp.gate_proj.weight", f"{prefix}mlp.up_proj.weight"]}
    state = {name: torch.cat([tensors[p] for p in parts]) for name, parts in fused.items() if parts[0] in tensors}
    parts = {p for ps in fused.values() for p in ps}
    state.update({k: v for k, v in tensors.items() if k not in parts})
    return state


def load_eagle_head(path: str, target: nn.Module, dtype: torch.dtype, device: torch.device, ops: ModuleType,
                    version: int = 1) -> tuple[nn.Module, ModelConfig]:
    """The head at `path` (`version` 1: EAGLE-1/2's layout, 3: EAGLE-3's) over `target`;
    UnsupportedModelError naming the tensor when one is missing, unexpected or of the wrong shape, or
    when the head does not fit the target."""
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    cfg = ModelConfig.from_hf_dict({**raw, "architectures": ["LlamaForCausalLM"]}, raw.get("eos_token_id"))
    target_cfg = target.config
    if cfg.num_layers != 1:
        raise UnsupportedModelError(f"EAGLE head {path}: num_hidden_layers is {cfg.num_layers}; heads of one "
                                    "layer are built")
    if version == 1 and cfg.hidden_size != target_cfg.hidden_size:
        raise UnsupportedModelError(f"EAGLE head {path}: hidden_size {cfg.hidden_size} is not the target's "
                                    f"{target_cfg.hidden_size}")
    draft_vocab = raw.get("draft_vocab_size") or target_cfg.vocab_size
    tensors = {k: v for k, v in _read_tensors(path).items() if not k.endswith(_IGNORED)}
    _checked(path, tensors, _expected_shapes(cfg, version, tensors, target_cfg, draft_vocab))
    with torch.device("meta"):  # no random init: every parameter comes from the file
        head = (EagleHead(cfg, ops, target, "fc.bias" in tensors) if version == 1
                else Eagle3Head(cfg, ops, target, draft_vocab))
    state = _fused_state(tensors, "layers.0." if version == 1 else "midlayer.")
    if version == 3:
        state.setdefault("d2t", torch.zeros(draft_vocab, dtype=torch.int64))
    head.load_state_dict({k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype)
                          for k, v in state.items()}, strict=True, assign=True)
    return head.eval(), cfg


def eagle3_aux_layers(num_layers: int) -> tuple[int, ...]:
    """The target layers whose input EAGLE-3 reads (as the EAGLE repository and SGLang pick them)."""
    layers = (2, num_layers // 2, num_layers - 3)
    if len(set(layers)) != 3 or min(layers) < 0 or max(layers) >= num_layers:
        raise UnsupportedModelError(f"EAGLE-3 needs a target of at least 7 layers (this one has {num_layers})")
    return layers
