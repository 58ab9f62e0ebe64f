"""Pure-torch reference twins of every kernel.

The CPU path runs these; the Triton kernels are tested against them. Shapes follow one convention:
KV pools are per-layer tensors ``[num_slots, num_kv_heads, head_dim]``; ``req_to_token[r, i]`` is the
KV slot holding position ``i`` of request row ``r``. Attention reads all keys and values (the cached
prefix and the new tokens alike) through that table, so new tokens must be stored before attending.
A pool may be of another dtype than the model's (fp8: EngineOptions.kv_cache_dtype): stores cast into it
(`to_kv_dtype`), attention upcasts what it reads.
"""

from __future__ import annotations

import torch

from radixlm.kernels.quant_reference import int4_linear

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32, returned in the input dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual): the residual stream and its normalized form."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gate_up`` holds [gate | up] along the last dim; returns silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


# The most rows the GEMV ops take (kernel sets' GEMVs are built for decode batches; more rows want a GEMM).
GEMV_MAX_ROWS = 16


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         weight_scale: torch.Tensor | None = None, weight_zero: torch.Tensor | None = None) -> torch.Tensor:
    """A linear layer on a few rows (decode): x [M, K], weight [N, K] -> [M, N]. With `weight_scale` [N]
    (fp32), weight holds fp8 values and row n of the real weight is weight[n] * weight_scale[n]; with
    `weight_zero` too, weight is 4-bit (quant_reference.pack_int4's words [N, K / 8], fp32 scales and
    zeros [N, K / group]: ``quant_reference.int4_linear``)."""
    if weight_zero is not None:
        return int4_linear(x, weight, weight_scale, weight_zero, bias)
    if weight_scale is not None:
        out = torch.nn.functional.linear(x.float(), weight.float() * weight_scale[:, None])
        return (out if bias is None else out + bias.float()).to(x.dtype)
    return torch.nn.functional.linear(x, weight, bias)


def residual_gemv(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, silu: bool = False,
    weight_scale: torch.Tensor | None = None, weight_zero: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A projection ending a sublayer with the residual add and the next RMSNorm's first half after it:
    returns h = gemv(x) + residual (the residual stream), h * norm_weight, and h's sum of squares [M, 1]
    in fp32 (kernel sets may return it as several partial sums per row: [M, S]). With `silu`, x holds
    [gate | up] and ``silu_and_mul`` goes first."""
    h = gemv(silu_and_mul(x) if silu else x, weight, weight_scale=weight_scale, weight_zero=weight_zero) + residual
    return h, h * norm_weight, h.float().pow(2).sum(-1, keepdim=True)


def rms_scaled_gemv(x: torch.Tensor, sums: torch.Tensor, eps: float, weight: torch.Tensor,
                    bias: torch.Tensor | None = None, weight_scale: torch.Tensor | None = None,
                    weight_zero: torch.Tensor | None = None) -> torch.Tensor:
    """The projection after an RMSNorm given as ``residual_gemv``'s second and third outputs: x is the
    norm's input times its weight, `sums` the input's sums of squares (summed over the last dim)."""
    rstd = torch.rsqrt(sums.sum(-1, keepdim=True) / x.shape[-1] + eps)
    return gemv((x.float() * rstd).to(x.dtype), weight, bias, weight_scale, weight_zero)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half) rotary embedding, as Llama/Mistral/Qwen2 checkpoints in HF format use.

    q: [T, H, D], k: [T, KH, D], positions: [T], cos_sin_cache: [max_pos, D] holding [cos | sin] halves.
    """
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [T, D/2] each
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def kv_saturation(dtype: torch.dtype) -> float | None:
    """The largest finite value of an fp8 KV dtype (values beyond it are clamped there on store), None
    for wider dtypes. Unclamped, such values become inf (e5m2) or, in casts that do not saturate, NaN
    (e4m3fn has no infinity), and one NaN key poisons every later attention over it."""
    return float(torch.finfo(dtype).max) if dtype.itemsize == 1 else None


def to_kv_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x cast to a KV pool's dtype; into fp8 a saturating cast (no scale: values are stored as they are)."""
    limit = kv_saturation(dtype)
    return (x if limit is None else x.clamp(-limit, limit)).to(dtype)


def store_kv(
    k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Writes the new tokens' keys and values into their pool slots, cast to the pool's dtype."""
    k_buffer[loc] = to_kv_dtype(k, k_buffer.dtype)
    v_buffer[loc] = to_kv_dtype(v, v_buffer.dtype)


def apply_rotary_store_kv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
    k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor, k_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``apply_rotary`` then ``store_kv`` of the rotated k and v; returns the rotated q, and copies the
    rotated k into `k_out` where given. Kernel sets may fuse the two (one launch per layer instead of
    two); the attention backend composes them where not."""
    q, k = apply_rotary(q, k, positions, cos_sin_cache)
    store_kv(k_buffer, v_buffer, loc, k, v)
    if k_out is not None:
        k_out.copy_(k)
    return q


def rotary_qkv_gemv(
    x: torch.Tensor, sums: torch.Tensor | None, eps: float, weight: torch.Tensor, bias: torch.Tensor | None,
    positions: torch.Tensor, cos_sin_cache: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
    loc: torch.Tensor, num_heads: int, num_kv_heads: int, weight_scale: torch.Tensor | None = None,
    weight_zero: torch.Tensor | None = None,
) -> torch.Tensor:
    """A decode layer's qkv projection (``rms_scaled_gemv``; ``gemv`` of an already normed x where `sums`
    is None) then ``apply_rotary_store_kv``: returns the rotated q [M, H, D]."""
    qkv = (gemv(x, weight, bias, weight_scale, weight_zero) if sums is None
           else rms_scaled_gemv(x, sums, eps, weight, bias, weight_scale, weight_zero))
    head_dim = cos_sin_cache.shape[-1]
    q, k, v = qkv.view(qkv.shape[0], -1, head_dim).split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    return apply_rotary_store_kv(q, k, v, positions, cos_sin_cache, k_buffer, v_buffer, loc)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, sm_scale: float):
    """q: [Lq, H, D]; k, v: [Lk, KH, D] with H a multiple of KH (GQA); mask: [Lq, Lk] bool, True = keep."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * sm_scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def extend_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    sm_scale: float,
    *,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its whole sequence (prefix + new tokens).

    q: [sum(extend_lens), H, D], packed request after request. Request b's new tokens sit at positions
    ``seq_lens[b] - extend_lens[b] .. seq_lens[b] - 1``. Returns [sum(extend_lens), H, D] in q's dtype.

    ``tree_mask`` (int64 [sum(extend_lens)]; a verify step of a draft tree): new token i of a request sees
    its prefix and its new token j only where bit j of tree_mask[i] is set (its ancestors in the tree and
    itself; ``ancestor_bits`` makes them from parent indices); None: every new token j <= i (causal).
    """
    out = torch.empty_like(q)
    start = 0
    for row, seq_len, ext in zip(req_pool_indices.tolist(), seq_lens.tolist(), extend_lens.tolist()):
        slots = req_to_token[row, :seq_len].long()
        prefix = seq_len - ext
        q_pos = torch.arange(prefix, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        if tree_mask is not None:
            new = torch.arange(ext, device=q.device)
            mask[:, prefix:] = (tree_mask[start:start + ext, None] >> new[None, :]) & 1 == 1
        out[start : start + ext] = _attend(
            q[start : start + ext], k_buffer[slots], v_buffer[slots], mask, sm_scale
        ).to(q.dtype)
        start += ext
    return out


def ancestor_bits(parents: list[int]) -> list[int]:
    """One request's tree_mask (``extend_attention``) from its new tokens' parents: parents[i] < i is the
    new token before i on its path, -1 for a token that follows the prefix. At most 64 tokens (the mask of
    a token is one int64, its bit 63 the sign)."""
    if len(parents) > 64:
        raise ValueError(f"a tree of {len(parents)} tokens: at most 64 are masked")
    bits: list[int] = []
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"token {i}'s parent {parent} is not an earlier token")
        bits.append((bits[parent] if parent >= 0 else 0) | 1 << i)
    return [b - (1 << 64) if b >= 1 << 63 else b for b in bits]


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """One query per request over its whole sequence. q: [B, H, D]; returns [B, H, D]."""
    out = torch.empty_like(q)
    for b, (row, seq_len) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        slots = req_to_token[row, :seq_len].long()
        out[b] = _attend(q[b : b + 1], k_buffer[slots], v_buffer[slots], None, sm_scale)[0].to(q.dtype)
    return out


def pack_token_mask(allowed: torch.Tensor) -> torch.Tensor:
    """Bool [..., V] (True = allowed) -> int32 bitmask [..., ceil(V / 32)]: bit j of word w is token 32w + j.

    A vocabulary of 128k tokens packs into 16 KiB per row instead of 128 KiB of bools, which is what
    crosses to the device each constrained step.
    """
    vocab = allowed.shape[-1]
    padded = torch.nn.functional.pad(allowed.to(torch.int64), (0, -vocab % 32))
    words = (padded.unflatten(-1, (-1, 32)) << torch.arange(32, device=allowed.device)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: logits[b, v] = -inf where bit v % 32 of bitmask[b, v // 32] is 0 (token v not allowed).

    logits: [B, V]; bitmask: int32 [B, W] with 32 * W >= V (see ``pack_token_mask``).
    """
    vocab = logits.shape[-1]
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, device=bitmask.device, dtype=torch.int32)) & 1
    allowed = bits.flatten(-2)[..., :vocab].bool()
    logits.masked_fill_(~allowed, float("-inf"))


_M32 = 0xFFFFFFFF


def seeded_exponential(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise float32 [len(keys), vocab], a pure function of (key, token id): a 32-bit integer
    hash of key + id * golden ratio, in int64 arithmetic (every product stays below 2**63), made a
    uniform in (0, 1) by ``unit_interval`` and then -log. keys: int64 [S], each in [0, 2**32)."""
    ids = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    x = (keys[:, None] + ids[None, :] * 0x9E3779B1) & _M32
    for _ in range(2):
        x = ((x ^ (x >> 16)) * 0x045D9F3B) & _M32
    return -torch.log(unit_interval(x ^ (x >> 16)))


def unit_interval(bits: torch.Tensor) -> torch.Tensor:
    """32-bit integers to float32 in (0, 1), both ends excluded: the top 23 bits, centred. (With 24
    bits the largest value rounds up to 1.0, whose -log is a zero noise: 0 / 0 for a banned token.)"""
    return ((bits >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))
