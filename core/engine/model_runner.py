"""Executes batches: owns the model, the KV pool and the request-to-token table. Decides nothing."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixlm import kernels
from radixlm.core.engine.attention_backend import AttentionBackend
from radixlm.core.engine.forward_batch import ForwardBatch
from radixlm.core.engine.memory_pool import KVPool, ReqToTokenPool
from radixlm.core.engine.options import EngineOptions
from radixlm.core.models.config import ModelConfig
from radixlm.core.models.loader import load_model

if TYPE_CHECKING:
    from radixlm.core.models.parallel import TensorParallel

logger = logging.getLogger("radixlm")


@dataclass
class BatchInput:
    """One step's work in host lists, as the scheduler hands it over."""

    is_decode: bool
    input_ids: list[int]
    positions: list[int]
    out_cache_loc: list[int]
    rows: list[int]
    seq_lens: list[int]
    extend_lens: list[int]
    logit_rows: list[int]  # which of the new tokens need logits (indices into input_ids)


class ModelRunner:
    def __init__(self, model_path: str, cfg: ModelConfig, opts: EngineOptions,
                 tp: "TensorParallel | None" = None) -> None:
        """With `tp` (core.models.parallel), cfg is tp.local_config() and this runner is one rank's."""
        self.cfg = cfg
        self.device = torch.device(opts.device)
        self.dtype = opts.torch_dtype
        self.ops = kernels.get_ops(self.device)
        self.model = load_model(model_path, cfg, self.dtype, self.device, self.ops, tp=tp)
        self.attn_backend = AttentionBackend(self.ops)
        self.cos_sin_cache = cfg.rope_cos_sin_cache(self.device)
        self.num_slots = self._kv_pool_size(opts)
        if tp is not None:  # every rank must index the same slots
            self.num_slots = tp.min_across_ranks(self.num_slots)
        self.kv_pool = KVPool(self.num_slots, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device)
        self.req_to_token = ReqToTokenPool(opts.max_running_requests + 1, cfg.context_len + 1, self.device)
        logger.info(
            "KV pool: %d token slots (%.1f MiB), %d request rows, context %d",
            self.num_slots,
            self.num_slots * self._kv_bytes_per_token() / 2**20,
            opts.max_running_requests + 1,
            cfg.context_len,
        )

    def _kv_bytes_per_token(self) -> int:
        c = self.cfg
        return KVPool.bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, self.dtype)

    def _kv_pool_size(self, opts: EngineOptions) -> int:
        if opts.max_total_tokens is not None:
            return opts.max_total_tokens
        per_token = self._kv_bytes_per_token()
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            # The static share (weights already loaded + KV) stays within the fraction; activations
            # and CUDA graphs live in the rest.
            budget = total * opts.mem_fraction_static - (total - free)
        else:
            budget = _host_available_bytes() * opts.mem_fraction_static * 0.25
        # On CPU there is no point holding more than every running request could use at once.
        ceiling = opts.max_running_requests * self.cfg.context_len
        return max(256, min(int(budget // per_token), ceiling))

    @torch.inference_mode()
    def forward(self, batch: BatchInput) -> torch.Tensor:
        """Runs one step; returns fp32 logits [len(batch.logit_rows), vocab]."""
        dev = self.device

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(dev, non_blocking=True)

        fb = ForwardBatch(
            is_decode=batch.is_decode,
            input_ids=tensor(batch.input_ids),
            positions=tensor(batch.positions),
            out_cache_loc=tensor(batch.out_cache_loc),
            req_pool_indices=tensor(batch.rows),
            seq_lens=tensor(batch.seq_lens),
            extend_lens=tensor(batch.extend_lens),
            req_to_token=self.req_to_token.table,
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
            cos_sin_cache=self.cos_sin_cache,
        )
        hidden = self.model(fb)
        if not batch.logit_rows:
            return hidden.new_empty((0, self.cfg.vocab_size), dtype=torch.float32)
        if len(batch.logit_rows) != hidden.shape[0]:
            hidden = hidden[tensor(batch.logit_rows)]
        return self.model.compute_logits(hidden)


def _host_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30
