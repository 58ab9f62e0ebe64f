"""Decode as CUDA-graph replays: one graph per batch size of a ladder, all sharing one memory pool.

A decode step's shapes depend only on its batch size, and the Triton decode kernel's split count does
too (kernels.triton.attention.default_num_kv_splits), so a graph captured once for a size replays for
any sequence lengths. A batch runs on the smallest captured size that holds it; the padding rows
decode token 0 at position 0 into KV slot 0 (which the pool never hands out) through the table's
padding row, so they touch no real request's state. Each step's inputs reach the graphs' static
buffers in one non-blocking copy from pinned memory.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING

import torch

from radixlm.core.engine.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from radixlm.core.engine.model_runner import BatchInput, ModelRunner

logger = logging.getLogger("radixlm")

# Per-step input fields, in their order in the flat static buffer (each `bs` long for a graph of size bs).
_FIELDS = 5  # input_ids, positions, out_cache_loc, rows, seq_lens


def batch_size_ladder(max_bs: int) -> list[int]:
    """Sizes to capture: dense where small batches are common, coarser (at most ~12% padding) above."""
    sizes = [1, 2, 3, 4, *range(8, 64, 8), *range(64, 256, 16), *range(256, 1025, 32)]
    return [s for s in sizes if s < max_bs] + [max_bs]


class DecodeGraphRunner:
    """Replays captured decode forwards. With capture=False the same padded, static-buffer path runs
    eagerly (what the CPU tests exercise)."""

    def __init__(self, runner: "ModelRunner", max_bs: int, capture: bool = True) -> None:
        self.runner = runner
        self.sizes = batch_size_ladder(max_bs)
        self.max_bs = self.sizes[-1]
        self.capture = capture
        dev = runner.device
        self._pin = dev.type == "cuda"
        self._padding_row = runner.req_to_token.padding_row
        self.inputs = torch.zeros(_FIELDS * self.max_bs, dtype=torch.int64, device=dev)
        self.ones = torch.ones(self.max_bs, dtype=torch.int64, device=dev)
        self.logits = torch.zeros(self.max_bs, runner.cfg.vocab_size, dtype=torch.float32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if capture:
            self._capture_all()

    def _views(self, bs: int) -> list[torch.Tensor]:
        return list(self.inputs[: _FIELDS * bs].view(_FIELDS, bs).unbind(0))

    def _forward(self, bs: int) -> None:
        """The captured work: record the new slots, run the model, leave fp32 logits in self.logits."""
        ids, positions, loc, rows, seq_lens = self._views(bs)
        r = self.runner
        fb = ForwardBatch(
            is_decode=True, input_ids=ids, positions=positions, out_cache_loc=loc, req_pool_indices=rows,
            seq_lens=seq_lens, extend_lens=self.ones[:bs], req_to_token=r.req_to_token.table,
            kv_pool=r.kv_pool, attn_backend=r.attn_backend, cos_sin_cache=r.cos_sin_cache,
        )
        r.record_decode_slots(fb)
        self.logits[:bs].copy_(r.model.compute_logits(r.model(fb)))

    def _fill_padding(self, bs: int) -> None:
        ids, positions, loc, rows, seq_lens = self._views(bs)
        for t in (ids, positions, loc):
            t.zero_()
        rows.fill_(self._padding_row)
        seq_lens.fill_(1)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        # Largest first: the shared pool is sized by it and the smaller graphs reuse its blocks.
        for bs in reversed(self.sizes):
            self._fill_padding(bs)
            self._forward(bs)  # warm-up: Triton compiles and cuBLAS picks its kernels outside the capture
            torch.cuda.synchronize(self.runner.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(bs)
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.runner.device)
        logger.info("captured %d decode CUDA graphs (batch sizes 1..%d) in %.1f s", len(self.sizes), self.max_bs,
                    time.perf_counter() - start)

    def run(self, batch: "BatchInput") -> torch.Tensor:
        """Logits [n, vocab] of a decode batch of n <= max_bs rows (a view, valid until the next step)."""
        n = len(batch.rows)
        bs = self.sizes[bisect.bisect_left(self.sizes, n)]
        pad = bs - n
        zeros = [0] * pad
        host = torch.tensor(
            batch.input_ids + zeros + batch.positions + zeros + batch.out_cache_loc + zeros
            + batch.rows + [self._padding_row] * pad + batch.seq_lens + [1] * pad,
            dtype=torch.int64, pin_memory=self._pin,
        )
        self.inputs[: _FIELDS * bs].copy_(host, non_blocking=True)
        if self.capture:
            self.graphs[bs].replay()
        else:
            with torch.inference_mode():
                self._forward(bs)
        return self.logits[:n]
