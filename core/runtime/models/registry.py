"""The model registry: for each supported HF architecture, the class that implements it and what the
loader (core.runtime.models.loader) and tensor parallelism (core.runtime.models.parallel) must know of its modules: how
checkpoint weights map onto its parameters, which parameters share storage, and how each layer splits
across ranks. Those two read only this description, never a model's attribute names.

Adding a family: write its model (forward(fb) -> hidden states, compute_logits(hidden)), describe it
with a ModelSpec, and list its architecture names in MODELS (and in core.runtime.models.config).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from torch import nn

from radixlm.core.errors import UnsupportedModelError
from radixlm.core.runtime.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from radixlm.core.runtime.models.llama import LlamaForCausalLM
from radixlm.core.runtime.models.llava import LlavaForConditionalGeneration
from radixlm.core.runtime.models.qwen2_vl import Qwen2VLForConditionalGeneration

# A dimension tensor parallelism splits across ranks: the query heads, the KV heads (each head_dim rows)
# or the MLP's intermediate features. core.runtime.models.parallel knows each rank's share of each.
Unit = Literal["q_heads", "kv_heads", "intermediate"]


@dataclass(frozen=True)
class ColumnParallel:
    """A linear layer whose output rows split across ranks: one block per checkpoint matrix fused into
    it (q|k|v), each of its unit; no communication."""

    blocks: tuple[Unit, ...]


@dataclass(frozen=True)
class RowParallel:
    """A bias-free linear layer whose input columns (of `unit`) split across ranks; an all-reduce sums
    the partial outputs."""

    unit: Unit


@dataclass(frozen=True)
class VocabParallel:
    """An embedding ("embedding") or LM head ("lm_head") whose vocabulary rows split across ranks."""

    kind: Literal["embedding", "lm_head"]


@dataclass(frozen=True)
class ModelSpec:
    model_class: type[nn.Module]  # built as model_class(cfg, ops)
    checkpoint_prefix: str = ""  # dropped from checkpoint weight names
    # (checkpoint prefix, ours): the first that a weight name starts with is replaced (after the above)
    renames: tuple[tuple[str, str], ...] = ()
    unfused: tuple[str, ...] = ()  # weights under these prefixes (of ours) are never fused
    ignored_weights: tuple[str, ...] = ()  # checkpoint names holding these are not weights of ours
    # checkpoint module name (last part) -> (our fused module, block index within it)
    fused: dict[str, tuple[str, int]] = field(default_factory=dict)
    # with tie_word_embeddings: parameter -> the parameter whose storage it shares
    tied: dict[str, str] = field(default_factory=dict)
    # module name (last part) -> how tensor parallelism splits it; modules not named are replicated
    parallel: dict[str, ColumnParallel | RowParallel | VocabParallel] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for ours, block in self.fused.values():
            style = self.parallel.get(ours)
            if not isinstance(style, ColumnParallel) or block >= len(style.blocks):
                raise ValueError(f"fused module {ours!r} needs a ColumnParallel plan with block {block}")

    def parameter_for(self, checkpoint_name: str) -> tuple[str, int | None] | None:
        """(our parameter, block within a fused one or None) for a checkpoint weight; None to skip it."""
        name = checkpoint_name.removeprefix(self.checkpoint_prefix)
        if any(ignored in name for ignored in self.ignored_weights):
            return None
        old, new = next(((o, n) for o, n in self.renames if name.startswith(o)), ("", ""))
        name = new + name[len(old):]
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in self.fused and not name.startswith(self.unfused):
            ours, block = self.fused[parts[-2]]
            return ".".join([*parts[:-2], ours, parts[-1]]), block
        return name, None

    def fused_blocks(self, param_name: str) -> tuple[Unit, ...] | None:
        """The units of a fused parameter's blocks, in order (None when it is not fused)."""
        module = param_name.rpartition(".")[0].rpartition(".")[2]
        if module not in {ours for ours, _ in self.fused.values()}:
            return None
        return self.parallel[module].blocks

    def block_rows(self, param_name: str, block: int, cfg: ModelConfig) -> slice:
        """The rows of a fused parameter (of the full model described by cfg) that hold one block."""
        sizes = [unit_size(cfg, unit) for unit in self.fused_blocks(param_name)]
        start = sum(sizes[:block])
        return slice(start, start + sizes[block])


def unit_size(cfg: ModelConfig, unit: Unit) -> int:
    """The size of a unit in the full (unsplit) model."""
    return {"q_heads": cfg.num_heads * cfg.head_dim, "kv_heads": cfg.num_kv_heads * cfg.head_dim,
            "intermediate": cfg.intermediate_size}[unit]


# The Llama family (Llama 2/3, Mistral, Qwen2): HF names q/k/v_proj and gate/up_proj are fused into
# qkv_proj and gate_up_proj at load time.
LLAMA = ModelSpec(
    model_class=LlamaForCausalLM,
    checkpoint_prefix="model.",
    ignored_weights=("rotary_emb.inv_freq",),
    fused={"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)},
    tied={"lm_head.weight": "embed_tokens.weight"},
    parallel={
        "qkv_proj": ColumnParallel(("q_heads", "kv_heads", "kv_heads")),
        "o_proj": RowParallel("q_heads"),
        "gate_up_proj": ColumnParallel(("intermediate", "intermediate")),
        "down_proj": RowParallel("intermediate"),
        "embed_tokens": VocabParallel("embedding"),
        "lm_head": VocabParallel("lm_head"),
    },
)

# LLaVA: our model is the language model with the vision tower and projector beside it. Checkpoints
# name the language model language_model.model.* (transformers' save format, the Hub's llava-hf ones)
# or model.language_model.*, and the tower vision_tower.vision_model.* or vision_tower.*.
LLAVA = dataclasses.replace(
    LLAMA,
    model_class=LlavaForConditionalGeneration,
    checkpoint_prefix="",
    ignored_weights=("rotary_emb.inv_freq", "position_ids"),
    renames=(("model.language_model.", ""), ("language_model.model.", ""), ("language_model.lm_head.", "lm_head."),
             ("model.vision_tower.vision_model.", "vision_tower."), ("model.vision_tower.", "vision_tower."),
             ("vision_tower.vision_model.", "vision_tower."),
             ("model.multi_modal_projector.", "multi_modal_projector.")),
    unfused=("vision_tower.", "multi_modal_projector."),
)

# Qwen2-VL: the Qwen2 language model with the vision tower beside it. transformers 5 saves
# model.language_model.* and model.visual.*, transformers 4 model.* and visual.*.
QWEN2_VL = dataclasses.replace(
    LLAMA,
    model_class=Qwen2VLForConditionalGeneration,
    checkpoint_prefix="",
    renames=(("model.language_model.", ""), ("model.visual.", "visual."), ("model.", "")),
    unfused=("visual.",),
)

# HF architecture name -> its model. One implementation serves every Llama family, the vision models extend it.
MODELS: dict[str, ModelSpec] = {**{arch: LLAMA for arch in SUPPORTED_ARCHITECTURES},
                                "LlavaForConditionalGeneration": LLAVA,
                                "Qwen2VLForConditionalGeneration": QWEN2_VL}


def model_spec(architecture: str) -> ModelSpec:
    try:
        return MODELS[architecture]
    except KeyError:
        raise UnsupportedModelError(
            f"architecture {architecture!r} is not supported; supported: {sorted(MODELS)}") from None
