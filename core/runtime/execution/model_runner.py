"""Executes batches: owns the model, the KV pool and the request-to-token table. Decides nothing.

On CUDA the weights are bf16 (EngineOptions.dtype "auto"), kernels are the Triton set, a step's index
tensors cross to the device in one non-blocking copy from pinned memory, and decode replays CUDA graphs
captured for a ladder of batch sizes (core.runtime.execution.cuda_graph_runner). On CPU the same code runs the
torch kernels (kernels.cpu) eagerly, its linear layers on weights prepacked once at load
(core.runtime.models.cpu_linear).
"""

from __future__ import annotations

import gc
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np
import torch

from radixlm.kernels import registry as kernels
from radixlm.kernels.reference import ancestor_bits
from radixlm.core.runtime.messages import ImageInput
from radixlm.core.runtime.memory.memory_pool import KVPool, ReqToTokenPool, host_available_bytes, host_int64
from radixlm.core.runtime.options import EngineOptions
from radixlm.core.runtime.execution.batch_input import BatchInput, ImageSpan
from radixlm.core.runtime.execution.cuda_graph_runner import DecodeGraphRunner, ExtendGraphRunner, as_decode_rows
from radixlm.core.runtime.execution.hidden_export import HiddenExport, target_export
from radixlm.core.runtime.layers.attention_backend import AttentionBackend
from radixlm.core.runtime.layers.forward_batch import ForwardBatch, ImageBatch
from radixlm.core.runtime.layers.mrope import mrope_cos_sin
from radixlm.core.runtime.models.config import ModelConfig
from radixlm.core.runtime.models.cpu_linear import prepack_linears
from radixlm.core.runtime.models.hub import locate_model
from radixlm.core.runtime.models.loader import load_model
from radixlm.core.runtime.quantization.ggml_product import GgmlLinear
from radixlm.core.runtime.quantization.int4 import Int4Linear

if TYPE_CHECKING:
    from radixlm.core.runtime.models.parallel import TensorParallel

logger = logging.getLogger("radixlm")

# Headroom on the GPU beyond the estimated activations: cuBLAS workspaces, allocator rounding, Triton.
_CUDA_SLACK_BYTES = 1 << 30
# Bytes per logit of the decode sampler's temporaries at most (fp32 copies, softmax, sort values and
# int64 order, cumulative sum) — what max_running_requests x vocab costs in the worst sampling step.
_SAMPLER_BYTES_PER_LOGIT = 32
# The least KV pool a CPU engine sizes for by default (lazily backed: unused pages cost no RAM).
_CPU_KV_MIN_BYTES = 256 << 20


class ModelRunner:
    def __init__(self, model_path: str, cfg: ModelConfig, opts: EngineOptions,
                 tp: "TensorParallel | None" = None, model: torch.nn.Module | None = None,
                 export: HiddenExport | None = None) -> None:
        """With `tp` (core.runtime.models.parallel), cfg is tp.local_config() and this runner is one rank's.
        `model`: one already built (an EAGLE head), instead of loading model_path's. `export`: the hidden
        states each step hands to `hidden_sink` (default: what the options' speculative proposer reads)."""
        self.cfg = cfg
        # The hidden states each step exports (first: EAGLE-3 refuses a target too shallow before its load).
        self.export = export if export is not None else target_export(opts, cfg.num_layers)
        self.device = torch.device(opts.device)
        # (0 elsewhere: a CUDA step need not enter _one_thread_on_cpu at all)
        self.one_thread_max_rows = opts.cpu_one_thread_max_rows if self.device.type == "cpu" else 0
        self.dtype = opts.torch_dtype
        self.ops = kernels.get_ops(self.device)
        self.kv_dtype = opts.torch_kv_dtype
        KVPool.check_dtype(self.kv_dtype, self.device, self.ops, kernels.triton_enabled(self.device))
        # Seconds of each start-up stage (Engine.startup_seconds shows them).
        self.load_seconds: dict[str, float] = {}
        start = time.perf_counter()
        with _one_thread_on_cpu(self.device) as threads:
            self.model = model if model is not None else load_model(
                model_path, cfg, self.dtype, self.device, self.ops, opts.load_format, tp=tp,
                quantization=opts.quantization, gguf_kernel=opts.gguf_kernel, gguf_threads=threads)
            self.load_seconds["weights"] = time.perf_counter() - start
            if self.device.type == "cpu" and not opts.disable_cpu_prepack:
                prepack_linears(self.model, plain_max_rows=opts.cpu_plain_linear_max_rows, workers=threads)
                self.load_seconds["prepack"] = time.perf_counter() - start - self.load_seconds["weights"]
        # gguf_kernel="ggml": the threadpool its products share, paused while the engine is idle (idle()).
        self.ggml_threads = next((m.threads for m in self.model.modules() if isinstance(m, GgmlLinear)), None)
        if opts.decode_fused_gemv and tp is None and hasattr(self.model, "enable_fused_gemv"):
            fused = self.model.enable_fused_gemv(opts.decode_fused_gemv)
            logger.info("decode_fused_gemv=%d: %s", opts.decode_fused_gemv,
                        "on" if fused else "off (this kernel set or model has no fused GEMVs)")
        if self.export is not None:
            self.export.prepare(self.model)
        start = time.perf_counter()
        self.attn_backend = AttentionBackend(self.ops)
        self.cos_sin_cache = cfg.rope_cos_sin_cache(self.device)
        self.num_slots = self._kv_pool_size(opts)
        if tp is not None:  # every rank must index the same slots
            self.num_slots = tp.min_across_ranks(self.num_slots)
        self.kv_pool = KVPool(self.num_slots, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.kv_dtype,
                              self.device)
        self.req_to_token = ReqToTokenPool(opts.max_running_requests + 1, cfg.context_len + 1, self.device)
        self._pin = self.device.type == "cuda"
        self.load_seconds["kv_pool"] = time.perf_counter() - start
        logger.info(
            "KV pool: %d token slots (%.1f MiB), %d request rows, context %d",
            self.num_slots,
            self.num_slots * self._kv_bytes_per_token() / 2**20,
            opts.max_running_requests + 1,
            cfg.context_len,
        )
        self.graph_runner = self.extend_graphs = None
        # Called with each step's input and exported hidden states of all its tokens (an EAGLE proposer's
        # input), valid until the next step; the graphs export them only where `export` was set before capture.
        self.hidden_sink: Callable[[BatchInput, torch.Tensor], None] | None = None
        if self.device.type == "cuda" and not opts.disable_cuda_graph:
            self._capture_graphs(opts)

    def _capture_graphs(self, opts: EngineOptions) -> None:
        pool = torch.cuda.graph_pool_handle()  # shared: steps never run concurrently
        try:
            self.graph_runner = DecodeGraphRunner(self, opts.cuda_graph_max_bs, pool=pool)
            # Extend graphs give logits only: a runner exporting states (every token's) runs extends eagerly.
            if opts.cuda_graph_max_extend_tokens and self.export is None:
                self.extend_graphs = ExtendGraphRunner(self, min(opts.cuda_graph_max_bs, 256),
                                                       opts.cuda_graph_max_extend_tokens, pool=pool)
        except Exception:  # a capture failure costs speed, not service: what failed runs eagerly
            logger.exception("CUDA graph capture failed; running %s eagerly",
                             "extends" if self.graph_runner else "every step")
            torch.cuda.synchronize(self.device)

    def idle(self) -> None:
        """Nothing to run until a request comes: ggml's polling workers (gguf_kernel="ggml") go to sleep
        now rather than spin out their poll time; the next step wakes them."""
        if self.ggml_threads is not None:
            self.ggml_threads.pause()

    def release(self) -> None:
        """Drops the weights, the KV pool and the CUDA graphs once the engine has shut down, so that
        their device memory returns to the process (a later engine sizes its KV pool from what is free)."""
        self.graph_runner = self.extend_graphs = self.ggml_threads = None
        self.model = self.kv_pool = None
        _return_unused_memory(self.device)

    def _kv_bytes_per_token(self) -> int:
        c = self.cfg
        return KVPool.bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, self.kv_dtype)

    def _kv_pool_size(self, opts: EngineOptions) -> int:
        if opts.max_total_tokens is not None:
            return opts.max_total_tokens
        per_token = self._kv_bytes_per_token()
        if self.device.type == "cuda":
            _return_unused_memory(self.device)  # what an earlier engine of this process left counts as free
            free, total = torch.cuda.mem_get_info(self.device)
            # Everything static and transient stays within the fraction: what is in use now (context,
            # weights), the KV pool, and the activations, sampler temporaries and CUDA graphs to come;
            # and a speculative proposer's model with its pool of as many tokens as this one's.
            companion_bytes, companion_per_token = self._proposer_memory(opts)
            budget = (total * opts.mem_fraction_static - (total - free) - self._activation_reserve(opts)
                      - companion_bytes)
            per_token += companion_per_token
        else:
            # A quarter of the RAM share, and at most twice the weights' bytes (at least
            # _CPU_KV_MIN_BYTES): a decode step reading a pool that full already spends more time in
            # attention than in the weights, so more KV would buy cache the CPU cannot use at speed.
            weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
            budget = min(host_available_bytes() * opts.mem_fraction_static * 0.25,
                         max(2 * weights, _CPU_KV_MIN_BYTES))
        # On CPU there is no point holding more than every running request could use at once.
        ceiling = opts.max_running_requests * self.cfg.context_len
        return max(256, min(int(budget // per_token), ceiling))

    def _proposer_memory(self, opts: EngineOptions) -> tuple[int, int]:
        """What the speculative proposer's own model runner (core.runtime.speculative.build) will take on the
        device beside this one: its weights, CUDA graphs and workspaces, and its KV bytes per token (its pool
        holds as many tokens as this one's). `draft`: the draft checkpoint's; `eagle`, `eagle3`: a head of
        one layer of this model's shape, its fc over up to three states and its own LM head; (0, 0) for
        `ngram` and none."""
        algorithm, c = opts.speculative_algorithm, self.cfg
        if algorithm not in ("draft", "eagle", "eagle3"):
            return 0, 0
        if algorithm == "draft":
            c = ModelConfig.from_dir(locate_model(opts.speculative_draft_model_path)[0])
            weights = c.parameter_count()
        else:
            weights = c.layer_parameter_count() + 3 * c.hidden_size ** 2 + c.vocab_size * c.hidden_size
        layers = c.num_layers if algorithm == "draft" else 1
        per_token = KVPool.bytes_per_token(layers, c.num_kv_heads, c.head_dim, self.kv_dtype)
        elt = torch.empty((), dtype=self.dtype).element_size()
        # the fp32 logits buffers of a draft's decode and extend graphs (an EAGLE head's: decode only, its
        # extends run eagerly as it exports its states); workspaces
        buffers = 0 if opts.disable_cuda_graph else 2 if algorithm == "draft" else 1
        graphs = buffers * opts.cuda_graph_max_bs * c.vocab_size * 4
        return weights * elt + graphs + _CUDA_SLACK_BYTES, per_token

    def _activation_reserve(self, opts: EngineOptions) -> int:
        """Bytes the forward passes and the sampler may hold at their peak, beside weights and KV."""
        c = self.cfg
        elt = torch.empty((), dtype=self.dtype).element_size()
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        # Live tensors of one layer per token, counted generously: hidden, residual and normed copies,
        # qkv and its rotated q/k, attention output, gate_up and its product.
        per_token = elt * (4 * c.hidden_size + 2 * (q + 2 * kv) + q + 3 * c.intermediate_size)
        chunk = opts.chunked_prefill_size if opts.chunked_prefill_size > 0 else c.context_len
        prefill = chunk * per_token
        sampler = opts.max_running_requests * c.vocab_size * _SAMPLER_BYTES_PER_LOGIT
        # A 4-bit layer's prefill dequantizes its weight into a transient buffer (kernels' int4_linear).
        dequant = elt * max((m.out_features * m.in_features for m in self.model.modules()
                             if isinstance(m, Int4Linear)), default=0)
        return prefill + sampler + dequant + _CUDA_SLACK_BYTES

    @torch.inference_mode()
    def forward(self, batch: BatchInput) -> torch.Tensor:
        """Runs one step; returns fp32 logits [len(batch.logit_rows), vocab], valid until the next step.
        On the CPU a step of at most `cpu_one_thread_max_rows` tokens runs on one intra-op thread: at one
        row each op's parallel region cost more than it saved (docs/quantization.md)."""
        if len(batch.input_ids) <= self.one_thread_max_rows:
            with _one_thread_on_cpu(self.device):
                return self._forward(batch)
        try:
            return self._forward(batch)
        finally:
            self.idle()  # ggml's polling workers would take cores from torch's threads in the next such step

    def _forward(self, batch: BatchInput) -> torch.Tensor:
        self.req_to_token.flush()
        rows = self._decode_rows(batch)
        if rows is not None:
            logits = self.graph_runner.run(rows)
            if self.hidden_sink is not None:  # the rows are the batch's tokens, in order
                self.hidden_sink(batch, self.graph_runner.hidden[:len(rows.rows)])
            return logits
        # Extends with M-RoPE positions run eagerly: the extend graphs take 1-D positions.
        if self.hidden_sink is None and not batch.is_decode and self.extend_graphs is not None and not batch.images \
                and batch.rope_positions is None and batch.tree_parents is None:
            key = self.extend_graphs.bucket_for(batch)
            if key is not None:
                return self.extend_graphs.run(batch, key)
        fb, logit_index = self._forward_batch(batch)
        if batch.is_decode:
            self.record_decode_slots(fb)
        hidden = self.model(fb)
        if self.hidden_sink is not None:
            self.hidden_sink(batch, hidden if self.export is None else self.export.of(self.model, hidden))
        if not batch.logit_rows:
            return hidden.new_empty((0, self.cfg.vocab_size), dtype=torch.float32)
        if len(batch.logit_rows) != hidden.shape[0]:
            hidden = hidden[logit_index]
        return self.model.compute_logits(hidden)

    def _decode_rows(self, batch: BatchInput) -> BatchInput | None:
        """The batch as rows of the decode graphs, or None where they cannot run it: no graphs, a hidden
        sink that they do not export to, more rows than they hold, inputs they lack (features of another
        width). Decodes are rows (M-RoPE ones too: t = h = w, a 1-D rotary position); so are verify steps
        (logits at every token), a row per token (as_decode_rows), but not those of draft trees (the
        graphs are causal)."""
        graphs = self.graph_runner
        if graphs is None or (self.hidden_sink is not None and graphs.hidden is None) or batch.tree_parents is not None:
            return None
        if not batch.is_decode:
            batch = as_decode_rows(batch) if len(batch.input_ids) <= graphs.max_bs else None
        return batch if batch is not None and graphs.takes(batch) else None

    def record_decode_slots(self, fb: ForwardBatch) -> None:
        """table[row, position] = slot for each decoded token: one scatter on the device."""
        self.req_to_token.table[fb.req_pool_indices, fb.positions] = fb.out_cache_loc.to(torch.int32)

    def _forward_batch(self, batch: BatchInput) -> tuple[ForwardBatch, torch.Tensor]:
        """The step's index tensors (and the logit rows' index), packed into one pinned host tensor and
        moved in one copy."""
        starts = [0, *itertools.accumulate(batch.extend_lens)][:-1]
        parts = [batch.input_ids, batch.positions, batch.out_cache_loc, batch.rows, batch.seq_lens,
                 batch.extend_lens, starts, batch.logit_rows]
        if batch.tree_parents is not None:
            parts.append([bits for at, n in zip(starts, batch.extend_lens)
                          for bits in ancestor_bits(batch.tree_parents[at:at + n])])
        views = host_int64(parts, self._pin).to(self.device, non_blocking=True).split([len(p) for p in parts])
        ids, positions, loc, rows, seq_lens, extend_lens, starts_t, logit_index = views[:8]
        if batch.input_future is not None:
            ids = batch.input_future
        fb = ForwardBatch(
            is_decode=batch.is_decode,
            input_ids=ids,
            positions=positions,
            out_cache_loc=loc,
            req_pool_indices=rows,
            seq_lens=seq_lens,
            extend_lens=extend_lens,
            req_to_token=self.req_to_token.table,
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
            cos_sin_cache=self.cos_sin_cache,
            extend_start_loc=starts_t,
            max_extend_len=max(batch.extend_lens, default=0),
            images=self._image_batch(batch.images) if batch.images else None,
            features=batch.features,
            tree_mask=views[8] if batch.tree_parents is not None else None,
        )
        if batch.rope_positions is not None:
            fb.cos_sin_cache = mrope_cos_sin(self.cos_sin_cache, torch.tensor(batch.rope_positions, device=self.device),
                                             self.cfg.mrope_section)
            fb.rope_positions = torch.arange(len(batch.input_ids), device=self.device)
        return fb, logit_index

    def _image_batch(self, spans: list[ImageSpan]) -> ImageBatch:
        """The step's distinct images (by content hash: requests about one image encode it once) and
        which of their feature rows (all images' rows in one sequence) go to which new token."""
        first_row: dict[int, int] = {}  # pad id -> the image's first row in the sequence
        images: list[ImageInput] = []
        token_index, feature_index = [], []
        for span in spans:
            if span.image.pad_id not in first_row:
                first_row[span.image.pad_id] = sum(image.length for image in images)
                images.append(span.image)
            token_index.extend(range(span.token_start, span.token_start + span.count))
            start = first_row[span.image.pad_id] + span.first_row
            feature_index.extend(range(start, start + span.count))
        tokens, rows = torch.tensor([token_index, feature_index], dtype=torch.int64).to(self.device, non_blocking=True)
        grids = [image.grid_thw for image in images]
        # LLaVA's images are one size (a batch); Qwen2-VL's are patch rows of any count (one sequence).
        join = np.stack if grids[0] is None else np.concatenate
        pixel_values = torch.from_numpy(join([image.pixel_values for image in images]))
        return ImageBatch(pixel_values.to(self.device, self.dtype, non_blocking=True), tokens, rows,
                          None if grids[0] is None else grids)


@contextmanager
def _one_thread_on_cpu(device: torch.device) -> Iterator[int]:
    """Runs the block's CPU ops on this thread alone: small steps (above), and the load, while the engine
    loads the tokenizer on another thread; the load is hundreds of ops (dequantize, copy, prepack) each of
    which, run on torch's threads, opens a parallel region that on a loaded machine waits for the other
    core (2 to 8x the load's wall time on the 2-core development VM). Threads already running keep their
    own count (OpenMP's is per thread); the count is restored after, for this thread and those started
    later. Yields the count."""
    threads = torch.get_num_threads()
    if device.type != "cpu":
        yield threads
        return
    torch.set_num_threads(1)
    try:
        yield threads
    finally:
        torch.set_num_threads(threads)


def _return_unused_memory(device: torch.device) -> None:
    """Collects unreachable tensors and gives the caching allocator's free blocks back to the device."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
