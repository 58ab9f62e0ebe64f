"""Paged attention over the token-granular KV pool: extend (prefill with a cached prefix) and decode.

Both read every key and value through ``req_to_token`` (row ``req_pool_indices[b]``, column = position),
so the new tokens must already be in the pool (``store_kv``) when these run. Twins:
``reference.extend_attention`` and ``reference.decode_attention``.

Softmax runs in base 2: scores are scaled by ``sm_scale * log2(e)`` so ``exp2`` replaces ``exp``.
"""

from __future__ import annotations

import functools
import math
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


class AttnConfig(NamedTuple):
    """Launch shape: rows of queries per program (extend only), keys per loop step, warps, stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs are the test path: exact fp32 products instead of the tf32 default.
    return "ieee" if dtype == torch.float32 else "tf32"


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def extend_config(head_dim: int, device: torch.device) -> AttnConfig:
    override = os.environ.get("RADIXLM_EXTEND_ATTN_CONFIG")  # "block_m,block_n,warps,stages": ablations
    if override:
        return AttnConfig(*(int(x) for x in override.split(",")))
    if device.type != "cuda":
        return AttnConfig(16, 16, 4, 1)  # interpreter: small blocks so tiny tests cross block edges
    if _block_d(head_dim) <= 64:
        return AttnConfig(128, 64, 4, 3)
    if _block_d(head_dim) <= 128:
        # Fastest of the H200 sweep at 16 x 1024 prefill, bf16
        # (benchmarks/results/2026-11-29-h200-gpu-check.md):
        # 0.61 ms against 0.92 ms for the earlier (128, 64, 8, 2).
        return AttnConfig(64, 32, 4, 3)
    return AttnConfig(64, 32, 8, 2)


def decode_config(head_dim: int, device: torch.device) -> AttnConfig:
    # block_m is unused by decode: a program's rows are one KV head's query group.
    if device.type != "cuda":
        return AttnConfig(0, 16, 4, 1)
    override = os.environ.get("RADIXLM_DECODE_ATTN_CONFIG")  # "block_n,warps,stages": launch-shape ablations
    if override:
        block_n, warps, stages = (int(x) for x in override.split(","))
        return AttnConfig(0, block_n, warps, stages)
    if _block_d(head_dim) <= 128:
        # Measured on the H200 (benchmarks/results/2026-11-29-h200-gpu-check.md): (0, 128, 8, 3) is
        # 25% faster at B=256 with lengths 128..1536 but 25% slower on short contexts, and no faster
        # end to end.
        return AttnConfig(0, 64, 4, 2)
    return AttnConfig(0, 32, 4, 2)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_num_kv_splits(batch: int, num_kv_heads: int, device: torch.device) -> int:
    """Enough (request, KV head, split) programs to fill the GPU about four times over.

    Depends only on the batch shape, never on sequence lengths, so it needs no device sync and a
    captured CUDA graph for a batch size stays valid for any lengths.
    """
    if device.type != "cuda":
        return 2
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return max(1, min(32, math.ceil(4 * sms / max(1, batch * num_kv_heads))))


@triton.jit
def _attend_keys(
    q, m_i, l_i, acc,
    K, V, token_row_ptr, row_base, kv_head,
    stride_rc, stride_ks, stride_kh, stride_kd, stride_vs, stride_vh, stride_vd,
    lo, hi, q_pos, scale_log2, tree_bits, tree_base,
    CAUSAL: tl.constexpr, DIRECT: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, TREE: tl.constexpr,
):
    """Online-softmax accumulation of the keys at positions [lo, hi) into (m_i, l_i, acc).

    Key position p is row ``token_row_ptr[p]`` of K and V, or with DIRECT row ``row_base + p`` (keys laid
    out contiguously: no index load, no gather). With CAUSAL, key position p is visible to query row i
    only when p <= q_pos[i]. With TREE, only when bit p - tree_base of tree_bits[i] is set (the row's
    ancestors among its request's new tokens; see `extend_attention`'s tree_mask).
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    # bf16 queries against an fp8 pool multiply in fp16: fp8 widens to fp16 exactly in one instruction a
    # pair on sm_90, to bf16 in several (measured: the bf16 path made the fp8 decode kernel slower than
    # the bf16 pool's at half the bytes).
    if K.dtype.element_ty.is_fp8() and q.dtype == tl.bfloat16:
        q = q.to(tl.float16)
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n
        n_mask = pos < hi
        if DIRECT:
            slot = row_base + pos
        else:
            slot = tl.load(token_row_ptr + pos * stride_rc, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(
            K + slot[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :] * stride_kd,
            mask=kv_mask, other=0.0,
        )
        scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * scale_log2
        keep = n_mask[None, :]
        if CAUSAL:
            keep = keep & (pos[None, :] <= q_pos[:, None])
        if TREE:
            rel = (pos - tree_base).to(tl.int64)
            keep = keep & (((tree_bits[:, None] >> rel[None, :]) & 1) != 0)
        scores = tl.where(keep, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            V + slot[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :] * stride_vd,
            mask=kv_mask, other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _extend_kernel(
    Q, K, V, KNew, VNew, O, ReqToToken, ReqPoolIndices, SeqLens, ExtendLens, ExtendStartLoc, TreeMask,
    scale_log2,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_ks, stride_kh, stride_kd,
    stride_vs, stride_vh, stride_vd,
    stride_nks, stride_nkh, stride_nkd,
    stride_nvs, stride_nvh, stride_nvd,
    stride_rr, stride_rc,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, NEW_KV: tl.constexpr,
    SKIP_SHORT: tl.constexpr, TREE: tl.constexpr,
):
    """Extends of at most SKIP_SHORT tokens are left to the split kernel (`_split_kernel`, short mode).
    TREE: the new keys are masked by each row's ancestor bits (TreeMask) instead of causally."""
    # Heads vary fastest so the query heads sharing a KV head run side by side and share it in L2.
    head = tl.program_id(0)
    req = tl.program_id(1)
    # The blocks with the most keys start first, the cheap ones fill the tail.
    m_block = tl.num_programs(2) - 1 - tl.program_id(2)
    extend_len = tl.load(ExtendLens + req).to(tl.int32)
    if (m_block * BLOCK_M >= extend_len) | (extend_len <= SKIP_SHORT):
        return
    seq_len = tl.load(SeqLens + req).to(tl.int32)
    prefix_len = seq_len - extend_len
    q_start = tl.load(ExtendStartLoc + req).to(tl.int64)
    row = tl.load(ReqPoolIndices + req).to(tl.int64)
    kv_head = head // GROUP

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < extend_len
    qd_mask = m_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(
        Q + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :] * stride_qd,
        mask=qd_mask, other=0.0,
    )
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    token_row_ptr = ReqToToken + row * stride_rr
    q_pos = prefix_len + offs_m
    tree_bits = q_pos.to(tl.int64)  # (unread without TREE)
    if TREE:
        tree_bits = tl.load(TreeMask + q_start + offs_m, mask=m_mask, other=-1)  # padding rows: every key

    # The cached prefix through the pool; then the new tokens' keys, from KNew/VNew (request after request
    # like q) with NEW_KV, else through the pool too (the launcher passes K and V as KNew and VNew). Keys
    # before this block's first query are visible to all its rows: no causal mask there.
    diag_start = prefix_len + m_block * BLOCK_M
    diag_end = prefix_len + tl.minimum((m_block + 1) * BLOCK_M, extend_len)
    new_base = q_start - prefix_len
    m_i, l_i, acc = _attend_keys(
        q, m_i, l_i, acc, K, V, token_row_ptr, 0, kv_head,
        stride_rc, stride_ks, stride_kh, stride_kd, stride_vs, stride_vh, stride_vd,
        0, prefix_len, q_pos, scale_log2, tree_bits, prefix_len,
        False, False, HEAD_DIM, BLOCK_D, BLOCK_N, PRECISION, False,
    )
    m_i, l_i, acc = _attend_keys(
        q, m_i, l_i, acc, KNew, VNew, token_row_ptr, new_base, kv_head,
        stride_rc, stride_nks, stride_nkh, stride_nkd, stride_nvs, stride_nvh, stride_nvd,
        prefix_len, diag_start, q_pos, scale_log2, tree_bits, prefix_len,
        False, NEW_KV, HEAD_DIM, BLOCK_D, BLOCK_N, PRECISION, TREE,
    )
    m_i, l_i, acc = _attend_keys(
        q, m_i, l_i, acc, KNew, VNew, token_row_ptr, new_base, kv_head,
        stride_rc, stride_nks, stride_nkh, stride_nkd, stride_nvs, stride_nvh, stride_nvd,
        diag_start, diag_end, q_pos, scale_log2, tree_bits, prefix_len,
        True, NEW_KV, HEAD_DIM, BLOCK_D, BLOCK_N, PRECISION, TREE,
    )
    out = acc / l_i[:, None]
    tl.store(
        O + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :] * stride_od,
        out.to(O.dtype.element_ty), mask=qd_mask,
    )


def extend_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    sm_scale: float,
    extend_start_loc: torch.Tensor | None = None,
    max_extend_len: int | None = None,
    *,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    split_short: bool = False,
    config: AttnConfig | None = None,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its prefix and new tokens, in one launch (two
    or three with ``split_short``).

    Same contract as ``reference.extend_attention``. ``extend_start_loc`` (offset of each request's
    first query in ``q``) and ``max_extend_len`` may be passed when the caller has them; otherwise
    they are derived from ``extend_lens`` (the max costs one device-to-host sync). ``new_kv``: the new
    tokens' (rotated) k and v [T, KH, D], packed like q, equal to what was stored into their slots:
    read from there without the gather through the pool.

    ``split_short``: requests with at most SHORT_EXTEND_TOKENS new tokens (the one-token decodes riding
    in a jump-forward step, short forced texts) are computed as decodes are, by the split kernel (a KV
    head loaded once for its query group, the keys split across programs), and only the longer ones by
    the extend kernel, whose programs (one query head, a 64-row query block) would otherwise each walk
    a one-token request's whole context.

    ``tree_mask`` (int64 [T], as ``reference.extend_attention``'s): each query row sees its request's
    prefix and those of its new tokens whose bits it sets, instead of every earlier one (a verify step
    of a draft tree). Such a batch runs on the extend kernel alone (``split_short`` is ignored).
    """
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    split_short = split_short and tree_mask is None
    batch = extend_lens.shape[0]
    if batch == 0 or q.shape[0] == 0:
        return out
    if extend_start_loc is None:
        extend_start_loc = torch.cumsum(extend_lens, 0) - extend_lens
    if max_extend_len is None:
        max_extend_len = int(extend_lens.max())
    num_heads, head_dim = q.shape[1], q.shape[2]
    cfg = config or extend_config(head_dim, q.device)
    grid = (num_heads, batch, triton.cdiv(max_extend_len, cfg.block_m))
    k_new, v_new = new_kv if new_kv is not None else (k_buffer, v_buffer)
    if split_short:
        _split_attention(q, k_buffer, v_buffer, out, req_to_token, req_pool_indices, seq_lens, sm_scale, None,
                         SHORT_EXTEND_TOKENS, extend_lens, extend_start_loc)
    _extend_kernel[grid](
        q, k_buffer, v_buffer, k_new, v_new, out, req_to_token, req_pool_indices, seq_lens, extend_lens,
        extend_start_loc, extend_lens if tree_mask is None else tree_mask,
        sm_scale * _LOG2E,
        *q.stride(), *out.stride(), *k_buffer.stride(), *v_buffer.stride(), *k_new.stride(), *v_new.stride(),
        *req_to_token.stride(),
        GROUP=num_heads // k_buffer.shape[1], HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, PRECISION=_dot_precision(q.dtype),
        NEW_KV=new_kv is not None, SKIP_SHORT=SHORT_EXTEND_TOKENS if split_short else 0,
        TREE=tree_mask is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


@triton.jit
def _decode_split_kernel(
    Q, K, V, O, PartOut, PartLse, ReqToToken, ReqPoolIndices, SeqLens, ExtendLens, ExtendStartLoc,
    scale_log2, num_splits,
    stride_qb, stride_qh, stride_qd,
    stride_ks, stride_kh, stride_kd,
    stride_vs, stride_vh, stride_vd,
    stride_ob, stride_oh, stride_od,
    stride_rr, stride_rc,
    stride_pb, stride_ph, stride_ps, stride_pd,
    stride_lb, stride_lh, stride_ls,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, DIRECT: tl.constexpr, TOKENS: tl.constexpr,
):
    """Stage 1: one KV head's whole query group against one split of one request's keys. DIRECT (one
    split): the output itself, and no stage 2.

    TOKENS > 1 (short extends): the request's new tokens, when it has 1 to TOKENS of them (others are the
    extend kernel's), at q rows ExtendStartLoc[req] on; a program's rows are (token, head of the group)
    pairs, row = token * GROUP + head. The splits share out the cached prefix and the last one also
    takes the new tokens' keys, causally (its first key is at most the prefix's end, so every row sees a
    key in its first block). Partials are indexed by token * num_heads + head."""
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + req).to(tl.int32)
    row = tl.load(ReqPoolIndices + req).to(tl.int64)
    if TOKENS > 1:
        ext_len = tl.load(ExtendLens + req).to(tl.int32)
        if (ext_len > TOKENS) | (ext_len == 0):
            return
        q_start = tl.load(ExtendStartLoc + req).to(tl.int64)
        keys = seq_len - ext_len  # the prefix; the new tokens' keys come last, causally
    else:
        ext_len = 1
        q_start = req.to(tl.int64)
        keys = seq_len
    # Splits are whole multiples of BLOCK_N so no split wastes a partial block; trailing ones may be empty.
    split_len = tl.cdiv(tl.cdiv(keys, num_splits), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, keys)
    if TOKENS > 1:
        last = split == num_splits - 1
        lo = tl.where(last, tl.minimum(lo, keys), lo)
        hi = tl.where(last, seq_len, hi)

    offs_r = tl.arange(0, BLOCK_H)
    token = offs_r // GROUP
    heads = kv_head * GROUP + offs_r % GROUP
    r_mask = (offs_r < GROUP * TOKENS) & (token < ext_len)
    offs_d = tl.arange(0, BLOCK_D)
    hd_mask = r_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    q_ptrs = Q + (q_start + token)[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=hd_mask, other=0.0)
    q_pos = seq_len - ext_len + token
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    m_i, l_i, acc = _attend_keys(
        q, m_i, l_i, acc, K, V, ReqToToken + row * stride_rr, 0, kv_head,
        stride_rc, stride_ks, stride_kh, stride_kd, stride_vs, stride_vh, stride_vd,
        lo, hi, q_pos, scale_log2, q_pos, 0,
        TOKENS > 1, False, HEAD_DIM, BLOCK_D, BLOCK_N, PRECISION, False,
    )
    # An empty split stores zeros with log-sum-exp -inf, which the reduce weighs as nothing (a request
    # with no keys at all gets zeros, as in the reference).
    nonempty = l_i > 0
    part = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    if DIRECT:
        tl.store(O + (q_start + token)[:, None] * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
                 part.to(O.dtype.element_ty), mask=hd_mask)
    else:
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        part_row = token * (GROUP * tl.num_programs(1)) + heads
        tl.store(
            PartOut + req * stride_pb + part_row[:, None] * stride_ph + split * stride_ps
            + offs_d[None, :] * stride_pd,
            part, mask=hd_mask,
        )
        tl.store(PartLse + req * stride_lb + part_row * stride_lh + split * stride_ls, lse, mask=r_mask)


@triton.jit
def _decode_reduce_kernel(
    PartOut, PartLse, O, ExtendLens, ExtendStartLoc, num_splits,
    stride_pb, stride_ph, stride_ps, stride_pd,
    stride_lb, stride_lh, stride_ls,
    stride_ob, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, TOKENS: tl.constexpr,
):
    """Stage 2: merge the splits of one (request, head) by their log-sum-exps; with TOKENS > 1 (short
    extends, as in stage 1) those of each of its new tokens, partial row token * num_heads + head."""
    req = tl.program_id(0)
    head = tl.program_id(1)
    if TOKENS > 1:
        ext_len = tl.load(ExtendLens + req).to(tl.int32)
        count = tl.where(ext_len > TOKENS, 0, ext_len)
        out_row = tl.load(ExtendStartLoc + req).to(tl.int64)
    else:
        count = 1
        out_row = req.to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    sd_mask = s_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    for token in range(count):
        part_row = token * tl.num_programs(1) + head
        lse = tl.load(
            PartLse + req * stride_lb + part_row * stride_lh + offs_s * stride_ls, mask=s_mask, other=float("-inf")
        )
        parts = tl.load(
            PartOut + req * stride_pb + part_row * stride_ph + offs_s[:, None] * stride_ps
            + offs_d[None, :] * stride_pd,
            mask=sd_mask, other=0.0,
        )
        m = tl.max(lse, 0)
        m = tl.where(m == float("-inf"), 0.0, m)  # all splits empty (seq_len 0): output zeros
        w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - m))
        total = tl.sum(w, 0)
        out = tl.sum(w[:, None] * parts, 0) / tl.where(total > 0, total, 1.0)
        tl.store(
            O + (out_row + token) * stride_ob + head * stride_oh + offs_d * stride_od,
            out.to(O.dtype.element_ty), mask=offs_d < HEAD_DIM,
        )


# Extends of at most this many new tokens go through the split kernel with `extend_attention(split_short=True)`:
# most jump-forward texts (a key and its punctuation) are a few tokens; 8 tokens of a 4-head query group are
# 32 rows, twice the 16 a decode pads its group to for tl.dot.
SHORT_EXTEND_TOKENS = 8


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    num_kv_splits: int | None = None,
    *,
    config: AttnConfig | None = None,
) -> torch.Tensor:
    """Flash-decoding: one query per request over its paged KV, split along the keys, then merged.

    Same contract as ``reference.decode_attention``. Each stage-1 program loads one KV head once for
    its whole query group (GQA). ``num_kv_splits`` defaults to a value that depends on the batch
    shape only (see ``default_num_kv_splits``).
    """
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0]:
        _split_attention(q, k_buffer, v_buffer, out, req_to_token, req_pool_indices, seq_lens, sm_scale,
                         num_kv_splits, 1, None, None, config)
    return out


def _split_attention(
    q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, out: torch.Tensor, req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float, num_kv_splits: int | None,
    tokens: int, extend_lens: torch.Tensor | None, extend_start_loc: torch.Tensor | None,
    config: AttnConfig | None = None,
) -> None:
    """Writes into `out` the attention of each request's query rows: one (decodes, tokens=1, row = request)
    or, with tokens > 1, its new tokens when it has at most `tokens` of them (rows from extend_start_loc)."""
    batch = seq_lens.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_buffer.shape[1]
    group = num_heads // num_kv_heads
    splits = num_kv_splits or default_num_kv_splits(batch, num_kv_heads, q.device)
    cfg = config or decode_config(head_dim, q.device)
    block_d = _block_d(head_dim)
    # One split (large batches): the split kernel writes the output, no partials and no reduce launch.
    direct = splits == 1
    rows = tokens * num_heads
    part_out = torch.empty((batch, rows, 0 if direct else splits, head_dim), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((batch, rows, 0 if direct else splits), dtype=torch.float32, device=q.device)
    lens = extend_lens if extend_lens is not None else seq_lens  # (unread with tokens=1)
    starts = extend_start_loc if extend_start_loc is not None else seq_lens
    _decode_split_kernel[(batch, num_kv_heads, splits)](
        q, k_buffer, v_buffer, out, part_out, part_lse, req_to_token, req_pool_indices, seq_lens, lens, starts,
        sm_scale * _LOG2E, splits,
        *q.stride(), *k_buffer.stride(), *v_buffer.stride(), *out.stride(), *req_to_token.stride(),
        *part_out.stride(), *part_lse.stride(),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_H=max(16, triton.next_power_of_2(group * tokens)),  # tl.dot needs at least 16 rows
        BLOCK_N=cfg.block_n, PRECISION=_dot_precision(q.dtype), DIRECT=direct, TOKENS=tokens,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if not direct:
        _decode_reduce_kernel[(batch, num_heads)](
            part_out, part_lse, out, lens, starts, splits,
            *part_out.stride(), *part_lse.stride(), *out.stride(),
            HEAD_DIM=head_dim, BLOCK_D=block_d,
            BLOCK_S=triton.next_power_of_2(splits), num_warps=4, TOKENS=tokens,
        )
