"""Row-wise and element-wise kernels of a Llama layer: KV store, RMSNorm, rotary (alone or fused with the
KV store), SiLU-and-mul.

Each computes in fp32 and rounds once to the output dtype, like its twin in ``reference``. Stores into
an fp8 KV pool saturate (``reference.to_kv_dtype``): the ``SAT`` constexpr is the format's largest
finite value, 0 for pools of a wider dtype.
Inputs may be strided views (q, k, v sliced out of a fused QKV projection); the last dim must be
contiguous only where noted.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixlm.kernels.reference import kv_saturation


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as a 2D [rows, last dim] tensor, a view where the layout allows."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _row_warps(block: int) -> int:
    return max(1, min(16, block // 512))


def kv_limit(buffer: torch.Tensor) -> float:
    """The clamp a store into `buffer` applies (an fp8 pool's largest finite value), else 0: none."""
    return kv_saturation(buffer.dtype) or 0.0


@triton.jit
def to_kv(x, Out, SAT: tl.constexpr):
    """x cast to Out's element type, clamped to [-SAT, SAT] first when SAT > 0 (an fp8 pool; in fp32,
    which holds any input exactly)."""
    if SAT > 0:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -SAT), SAT)
    return x.to(Out.dtype.element_ty)


@triton.jit
def _copy_heads(
    XRow, OutRow, stride_xh, stride_xd, stride_oh, stride_od,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    SAT: tl.constexpr,
):
    """One token's [NUM_HEADS, HEAD_DIM] rows from XRow to OutRow, cast to Out's dtype."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < NUM_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    x = tl.load(XRow + offs_h[:, None] * stride_xh + offs_d[None, :] * stride_xd, mask=mask)
    tl.store(OutRow + offs_h[:, None] * stride_oh + offs_d[None, :] * stride_od, to_kv(x, OutRow, SAT), mask=mask)


@triton.jit
def _store_kv_kernel(
    K, V, KBuf, VBuf, Loc,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kbs, stride_kbh, stride_kbd,
    stride_vbs, stride_vbh, stride_vbd,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    SAT: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(Loc + token).to(tl.int64)
    _copy_heads(K + token * stride_kt, KBuf + slot * stride_kbs, stride_kh, stride_kd, stride_kbh, stride_kbd,
                NUM_KV_HEADS, HEAD_DIM, BLOCK_H, BLOCK_D, SAT)
    _copy_heads(V + token * stride_vt, VBuf + slot * stride_vbs, stride_vh, stride_vd, stride_vbh, stride_vbd,
                NUM_KV_HEADS, HEAD_DIM, BLOCK_H, BLOCK_D, SAT)


def store_kv(
    k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Writes k, v [T, KH, D] into pool slots loc [T] (int32 or int64). Twin: ``reference.store_kv``."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_buffer, v_buffer, loc,
        *k.stride(), *v.stride(), *k_buffer.stride(), *v_buffer.stride(),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        SAT=kv_limit(k_buffer), num_warps=4,
    )


@triton.jit
def _rms_norm_kernel(
    X, Residual, W, Y, SumOut,
    stride_x, stride_r, stride_y, stride_s,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(Residual + row * stride_r + offs, mask=mask, other=0.0)
        # Rounded to the stream's dtype before normalizing, as the reference's `x + residual` is.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(SumOut.dtype.element_ty)
        tl.store(SumOut + row * stride_s + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + offs, (xf * rstd * w).to(Y.dtype.element_ty), mask=mask)


def _launch_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    x2 = _rows(x)
    n_rows, n_cols = x2.shape
    y = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    summed = r2 = None
    if residual is not None:
        assert residual.dtype == x.dtype, "x and residual must share a dtype (the sum is stored in it)"
        r2 = _rows(residual)
        summed = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    if n_rows:
        block = triton.next_power_of_2(n_cols)
        _rms_norm_kernel[(n_rows,)](
            x2, r2 if r2 is not None else x2, weight, y, summed if summed is not None else y,
            x2.stride(0), (r2 if r2 is not None else x2).stride(0), y.stride(0),
            (summed if summed is not None else y).stride(0),
            n_cols, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_row_warps(block),
        )
    y = y.view(x.shape)
    return y, (summed.view(x.shape) if summed is not None else None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, fp32 inside. Twin: ``reference.rms_norm``."""
    return _launch_rms_norm(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass. Twin: ``reference.fused_add_rms_norm``."""
    y, summed = _launch_rms_norm(x, residual, weight, eps)
    return y, summed


@triton.jit
def load_x(X, offs, mask, k, SILU: tl.constexpr):
    """x at X + offs in fp32; with SILU, x holds [gate | up] and this is silu(gate) * up rounded to the
    activation dtype, as silu_and_mul's output."""
    if SILU:
        gate = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(X + offs + k, mask=mask, other=0.0).to(tl.float32)
        x = (gate * tl.sigmoid(gate) * up).to(X.dtype.element_ty).to(tl.float32)
    else:
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def _silu_and_mul_kernel(
    GateUp, Out, stride_g, stride_o, n_cols, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    gate = tl.load(GateUp + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(GateUp + row * stride_g + n_cols + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(Out + row * stride_o + offs, out.to(Out.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] holding [gate | up] -> silu(gate) * up [..., I]. Twin: ``reference.silu_and_mul``."""
    x2 = _rows(gate_up)
    n_rows, width = x2.shape
    n_cols = width // 2
    out = torch.empty((n_rows, n_cols), dtype=gate_up.dtype, device=gate_up.device)
    if n_rows:
        block = min(1024, triton.next_power_of_2(n_cols))
        _silu_and_mul_kernel[(n_rows, triton.cdiv(n_cols, block))](
            x2, out, x2.stride(0), out.stride(0), n_cols, BLOCK=block, num_warps=4
        )
    return out.view(*gate_up.shape[:-1], n_cols)


@triton.jit
def _rotate_heads(
    XRow, OutRow, stride_xh, stride_xd, stride_oh, stride_od, cos, sin,
    NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    SAT: tl.constexpr,
):
    """One token's heads rotated from XRow to OutRow. The result is rounded to X's dtype first (where the
    reference's rotary leaves it) and then cast to Out's, which differs only when storing into a pool of
    another dtype."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h < NUM_HEADS)[:, None] & (offs_d < HALF)[None, :]
    base = XRow + offs_h[:, None] * stride_xh + offs_d[None, :] * stride_xd
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF * stride_xd, mask=mask, other=0.0).to(tl.float32)
    out = OutRow + offs_h[:, None] * stride_oh + offs_d[None, :] * stride_od
    dtype = XRow.dtype.element_ty
    tl.store(out, to_kv((x1 * cos - x2 * sin).to(dtype), OutRow, SAT), mask=mask)
    tl.store(out + HALF * stride_od, to_kv((x2 * cos + x1 * sin).to(dtype), OutRow, SAT), mask=mask)


@triton.jit
def _cos_sin(CosSin, Positions, token, stride_cp, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """The token's cos and sin halves, fp32 [1, BLOCK_HALF] each, ready to broadcast over heads."""
    pos = tl.load(Positions + token).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    cos = tl.load(CosSin + pos * stride_cp + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(CosSin + pos * stride_cp + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    return cos, sin


@triton.jit
def _rotary_kernel(
    Q, K, QOut, KOut, Positions, CosSin,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
    stride_oqt, stride_oqh, stride_oqd, stride_okt, stride_okh, stride_okd,
    stride_cp,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cos, sin = _cos_sin(CosSin, Positions, token, stride_cp, HALF, BLOCK_HALF)
    _rotate_heads(Q + token * stride_qt, QOut + token * stride_oqt, stride_qh, stride_qd, stride_oqh, stride_oqd,
                  cos, sin, NUM_HEADS, HALF, BLOCK_H, BLOCK_HALF, 0.0)
    _rotate_heads(K + token * stride_kt, KOut + token * stride_okt, stride_kh, stride_kd, stride_okh, stride_okd,
                  cos, sin, NUM_KV_HEADS, HALF, BLOCK_KH, BLOCK_HALF, 0.0)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox rotate-half rotary on q [T, H, D] and k [T, KH, D], one program per token.

    The cache [max_pos, D] ([cos | sin]) is precomputed, so llama3 or any other frequency scaling is
    the cache builder's business. The cache's last dim must be contiguous. Twin: ``reference.apply_rotary``.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    assert cos_sin_cache.stride(-1) == 1, "cos_sin_cache must be contiguous along its last dim"
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        q, k, q_out, k_out, positions, cos_sin_cache,
        *q.stride(), *k.stride(), *q_out.stride(), *k_out.stride(), cos_sin_cache.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=half,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_KH=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half), num_warps=4,
    )
    return q_out, k_out


@triton.jit
def _rotary_store_kv_kernel(
    Q, K, V, QOut, KOut, KBuf, VBuf, Positions, CosSin, Loc,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_oqt, stride_oqh, stride_oqd, stride_okt, stride_okh, stride_okd,
    stride_kbs, stride_kbh, stride_kbd, stride_vbs, stride_vbh, stride_vbd,
    stride_cp,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
    SAT: tl.constexpr, K_OUT: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(Loc + token).to(tl.int64)
    cos, sin = _cos_sin(CosSin, Positions, token, stride_cp, HALF, BLOCK_HALF)
    _rotate_heads(Q + token * stride_qt, QOut + token * stride_oqt, stride_qh, stride_qd, stride_oqh, stride_oqd,
                  cos, sin, NUM_HEADS, HALF, BLOCK_H, BLOCK_HALF, 0.0)
    _rotate_heads(K + token * stride_kt, KBuf + slot * stride_kbs, stride_kh, stride_kd, stride_kbh, stride_kbd,
                  cos, sin, NUM_KV_HEADS, HALF, BLOCK_KH, BLOCK_HALF, SAT)
    if K_OUT:
        _rotate_heads(K + token * stride_kt, KOut + token * stride_okt, stride_kh, stride_kd, stride_okh, stride_okd,
                      cos, sin, NUM_KV_HEADS, HALF, BLOCK_KH, BLOCK_HALF, 0.0)
    _copy_heads(V + token * stride_vt, VBuf + slot * stride_vbs, stride_vh, stride_vd, stride_vbh, stride_vbd,
                NUM_KV_HEADS, HEAD_DIM, BLOCK_KH, BLOCK_D, SAT)


def apply_rotary_store_kv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
    k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor, k_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``apply_rotary`` and ``store_kv`` in one launch: returns the rotated q [T, H, D]; k, rotated, and v
    [T, KH, D] go straight into pool slots loc [T], and the rotated k into `k_out` [T, KH, D] where given
    (for an extend's attention to read it packed). One program per token.
    Twin: ``reference.apply_rotary_store_kv``."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    assert cos_sin_cache.stride(-1) == 1, "cos_sin_cache must be contiguous along its last dim"
    half = head_dim // 2
    k_rot = k_out if k_out is not None else q_out  # a placeholder the kernel never touches
    _rotary_store_kv_kernel[(num_tokens,)](
        q, k, v, q_out, k_rot, k_buffer, v_buffer, positions, cos_sin_cache, loc,
        *q.stride(), *k.stride(), *v.stride(), *q_out.stride(), *k_rot.stride(), *k_buffer.stride(),
        *v_buffer.stride(), cos_sin_cache.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=half,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_KH=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half), BLOCK_D=triton.next_power_of_2(head_dim),
        SAT=kv_limit(k_buffer), K_OUT=k_out is not None, num_warps=4,
    )
    return q_out
