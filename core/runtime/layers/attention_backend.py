"""The attention-backend interface: rotate the new tokens' q and k, store their k and v into the pool
slots, then attend.

One backend serves every kernel set: `ops` is kernels.cpu (pure torch, the CPU path) or the
Triton kernels on CUDA, with identical signatures.
"""

from __future__ import annotations

import inspect
import os
from types import ModuleType

import torch

from radixlm.core.runtime.layers.forward_batch import ForwardBatch


class AttentionBackend:
    def __init__(self, ops: ModuleType) -> None:
        self.ops = ops
        # The Triton extend kernel takes the batch layout precomputed (an optional trailing parameter
        # the reference lacks); passing it saves a device sync per layer.
        extend_params = inspect.signature(ops.extend_attention).parameters
        self._extend_takes_layout = "max_extend_len" in extend_params
        # ...and may read the new tokens' k and v packed (as the rotary leaves them) instead of gathering
        # them back from their pool slots (H200, 16 x 1024 prefill: 0.57 against 0.62 ms a layer).
        self._reads_packed = "new_kv" in extend_params
        # ...and may compute the requests with a few new tokens (decodes riding in a jump-forward step)
        # as decodes are: used where the step has at most that many tokens a request on average.
        self._short_tokens = getattr(ops, "SHORT_EXTEND_TOKENS", 0) if "split_short" in extend_params else 0
        # The CPU set plans the batch's layout once per forward instead of once per layer; its rotary keeps
        # the step's cos and sin rows in the same plan.
        self._plan = getattr(ops, "plan_attention", None)
        # The Triton set rotates and stores in one launch per layer, in decode steps inside the qkv
        # projection's (core.runtime.models.llama); the CPU set runs its two ops. Ablations for benchmarks:
        # RADIXLM_UNFUSED_ROTARY_STORE=1 runs the two ops on any set, =qkv keeps them out of the projection.
        unfused = os.environ.get("RADIXLM_UNFUSED_ROTARY_STORE", "0")
        self._rotary_store_kv = None if unfused == "1" else getattr(ops, "apply_rotary_store_kv", None)
        self.fuses_rotary_into_qkv = (self._rotary_store_kv is not None and unfused != "qkv"
                                      and hasattr(ops, "rotary_qkv_gemv"))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, fb: ForwardBatch):
        """q [T, H, D], k and v [T, KH, D] as projected, before the rotary embedding (fb.positions,
        fb.cos_sin_cache), which is applied here so that it can share a kernel with the KV store."""
        k_buf, v_buf = fb.kv_pool.k_buffers[layer_id], fb.kv_pool.v_buffers[layer_id]
        positions = fb.rotary_positions
        # Not from an fp8 pool: attention must see the rounded values the pool holds.
        packed = self._reads_packed and not fb.is_decode and k_buf.dtype == k.dtype
        if self._rotary_store_kv is not None:
            k_rot = torch.empty(k.shape, dtype=k.dtype, device=k.device) if packed else None
            q = self._rotary_store_kv(q, k, v, positions, fb.cos_sin_cache, k_buf, v_buf, fb.out_cache_loc, k_rot)
        else:
            extra = {} if self._plan is None else {"plan": self._batch_plan(fb)}
            q, k_rot = self.ops.apply_rotary(q, k, positions, fb.cos_sin_cache, **extra)
            self.ops.store_kv(k_buf, v_buf, fb.out_cache_loc, k_rot, v)
        return self.attend(q, layer_id, fb, (k_rot, v) if packed else None)

    def attend(self, q: torch.Tensor, layer_id: int, fb: ForwardBatch,
               new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Attention of the new tokens' rotated q [T, H, D] over the pool, their own k and v stored (and
        given packed as `new_kv` where the kernel set reads them so)."""
        k_buf, v_buf = fb.kv_pool.k_buffers[layer_id], fb.kv_pool.v_buffers[layer_id]
        scale = q.shape[-1] ** -0.5
        extra = {} if self._plan is None else {"plan": self._batch_plan(fb)}
        if fb.is_decode:
            return self.ops.decode_attention(
                q, k_buf, v_buf, fb.req_to_token, fb.req_pool_indices, fb.seq_lens, scale, **extra
            )
        args = (q, k_buf, v_buf, fb.req_to_token, fb.req_pool_indices, fb.seq_lens, fb.extend_lens, scale)
        if new_kv is not None:
            extra["new_kv"] = new_kv
        if fb.tree_mask is not None and self._plan is None:  # a plan holds it
            extra["tree_mask"] = fb.tree_mask
        elif q.shape[0] <= self._short_tokens * fb.extend_lens.shape[0]:
            extra["split_short"] = True
        if self._extend_takes_layout and fb.max_extend_len is not None:
            return self.ops.extend_attention(*args, fb.extend_start_loc, fb.max_extend_len, **extra)
        return self.ops.extend_attention(*args, **extra)

    def _batch_plan(self, fb: ForwardBatch):
        """The kernel set's layout of this batch, made at the first layer and kept for the others."""
        if fb.attn_plan is None:
            fb.attn_plan = self._plan(fb.req_to_token, fb.req_pool_indices, fb.seq_lens,
                                      None if fb.is_decode else fb.extend_lens, fb.tree_mask)
        return fb.attn_plan
