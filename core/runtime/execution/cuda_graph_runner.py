"""CUDA-graph replays of decode steps and of small extend steps, all graphs sharing one memory pool.

Decode: a step's shapes depend only on its batch size, and the Triton decode kernel's split count does
too (kernels.triton.attention.default_num_kv_splits), so a graph captured once for a size replays for
any sequence lengths. A batch runs on the smallest captured size that holds it; the padding rows
decode token 0 at position 0 into KV slot 0 (which the pool never hands out) through the table's
padding row, so they touch no real request's state.

Extend: an eager forward of an 8B model costs ~25 ms of kernel launches on the host whatever its size,
while a few dozen tokens take ~5 ms on the GPU; short extends are what the radix cache leaves (the
uncached suffix of a prompt) and what jump-forward adds (forced text, with the running requests riding
along). Graphs are captured for (requests, tokens) buckets with the extend kernel's grid sized for the
bucket's token count (blocks past a request's new tokens exit at once). Padding requests have no new
tokens; padding tokens belong to no request and write KV slot 0. Logits are computed for each
request's last token only, so steps that want input logprobs run eagerly.

Verify steps (speculative decoding: each request's newest token and its draft, logits at every token)
replay the decode graphs: each token becomes a decode row of its own, at its position, whose sequence
ends with it (as_decode_rows). Each layer stores the step's keys and values before it attends, so row j
of a request sees the request's prefix and its first j new tokens: the extend's causal attention. The
rows of one request read the same keys, side by side (adjacent programs of the decode kernel), and the
decode graphs already give logits at every row; no second set of graphs, buckets or logits buffer.

A runner that exports hidden states (core.runtime.execution.hidden_export: an EAGLE target's, an EAGLE
head's) has its decode graphs copy them, every row's, into a static buffer (`hidden`) beside the logits;
a model that reads float inputs per token (an EAGLE head's `features`) gets them from a static buffer
too. Runners without either capture neither.

Each step's inputs reach the graphs' static buffers in one non-blocking copy from pinned memory.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch

from radixlm.core.runtime.execution.batch_input import BatchInput
from radixlm.core.runtime.execution.hidden_export import HiddenExport
from radixlm.core.runtime.layers.attention_backend import AttentionBackend
from radixlm.core.runtime.layers.forward_batch import ForwardBatch
from radixlm.core.runtime.memory.memory_pool import KVPool, ReqToTokenPool
from radixlm.core.runtime.models.config import ModelConfig

logger = logging.getLogger("radixlm")

# Per-step input fields, in their order in the flat static buffer (each `bs` long for a graph of size bs).
_FIELDS = 5  # input_ids, positions, out_cache_loc, rows, seq_lens
_TOKEN_FIELDS = 3  # extend: input_ids, positions, out_cache_loc (each T long) ...
_REQ_FIELDS = 5  # ... then rows, seq_lens, extend_lens, extend_start_loc, logit_index (each bs long)
_CAPTURE_LOCK = threading.Lock()  # one capture at a time per process (data-parallel workers start together)
EXTEND_TOKEN_BUCKETS = (16, 32, 48, 64, 80, 96, 128, 160, 192, 256, 320, 384, 512, 768, 1024)
# Extends with logits at every token run as decode rows (as_decode_rows) when no request has more new tokens
# than this: each row reads its request's whole context, so the rows of a long extend over a long prefix
# would read it that many times. 17 covers a verify step of 16 draft tokens.
DECODE_ROWS_MAX_EXTEND = 17


class GraphHost(Protocol):
    """What the graphs read of the model runner that builds them (model_runner.ModelRunner, which sits
    above this module)."""

    device: torch.device
    dtype: torch.dtype
    cfg: ModelConfig
    model: Any  # the model: forward(ForwardBatch) -> hidden states; compute_logits(hidden) -> logits
    export: HiddenExport | None  # the hidden states each step exports (copied into DecodeGraphRunner.hidden)
    kv_pool: KVPool
    req_to_token: ReqToTokenPool
    attn_backend: AttentionBackend
    cos_sin_cache: torch.Tensor

    def record_decode_slots(self, fb: ForwardBatch) -> None: ...


def batch_size_ladder(max_bs: int) -> list[int]:
    """Sizes to capture: dense where small batches are common, coarser (at most ~12% padding) above."""
    sizes = [1, 2, 3, 4, *range(8, 64, 8), *range(64, 256, 16), *range(256, 1025, 32)]
    return [s for s in sizes if s < max_bs] + [max_bs]


def extend_buckets(max_bs: int, max_tokens: int) -> list[tuple[int, int, int]]:
    """(requests, tokens, longest extend) shapes to capture for extends: requests in powers of two up
    to max_bs, tokens in EXTEND_TOKEN_BUCKETS up to max_tokens, never fewer tokens than requests. A
    batch lands in a bucket only with more requests than the next smaller request count, every one
    with at least one new token, which bounds its longest extend (the attention grid's extent)."""
    counts = sorted({min(1 << i, max_bs) for i in range(max_bs.bit_length() + 1)})
    tokens = [t for t in EXTEND_TOKEN_BUCKETS if t < max_tokens] + [max_tokens]
    return [(bs, t, t - smaller) for t in tokens for smaller, bs in zip([0, *counts], counts) if bs <= t]


def _capture(runner: "GraphHost", keys: Iterable, prepare: Callable, forward: Callable,
             pool) -> dict:
    """One graph per key, largest first (the shared pool is sized by it and the smaller graphs reuse
    its blocks); each after an eager warm-up, so that Triton compiles and cuBLAS picks its kernels
    outside the capture."""
    graphs = {}
    with _CAPTURE_LOCK:
        for key in keys:
            prepare(key)
            forward(key)
            torch.cuda.synchronize(runner.device)
            graph = torch.cuda.CUDAGraph()
            # thread_local: data-parallel workers are threads of one process, and another thread's
            # CUDA calls must not invalidate this capture (nor this capture fail theirs).
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                forward(key)
            graphs[key] = graph
        torch.cuda.synchronize(runner.device)
    return graphs


class DecodeGraphRunner:
    """Replays captured decode forwards. With capture=False the same padded, static-buffer path runs
    eagerly (what the CPU tests exercise)."""

    def __init__(self, runner: "GraphHost", max_bs: int, capture: bool = True, pool=None) -> None:
        self.runner = runner
        self.sizes = batch_size_ladder(max_bs)
        self.max_bs = self.sizes[-1]
        self.capture = capture
        dev = runner.device
        self._pin = dev.type == "cuda"
        self._padding_row = runner.req_to_token.padding_row
        # M-RoPE models (Qwen2-VL) take one more field: the rotary position (a decode token's t = h = w,
        # its index shifted by its request's rope_delta after images), so their decodes replay graphs too.
        self.mrope = runner.cfg.mrope_section is not None
        self.fields = _FIELDS + self.mrope
        self.inputs = torch.zeros(self.fields * self.max_bs, dtype=torch.int64, device=dev)
        self.ones = torch.ones(self.max_bs, dtype=torch.int64, device=dev)
        self.logits = torch.zeros(self.max_bs, runner.cfg.vocab_size, dtype=torch.float32, device=dev)
        # The exported hidden states of every row (None: the runner exports none), and the model's float
        # inputs per row (None: it reads none; an EAGLE head: `feature_width` columns, a chain step's).
        self.hidden = self.features = None
        if runner.export is not None:
            width = runner.export.width(runner.cfg.hidden_size)
            self.hidden = torch.zeros(self.max_bs, width, dtype=runner.dtype, device=dev)
        if getattr(runner.model, "feature_width", None):
            self.features = torch.zeros(self.max_bs, runner.model.feature_width, dtype=runner.dtype, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if capture:
            self._capture_all(pool)

    def takes(self, batch: BatchInput) -> bool:
        """Whether a decode batch fits the graphs: at most max_bs rows, and features exactly where the model
        reads them, of the captured width."""
        if len(batch.rows) > self.max_bs or (batch.features is None) != (self.features is None):
            return False
        return batch.features is None or batch.features.shape[1] == self.features.shape[1]

    def _views(self, bs: int) -> list[torch.Tensor]:
        return list(self.inputs[: self.fields * bs].view(self.fields, bs).unbind(0))

    def _forward(self, bs: int) -> None:
        """The captured work: record the new slots, run the model, leave fp32 logits in self.logits (and
        the exported hidden states in self.hidden)."""
        ids, positions, loc, rows, seq_lens, *rope = self._views(bs)
        r = self.runner
        fb = ForwardBatch(
            is_decode=True, input_ids=ids, positions=positions, out_cache_loc=loc, req_pool_indices=rows,
            seq_lens=seq_lens, extend_lens=self.ones[:bs], req_to_token=r.req_to_token.table,
            kv_pool=r.kv_pool, attn_backend=r.attn_backend, cos_sin_cache=r.cos_sin_cache,
            rope_positions=rope[0] if rope else None, features=None if self.features is None else self.features[:bs],
        )
        r.record_decode_slots(fb)
        hidden = r.model(fb)
        if self.hidden is not None:
            self.hidden[:bs].copy_(r.export.of(r.model, hidden))
        self.logits[:bs].copy_(r.model.compute_logits(hidden))

    def _fill_padding(self, bs: int) -> None:
        ids, positions, loc, rows, seq_lens, *rope = self._views(bs)
        for t in (ids, positions, loc, *rope):
            t.zero_()
        rows.fill_(self._padding_row)
        seq_lens.fill_(1)

    @torch.inference_mode()
    def _capture_all(self, pool) -> None:
        start = time.perf_counter()
        self.graphs = _capture(self.runner, reversed(self.sizes), self._fill_padding, self._forward, pool)
        logger.info("captured %d decode CUDA graphs (batch sizes 1..%d) in %.1f s", len(self.sizes), self.max_bs,
                    time.perf_counter() - start)

    def run(self, batch: BatchInput) -> torch.Tensor:
        """Logits [n, vocab] of a decode batch of n rows that the graphs take (a view, valid until the next
        step); with an export, the rows' hidden states are self.hidden[:n] until then."""
        n = len(batch.rows)
        bs = self.sizes[bisect.bisect_left(self.sizes, n)]
        pad = bs - n
        zeros = [0] * pad
        rope = []
        if self.mrope:
            rope = (batch.positions if batch.rope_positions is None else batch.rope_positions[0]) + zeros
        host = torch.tensor(
            batch.input_ids + zeros + batch.positions + zeros + batch.out_cache_loc + zeros
            + batch.rows + [self._padding_row] * pad + batch.seq_lens + [1] * pad + rope,
            dtype=torch.int64, pin_memory=self._pin,
        )
        self.inputs[: self.fields * bs].copy_(host, non_blocking=True)
        if batch.input_future is not None:
            self.inputs[:n].copy_(batch.input_future)  # device to device: no host sync
        if self.features is not None:  # padding rows read zeros
            self.features[:n].copy_(batch.features)
            self.features[n:bs].zero_()
        if self.capture:
            self.graphs[bs].replay()
        else:
            with torch.inference_mode():
                self._forward(bs)
        return self.logits[:n]


class ExtendGraphRunner:
    """Replays captured extend forwards for (requests, tokens) buckets (extend_buckets). With
    capture=False the same padded, static-buffer path runs eagerly (what the CPU tests exercise)."""

    def __init__(self, runner: "GraphHost", max_bs: int, max_tokens: int, capture: bool = True,
                 pool=None) -> None:
        self.runner = runner
        self.buckets = extend_buckets(max_bs, max_tokens)
        self.max_bs = max(bs for bs, _, _ in self.buckets)
        self.max_tokens = max(t for _, t, _ in self.buckets)
        self.capture = capture
        dev = runner.device
        self._pin = dev.type == "cuda"
        self._padding_row = runner.req_to_token.padding_row
        self.inputs = torch.zeros(_TOKEN_FIELDS * self.max_tokens + _REQ_FIELDS * self.max_bs, dtype=torch.int64,
                                  device=dev)
        self.logits = torch.zeros(self.max_bs, runner.cfg.vocab_size, dtype=torch.float32, device=dev)
        self.graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        if capture:
            start = time.perf_counter()
            with torch.inference_mode():
                self.graphs = _capture(runner, reversed(self.buckets), self._fill_padding, self._forward, pool)
            logger.info("captured %d extend CUDA graphs (up to %d requests, %d tokens) in %.1f s", len(self.graphs),
                        self.max_bs, self.max_tokens, time.perf_counter() - start)

    def _views(self, key: tuple[int, int, int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        bs, tokens, _ = key
        flat = self.inputs[: _TOKEN_FIELDS * tokens + _REQ_FIELDS * bs]
        token_part, req_part = flat.split([_TOKEN_FIELDS * tokens, _REQ_FIELDS * bs])
        return list(token_part.view(_TOKEN_FIELDS, tokens).unbind(0)), list(req_part.view(_REQ_FIELDS, bs).unbind(0))

    def _forward(self, key: tuple[int, int, int]) -> None:
        """The captured work: the model over the bucket's tokens, fp32 logits of each request's last
        token in self.logits."""
        (ids, positions, loc), (rows, seq_lens, extend_lens, starts, logit_index) = self._views(key)
        r = self.runner
        fb = ForwardBatch(
            is_decode=False, input_ids=ids, positions=positions, out_cache_loc=loc, req_pool_indices=rows,
            seq_lens=seq_lens, extend_lens=extend_lens, req_to_token=r.req_to_token.table, kv_pool=r.kv_pool,
            attn_backend=r.attn_backend, cos_sin_cache=r.cos_sin_cache, extend_start_loc=starts,
            max_extend_len=key[2],
        )
        hidden = r.model(fb).index_select(0, logit_index)
        self.logits[: key[0]].copy_(r.model.compute_logits(hidden))

    def _fill_padding(self, key: tuple[int, int, int]) -> None:
        (ids, positions, loc), (rows, seq_lens, extend_lens, starts, logit_index) = self._views(key)
        for t in (ids, positions, loc, seq_lens, extend_lens, starts, logit_index):
            t.zero_()
        rows.fill_(self._padding_row)

    def bucket_for(self, batch: BatchInput) -> tuple[int, int, int] | None:
        """The smallest captured bucket that holds the batch, or None (it then runs eagerly): too many
        requests or tokens, an extend too long for the bucket, or logits wanted anywhere but at a
        request's last token."""
        n, tokens = len(batch.rows), len(batch.input_ids)
        if n > self.max_bs or tokens > self.max_tokens or len(batch.logit_rows) > n or min(batch.extend_lens) < 1:
            return None
        last = set(_last_token_index(batch.extend_lens))
        if any(i not in last for i in batch.logit_rows):
            return None
        longest = max(batch.extend_lens)
        # the bucket's request count is the smallest that holds n (its extend bound assumes it)
        bs = min(k[0] for k in self.buckets if k[0] >= n)
        fits = [k for k in self.buckets if k[0] == bs and k[1] >= tokens and k[2] >= longest]
        return min(fits, key=lambda k: k[1]) if fits else None

    def run(self, batch: BatchInput, key: tuple[int, int, int]) -> torch.Tensor:
        """Logits [len(batch.logit_rows), vocab] (a view or copy, valid until the next step)."""
        n, tokens = len(batch.rows), len(batch.input_ids)
        bs, size, _ = key
        pad_tokens, pad_reqs = [0] * (size - tokens), [0] * (bs - n)
        last = _last_token_index(batch.extend_lens)
        starts = [i - e + 1 for i, e in zip(last, batch.extend_lens)]
        host = torch.tensor(
            batch.input_ids + pad_tokens + batch.positions + pad_tokens + batch.out_cache_loc + pad_tokens
            + batch.rows + [self._padding_row] * (bs - n) + batch.seq_lens + pad_reqs
            + batch.extend_lens + pad_reqs + starts + pad_reqs + last + pad_reqs,
            dtype=torch.int64, pin_memory=self._pin,
        )
        self.inputs[: host.numel()].copy_(host, non_blocking=True)
        if batch.input_future is not None:
            self.inputs[:tokens].copy_(batch.input_future)  # device to device: no host sync
        if self.capture:
            self.graphs[key].replay()
        else:
            with torch.inference_mode():
                self._forward(key)
        if len(batch.logit_rows) == n:
            return self.logits[:n]
        request_of = {i: j for j, i in enumerate(last)}
        wanted = [request_of[i] for i in batch.logit_rows]
        return self.logits[torch.tensor(wanted, dtype=torch.int64, device=self.logits.device)]


def as_decode_rows(batch: BatchInput) -> BatchInput | None:
    """The extend `batch` as a decode batch of one row per new token (see the module's docstring), or None
    where the decode path cannot compute it: images, M-RoPE positions other than t = h = w (a decode's),
    logits wanted at some tokens only or in another order, a request with more than DECODE_ROWS_MAX_EXTEND
    new tokens, positions that are not the table's (the decode step records each row's slot there)."""
    tokens, rope = len(batch.input_ids), batch.rope_positions
    if (batch.is_decode or batch.images or (rope is not None and not rope[0] == rope[1] == rope[2]) or not tokens
            or batch.logit_rows != list(range(tokens))
            or max(batch.extend_lens) > DECODE_ROWS_MAX_EXTEND):
        return None
    rows: list[int] = []
    seq_lens: list[int] = []
    for row, seq_len, new in zip(batch.rows, batch.seq_lens, batch.extend_lens):
        rows += [row] * new
        seq_lens += range(seq_len - new + 1, seq_len + 1)  # token j of the extend sees the prefix and j + 1 new
    if any(p + 1 != s for p, s in zip(batch.positions, seq_lens)):
        return None
    return BatchInput(True, batch.input_ids, batch.positions, batch.out_cache_loc, rows, seq_lens, [1] * tokens,
                      batch.logit_rows, input_future=batch.input_future, rope_positions=rope, features=batch.features)


def _last_token_index(extend_lens: list[int]) -> list[int]:
    """Index of each request's last new token in the packed batch."""
    out, end = [], 0
    for e in extend_lens:
        end += e
        out.append(end - 1)
    return out
