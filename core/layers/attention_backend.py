"""The attention-backend interface: store the new tokens' KV into their pool slots, then attend.

One backend serves every kernel set: `ops` is kernels.cpu (pure torch, the CPU path) or the
Triton kernels on CUDA, with identical signatures.
"""

from __future__ import annotations

import inspect
from types import ModuleType

import torch

from radixlm.core.layers.forward_batch import ForwardBatch


class AttentionBackend:
    def __init__(self, ops: ModuleType) -> None:
        self.ops = ops
        # The Triton extend kernel takes the batch layout precomputed (an optional trailing parameter
        # the reference lacks); passing it saves a device sync per layer.
        self._extend_takes_layout = "max_extend_len" in inspect.signature(ops.extend_attention).parameters
        # The CPU set plans the batch's layout once per forward instead of once per layer.
        self._plan = getattr(ops, "plan_attention", None)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, fb: ForwardBatch):
        k_buf, v_buf = fb.kv_pool.k_buffers[layer_id], fb.kv_pool.v_buffers[layer_id]
        self.ops.store_kv(k_buf, v_buf, fb.out_cache_loc, k, v)
        scale = q.shape[-1] ** -0.5
        extra = {}
        if self._plan is not None:
            if fb.attn_plan is None:
                fb.attn_plan = self._plan(fb.req_to_token, fb.req_pool_indices, fb.seq_lens,
                                          None if fb.is_decode else fb.extend_lens)
            extra["plan"] = fb.attn_plan
        if fb.is_decode:
            return self.ops.decode_attention(
                q, k_buf, v_buf, fb.req_to_token, fb.req_pool_indices, fb.seq_lens, scale, **extra
            )
        args = (q, k_buf, v_buf, fb.req_to_token, fb.req_pool_indices, fb.seq_lens, fb.extend_lens, scale)
        if self._extend_takes_layout and fb.max_extend_len is not None:
            return self.ops.extend_attention(*args, fb.extend_start_loc, fb.max_extend_len)
        return self.ops.extend_attention(*args, **extra)
