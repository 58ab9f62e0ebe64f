"""Tensor parallelism: each rank holds its share of every layer (Megatron-style), as a model's entry in
core.runtime.models.registry plans it. For the Llama family:

- `qkv_proj` and `gate_up_proj` are column-parallel: a rank holds the output rows of its own attention
  heads (q, k and v alike) and its slice of the MLP's intermediate features, so attention and SiLU run
  on local data with no communication.
- `o_proj` and `down_proj` are row-parallel: a rank multiplies its slice of the input features and an
  all-reduce sums the partial outputs, so every rank holds the full hidden state again.
- `embed_tokens` and `lm_head` are vocab-parallel: rank r holds rows [r*s, (r+1)*s) of the vocabulary
  (s = ceil(vocab / tp), the last shard zero-padded). The embedding zeroes tokens outside its rows and
  all-reduces; the LM head computes its columns of the logits and all-gathers them, so every rank ends
  with the full logits.

Grouped-query attention: when tp divides num_kv_heads each rank holds num_kv_heads / tp KV heads; when
tp > num_kv_heads (tp a multiple of it) each rank holds the one KV head its query heads use, replicated
on tp / num_kv_heads ranks. Either way a rank's KV pool holds only its KV heads.

The model is first built from `local_config()` (this rank's head and feature counts, so attention and
the KV pool take local shapes as they are), then `shard_model` swaps in the layers below for those its
plan names, which know where their share lies in the checkpoint's full tensors (`weight_loader`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from radixlm.core.errors import UnsupportedModelError
from radixlm.core.runtime.models.config import ModelConfig
from radixlm.core.runtime.models.registry import ColumnParallel, ModelSpec, RowParallel, Unit, VocabParallel


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group.

    `group` carries the model's collectives (NCCL on CUDA, gloo on CPU; None means the default group);
    `cpu_group` (gloo) carries host-side control: the per-step broadcast and agreeing on sizes.
    """

    rank: int
    size: int
    cfg: ModelConfig  # the checkpoint's full configuration
    group: Any = None
    cpu_group: Any = None

    def __post_init__(self) -> None:
        c, tp = self.cfg, self.size
        if c.num_heads % tp or c.intermediate_size % tp:
            raise UnsupportedModelError(
                f"tp_size {tp} must divide num_attention_heads ({c.num_heads}) and intermediate_size "
                f"({c.intermediate_size})")
        if c.num_kv_heads % tp and tp % c.num_kv_heads:
            raise UnsupportedModelError(
                f"tp_size {tp} must divide num_key_value_heads ({c.num_kv_heads}) or be a multiple of it")

    # ---- this rank's share -------------------------------------------------------------------

    def kv_heads(self) -> tuple[int, int]:
        """(first KV head, count) held by this rank."""
        kv, tp = self.cfg.num_kv_heads, self.size
        if kv >= tp:
            return self.rank * (kv // tp), kv // tp
        return self.rank * kv // tp, 1  # replicated: the head this rank's query heads attend with

    def local_config(self) -> ModelConfig:
        c = self.cfg
        return dataclasses.replace(c, num_heads=c.num_heads // self.size, num_kv_heads=self.kv_heads()[1],
                                   intermediate_size=c.intermediate_size // self.size)

    def rows(self, unit: Unit) -> tuple[int, int]:
        """(first, count) of this rank's share of a unit (core.runtime.models.registry), in rows of the full model."""
        c, hd = self.cfg, self.cfg.head_dim
        if unit == "q_heads":
            n = c.num_heads // self.size
            return self.rank * n * hd, n * hd
        if unit == "kv_heads":
            first, n = self.kv_heads()
            return first * hd, n * hd
        n = c.intermediate_size // self.size
        return self.rank * n, n

    def shard_model(self, model: nn.Module, spec: ModelSpec) -> None:
        """Replaces the layers that spec.parallel names in a model built from local_config() by their
        parallel versions (call it on the meta device, before weights are allocated)."""
        for name, module in list(model.named_modules()):
            owner, _, attr = name.rpartition(".")
            style = spec.parallel.get(attr)
            if style is not None:
                setattr(model.get_submodule(owner), attr, self._parallel_layer(style, module))

    def _parallel_layer(self, style: ColumnParallel | RowParallel | VocabParallel, dense: nn.Module) -> nn.Module:
        if isinstance(style, ColumnParallel):
            return ColumnParallelLinear(dense.in_features, [self.rows(u) for u in style.blocks],
                                        bias=dense.bias is not None)
        if isinstance(style, RowParallel):
            return RowParallelLinear(*self.rows(style.unit), dense.out_features, self)
        vocab, hidden = dense.weight.shape
        layer = VocabParallelEmbedding if style.kind == "embedding" else ParallelLMHead
        return layer(vocab, hidden, self)

    @torch.no_grad()
    def load_weight(self, model: nn.Module, name: str, shard: int | None, w: torch.Tensor) -> None:
        """Copies this rank's share of checkpoint tensor `w` into parameter `name` (core.runtime.models.loader)."""
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        param = getattr(owner, attr)
        if hasattr(owner, "weight_loader"):
            owner.weight_loader(param, w, shard)
        else:  # replicated (norms): every rank holds the whole tensor
            param.copy_(w)

    # ---- collectives -------------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def min_across_ranks(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())


class ColumnParallelLinear(nn.Linear):
    """This rank's output rows of a (possibly fused) linear layer. `shards[i] = (first row, count)` of
    this rank's rows within fused block i of the checkpoint (q|k|v, or gate|up); the local weight holds
    the blocks' shares one after another. The output stays sharded: no communication."""

    def __init__(self, in_features: int, shards: list[tuple[int, int]], bias: bool) -> None:
        super().__init__(in_features, sum(n for _, n in shards), bias=bias)
        self.shards = shards

    def weight_loader(self, param: torch.Tensor, w: torch.Tensor, shard: int | None) -> None:
        first, n = self.shards[shard]
        dst = sum(count for _, count in self.shards[:shard])
        param[dst : dst + n].copy_(w[first : first + n])


class RowParallelLinear(nn.Linear):
    """This rank's input columns [first, first + n) of a bias-free linear layer; the partial products
    of all ranks are summed by an all-reduce."""

    def __init__(self, first: int, n: int, out_features: int, tp: TensorParallel) -> None:
        super().__init__(n, out_features, bias=False)
        self.first = first
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(F.linear(x, self.weight))

    def weight_loader(self, param: torch.Tensor, w: torch.Tensor, shard: int | None) -> None:
        # A 1-D tensor holds one value per output row (an fp8 checkpoint's scales): every rank holds all.
        param.copy_(w if w.dim() == 1 else w[:, self.first : self.first + param.shape[1]])


class _VocabShard(nn.Module):
    """Rows [rank * s, (rank + 1) * s) of a [vocab, hidden] matrix, s = ceil(vocab / tp); rows past the
    vocabulary (last shard) are zero."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.shard_size = math.ceil(vocab_size / tp.size)
        self.first = tp.rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size))
        self.tp = tp

    def weight_loader(self, param: torch.Tensor, w: torch.Tensor, shard: int | None) -> None:
        rows = w[self.first : self.first + self.shard_size]
        param.zero_()
        param[: rows.shape[0]].copy_(rows)


class VocabParallelEmbedding(_VocabShard):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.first
        outside = (local < 0) | (local >= self.shard_size)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0.0))


class ParallelLMHead(_VocabShard):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather_last_dim(F.linear(hidden, self.weight))
        return logits[..., : self.vocab_size]
