"""The kernel set for devices without Triton (the CPU path): pure torch, a whole batch per call.

Attention gathers each request's keys and values through the request-to-token table into padded
``[n, KH, L, D]`` tensors and runs one `scaled_dot_product_attention` over the batch, with a mask for
the padding and for causality, instead of the references' loop over requests. Requests whose shapes
differ a lot (a long prefill beside decoding requests, one long context among short ones) go in
separate groups, so padding never costs more than about twice the real work. Every other op is the
reference's own. tests/test_cpu_kernels.py checks these against the references.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixlm.kernels.reference import (  # noqa: F401  (re-exported: this set's ops of the same name)
    apply_rotary,
    apply_token_bitmask,
    fused_add_rms_norm,
    pack_token_mask,
    rms_norm,
    seeded_exponential,
    silu_and_mul,
    store_kv,
)

# A group may hold this many padded (query, key) pairs beyond twice its real ones: small requests
# batch together even when their lengths differ, where a separate call would cost more than the padding.
_PADDING_SLACK = 1 << 14


def extend_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """reference.extend_attention, batched: q [sum(extend_lens), H, D] packed request after request."""
    return _paged_attention(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens,
                            extend_lens.tolist(), sm_scale)


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """reference.decode_attention, batched: q [B, H, D], one query per request."""
    return _paged_attention(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens,
                            [1] * q.shape[0], sm_scale)


def _paged_attention(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens,
                     extend_lens: list[int], sm_scale: float) -> torch.Tensor:
    seq_list = seq_lens.tolist()
    starts, total = [], 0
    for e in extend_lens:
        starts.append(total)
        total += e
    # Rows of an empty request (a padding row of seq_len 0) stay zero, as in the reference.
    out = torch.zeros_like(q) if 0 in seq_list else torch.empty_like(q)
    for group in _groups(extend_lens, seq_list):
        _attend_group(q, out, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, sm_scale,
                      group, [starts[i] for i in group], [extend_lens[i] for i in group],
                      max(seq_list[i] for i in group))
    return out


def _groups(extend_lens: list[int], seq_lens: list[int]) -> list[list[int]]:
    """Request indices in groups to batch: longest extends first, a request joining the current group
    while the group's padded work (requests x longest extend x longest sequence) stays within twice its
    real work (sum of extend x sequence) plus _PADDING_SLACK. Requests of length 0 are left out."""
    order = sorted((i for i in range(len(seq_lens)) if seq_lens[i] > 0),
                   key=lambda i: (-extend_lens[i], -seq_lens[i]))
    groups: list[list[int]] = []
    longest_ext = longest_seq = real = 0
    for i in order:
        seq = max(longest_seq, seq_lens[i])
        work = real + extend_lens[i] * seq_lens[i]
        if groups and (len(groups[-1]) + 1) * longest_ext * seq <= 2 * work + _PADDING_SLACK:
            groups[-1].append(i)
            longest_seq, real = seq, work
        else:
            groups.append([i])
            longest_ext, longest_seq, real = extend_lens[i], seq_lens[i], extend_lens[i] * seq_lens[i]
    return groups


def _attend_group(q, out, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, sm_scale,
                  group: list[int], starts: list[int], ext: list[int], max_len: int) -> None:
    """Attention of one group's new tokens, padded to [n, H, max_ext, D] queries over [n, KH, max_len, D]
    keys; writes its rows of `out`."""
    device, n, max_ext = q.device, len(group), max(ext)
    index = torch.tensor(group, device=device)
    rows, lens = req_pool_indices[index], seq_lens[index]
    key_pos = torch.arange(max_len, device=device)
    key_valid = key_pos[None, :] < lens[:, None]  # [n, max_len]
    # Padding keys read slot 0, which always holds finite values, so that masked keys cannot turn the
    # weighted sum into NaN (0 * inf).
    slots = torch.where(key_valid, req_to_token[rows, :max_len], 0).reshape(-1)
    k = k_buffer.index_select(0, slots).view(n, max_len, *k_buffer.shape[1:]).transpose(1, 2)
    v = v_buffer.index_select(0, slots).view(n, max_len, *v_buffer.shape[1:]).transpose(1, 2)
    if max_ext == 1:
        token = torch.tensor(starts, device=device)
        mask = key_valid[:, None, None, :]
        o = F.scaled_dot_product_attention(q[token].unsqueeze(2), k, v, attn_mask=mask,
                                           scale=sm_scale, enable_gqa=True)
        out[token] = o.squeeze(2)
        return
    ext_t = torch.tensor(ext, device=device)
    q_pos = torch.arange(max_ext, device=device)
    q_valid = q_pos[None, :] < ext_t[:, None]  # [n, max_ext]
    token = (torch.tensor(starts, device=device)[:, None] + q_pos[None, :])[q_valid]
    q_pad = q.new_zeros(n, max_ext, *q.shape[1:])
    q_pad[q_valid] = q[token]
    # Query i of request b sits at position seq_len - ext + i and sees keys up to it. Padding queries
    # see the whole sequence (never an empty row); their outputs are dropped.
    limit = (lens - ext_t)[:, None] + q_pos[None, :]  # [n, max_ext]
    mask = (key_pos[None, None, :] <= limit[:, :, None]) & key_valid[:, None, :]
    o = F.scaled_dot_product_attention(q_pad.transpose(1, 2), k, v, attn_mask=mask[:, None],
                                       scale=sm_scale, enable_gqa=True)
    out[token] = o.transpose(1, 2)[q_valid]
