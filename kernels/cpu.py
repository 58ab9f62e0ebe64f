"""The kernel set for devices without Triton (the CPU path): pure torch, a whole batch per call.

Attention gathers each request's keys and values through the request-to-token table into padded
``[n, KH, L, D]`` tensors and runs one `scaled_dot_product_attention` over the batch, with a mask for
the padding and for causality, instead of the references' loop over requests. Requests whose shapes
differ a lot (a long prefill beside decoding requests, one long context among short ones) go in
separate groups, so padding never costs more than about twice the real work. That layout (groups, KV
slots, masks) is the same for every layer: `plan_attention` makes it once per forward and the
attention ops take it as their optional `plan`. RMSNorm is torch's fused op and the rotary embedding
takes fewer ops than the reference's; the rest are the references' own. On the CPU a decode step is
hundreds of small ops, so their count is what this set saves. tests/test_cpu_kernels.py checks every
op here against its reference.

Linear layers, 80% of a decode step, run on weights reordered once at load into oneDNN's blocked
layout (`prepack_linear_weight`, `prepacked_linear`; core.runtime.models.cpu_linear swaps them in): torch's own
F.linear goes to MKL, which runs a decode step's skinny products (a few rows) at 55 to 80% of the
prepacked oneDNN speed on this project's AMD Zen 4 CPU, and the LM head at 40%
(benchmarks/bench_cpu_linear.py). Their twin is F.linear on the plain weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixlm.kernels.reference import (  # noqa: F401  (re-exported: this set's ops of the same name)
    apply_token_bitmask,
    pack_token_mask,
    seeded_exponential,
    silu_and_mul,
)
from radixlm.kernels.quant_reference import fp8_linear, int4_linear  # noqa: F401  (re-exported)
from radixlm.kernels.reference import to_kv_dtype

# A group may hold this many padded (query, key) pairs beyond twice its real ones: small requests
# batch together even when their lengths differ, where a separate call would cost more than the padding.
_PADDING_SLACK = 1 << 14


def prepack_linear_weight(weight: torch.Tensor, batch_hint: int = 16) -> torch.Tensor | None:
    """`weight` [out, in] reordered into oneDNN's blocked layout for `prepacked_linear` (an opaque tensor
    of the same shape and dtype), or None where this torch build or CPU has no oneDNN linear for its
    dtype (fp16 needs AVX512-FP16): the caller keeps F.linear. `batch_hint` is the row count the
    layout is chosen for; any count runs on it."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
    except (RuntimeError, AttributeError):  # an unsupported dtype, or a torch without the op
        return None


def prepacked_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) on prepack_linear_weight(weight); x in the weight's dtype."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def store_kv(
    k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """reference.store_kv with index_copy_, which copies a few rows on the calling thread where indexed
    assignment starts a parallel region (on a busy 2-core machine, 20x slower). Like the reference, it
    takes slot indices of any integer dtype (index_copy_ wants int64). CPU torch has no index_copy_ for
    fp8, so an fp8 pool's bytes are copied through uint8 views."""
    loc = loc.long()
    for buffer, x in ((k_buffer, k), (v_buffer, v)):
        x = to_kv_dtype(x, buffer.dtype)
        if buffer.dtype.itemsize == 1:
            buffer, x = buffer.view(torch.uint8), x.view(torch.uint8)
        buffer.index_copy_(0, loc, x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """reference.rms_norm as torch's fused op (computed in fp32, returned in x's dtype)."""
    return F.rms_norm(x, weight.shape, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
    plan: AttentionPlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.apply_rotary as x * [cos | cos] + [x2 | x1] * [-sin | sin]: the same products and
    sums, on q and k together, in under half the ops. `plan` (the batch's, see `plan_attention`) keeps
    the step's [cos | cos] and [-sin | sin] rows for the other layers, which rotate the same positions."""
    tables = None if plan is None else plan.rotary
    if tables is None:
        cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
        tables = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
        if plan is not None:
            plan.rotary = tables
    cos2, sin2 = tables
    x = torch.cat((q, k), dim=1)
    # roll by half the head dim: [x1 | x2] -> [x2 | x1]
    rotated = (x * cos2 + x.roll(x.shape[-1] // 2, -1) * sin2).to(q.dtype)
    return rotated[:, :q.shape[1]], rotated[:, q.shape[1]:]


@dataclass
class _Group:
    """Requests attended in one call: their KV slots padded to max_len (padding reads slot 0) and the
    mask of what each query sees. `token`: the rows of q they own, None when the group is the whole
    batch in order (decode: q and the output are used as they are)."""

    token: torch.Tensor | None
    slots: torch.Tensor  # [n * max_len]
    mask: torch.Tensor | None  # [n, 1, max_ext, max_len]; None: every query sees every key
    q_valid: torch.Tensor | None  # [n, max_ext], extends only: which padded query rows are real
    n: int
    max_len: int


@dataclass
class AttentionPlan:
    """The batch layout every layer's attention shares (see `plan_attention`), and the rotary's rows of
    cos and sin for the step's positions (`apply_rotary` fills them at the first layer)."""

    groups: list[_Group]
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None


def plan_attention(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor | None,
    tree_mask: torch.Tensor | None = None,
) -> AttentionPlan:
    """The groups, KV slots and masks of a batch; extend_lens None means decode (one query each).
    `tree_mask`: the new tokens' ancestor bits (reference.extend_attention's), masking them as a tree."""
    seq_list = seq_lens.tolist()
    ext_list = [1] * len(seq_list) if extend_lens is None else extend_lens.tolist()
    starts, total = [], 0
    for e in ext_list:
        starts.append(total)
        total += e
    groups = _groups(ext_list, seq_list)
    whole = extend_lens is None and len(groups) == 1 and len(groups[0]) == len(seq_list)
    planned = []
    for group in groups:
        if whole:
            group.sort()
        planned.append(_plan_group(req_to_token, req_pool_indices, seq_lens, group, [starts[i] for i in group],
                                   [ext_list[i] for i in group], min(seq_list[i] for i in group),
                                   max(seq_list[i] for i in group), whole, tree_mask))
    return AttentionPlan(planned)


def _plan_group(req_to_token, req_pool_indices, seq_lens, group: list[int], starts: list[int], ext: list[int],
                min_len: int, max_len: int, whole: bool, tree_mask: torch.Tensor | None = None) -> _Group:
    device, n, max_ext = req_to_token.device, len(group), max(ext)
    index = torch.tensor(group, device=device)
    rows, lens = req_pool_indices[index], seq_lens[index]
    key_pos = torch.arange(max_len, device=device)
    key_valid = key_pos[None, :] < lens[:, None]  # [n, max_len]
    # Padding keys read slot 0, which always holds finite values, so that masked keys cannot turn the
    # weighted sum into NaN (0 * inf).
    slots = torch.where(key_valid, req_to_token[rows, :max_len], 0).reshape(-1)
    if max_ext == 1:
        token = None if whole else torch.tensor(starts, device=device)
        # Equal lengths (always so at batch 1) need no mask, and SDPA without one is cheaper.
        mask = None if min_len == max_len else key_valid[:, None, None, :]
        return _Group(token, slots, mask, None, n, max_len)
    ext_t = torch.tensor(ext, device=device)
    q_pos = torch.arange(max_ext, device=device)
    q_valid = q_pos[None, :] < ext_t[:, None]  # [n, max_ext]
    token = (torch.tensor(starts, device=device)[:, None] + q_pos[None, :])[q_valid]
    # Query i of request b sits at position seq_len - ext + i and sees the keys up to it. Padding
    # queries (i >= ext) see the whole sequence, so no row is empty; their outputs are dropped.
    limit = (lens - ext_t)[:, None] + q_pos[None, :]  # [n, max_ext]
    mask = (key_pos[None, None, :] <= limit[:, :, None]) & key_valid[:, None, :]
    if tree_mask is not None:
        mask &= _tree_keys(tree_mask, token, q_valid, (lens - ext_t)[:, None], key_pos)
    return _Group(token, slots, mask[:, None], q_valid, n, max_len)


def _tree_keys(tree_mask: torch.Tensor, token: torch.Tensor, q_valid: torch.Tensor, prefix: torch.Tensor,
               key_pos: torch.Tensor) -> torch.Tensor:
    """[n, max_ext, max_len]: which keys each (padded) query row may see by its ancestor bits: the prefix,
    and the new tokens whose bit it sets. Padding rows see everything (as in the causal mask)."""
    bits = torch.full(q_valid.shape, -1, dtype=torch.int64, device=q_valid.device)
    bits[q_valid] = tree_mask[token]
    rel = key_pos[None, None, :] - prefix[:, :, None]  # [n, 1, max_len]: a key's index among the new tokens
    return (rel < 0) | ((bits[:, :, None] >> rel.clamp(0, 63)) & 1 == 1)


def extend_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    sm_scale: float,
    plan: AttentionPlan | None = None,
    *,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """reference.extend_attention, batched: q [sum(extend_lens), H, D] packed request after request. A
    given `plan` carries the tree mask (plan_attention's)."""
    if plan is None:
        plan = plan_attention(req_to_token, req_pool_indices, seq_lens, extend_lens, tree_mask)
    return _attend(q, k_buffer, v_buffer, sm_scale, plan)


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """reference.decode_attention, batched: q [B, H, D], one query per request."""
    if plan is None:
        plan = plan_attention(req_to_token, req_pool_indices, seq_lens, None)
    return _attend(q, k_buffer, v_buffer, sm_scale, plan)


def _attend(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, sm_scale: float,
            plan: AttentionPlan) -> torch.Tensor:
    if len(plan.groups) == 1 and plan.groups[0].token is None:
        return _attend_group(q, k_buffer, v_buffer, sm_scale, plan.groups[0])
    # Zeros, not empty: rows no group covers (padding rows and a padded graph's spare tokens) must not carry
    # garbage, which their KV store would write into the reserved slot 0 that masked key positions gather.
    out = torch.zeros_like(q)
    for group in plan.groups:
        if group.q_valid is None:
            out[group.token] = _attend_group(q[group.token], k_buffer, v_buffer, sm_scale, group)
        else:
            q_pad = q.new_zeros(*group.q_valid.shape, *q.shape[1:])
            q_pad[group.q_valid] = q[group.token]
            out[group.token] = _attend_group(q_pad, k_buffer, v_buffer, sm_scale, group)[group.q_valid]
    return out


def _attend_group(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, sm_scale: float,
                  group: _Group) -> torch.Tensor:
    """q [n, H, D] (one query per request) or [n, max_ext, H, D] -> the same shape, attended over the
    group's keys and values (GQA: each KV head serves H / KH query heads)."""
    # Gathered keys and values are upcast to q's dtype (an fp8 pool's, only the group's rows).
    shape = (group.n, group.max_len, *k_buffer.shape[1:])
    k = k_buffer.index_select(0, group.slots).to(q.dtype).view(shape).transpose(1, 2)
    v = v_buffer.index_select(0, group.slots).to(q.dtype).view(shape).transpose(1, 2)
    queries = q.unsqueeze(1) if group.q_valid is None else q  # [n, max_ext, H, D]
    out = F.scaled_dot_product_attention(queries.transpose(1, 2), k, v, attn_mask=group.mask, scale=sm_scale,
                                         enable_gqa=True)
    return out.transpose(1, 2).reshape(q.shape)


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
