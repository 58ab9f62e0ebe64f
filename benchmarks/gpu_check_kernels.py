"""Checks every Triton kernel against its torch reference at real sizes on the GPU, and times it.

    python benchmarks/gpu_check_kernels.py                 # H200: Llama-3-8B shapes, bf16
    python benchmarks/gpu_check_kernels.py --sweep         # also time alternative attention launch shapes
    python benchmarks/gpu_check_kernels.py --kv-dtype fp8_e4m3   # the KV kernels on an fp8 pool
    TRITON_INTERPRET=1 python benchmarks/gpu_check_kernels.py --tiny   # CPU smoke run of this script

Errors are measured against the fp32 references on the same inputs: max |out - ref| and the relative
norm error |out - ref| / |ref|. Outputs are poisoned (NaN) before each checked call where the kernel
allocates them, so unwritten elements fail. Timings: CUDA events around the kernel alone, L2 flushed
before each run, warmup, median of --iters. Rates are printed against the ceilings measured on the
H200 (copy 4.2 TB/s, bf16 matmul 776 TFLOP/s). Exit code 1 on any mismatch.

With --kv-dtype fp8_e4m3 / fp8_e5m2 the KV pool of the attention, store and fused rotary-store checks is
fp8 (EngineOptions.kv_cache_dtype): the references read the same fp8 pool (upcast to fp32), and the
stores are checked against the references' saturating casts into a pool of the same dtype. Under the
interpreter (--tiny) fp8 stores mismatch: its fp32 -> fp8 cast rounds wrongly (triton-lang/triton#8322).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

if "--tiny" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from radixlm.core.runtime.options import KV_CACHE_DTYPES  # noqa: E402
from radixlm.core.runtime.execution.sampler import Sampler  # noqa: E402
from radixlm.core.runtime.sampling_params import SamplingParams  # noqa: E402
from radixlm.kernels import reference as ref  # noqa: E402
from radixlm.kernels import triton as tri  # noqa: E402
from radixlm.kernels.triton.attention import AttnConfig, decode_config, extend_config  # noqa: E402

COPY_BW = 4.2e12  # bytes/s, device-to-device copy measured on the H200
MATMUL_RATE = 776e12  # bf16 FLOP/s measured on the H200
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Row:
    kernel: str
    case: str
    max_err: float
    rel_err: float
    ok: bool
    ms: float
    rate: str


class Checker:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device("cpu" if args.tiny else "cuda")
        self.dtype = DTYPES[args.dtype]
        fp8 = KV_CACHE_DTYPES[args.kv_dtype]
        self.kv_dtype = getattr(torch, fp8) if fp8 else self.dtype
        self.rows: list[Row] = []
        self.tol = 1e-3 if self.dtype == torch.float32 else 1e-2
        # Larger than the H200's L2 (50 MB), written before each timed run to evict the inputs.
        self.flush = torch.empty(64 if args.tiny else 256 * 2**20, dtype=torch.int8, device=self.device)

    # ---- measuring

    def randn(self, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.randn(*shape, device=self.device, dtype=torch.float32).to(dtype or self.dtype)

    def poison(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Fills then frees a block of the output's size, which the caching allocator hands to the
        kernel's next allocation of that size (best effort), so unwritten outputs read as NaN."""
        if dtype.is_floating_point:
            torch.full(shape, float("nan"), dtype=dtype, device=self.device)

    def time_ms(self, fn: Callable[[], object]) -> float:
        for _ in range(self.args.warmup):
            fn()
        times = []
        for _ in range(self.args.iters):
            self.flush.zero_()
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def record(self, kernel: str, case: str, outs, refs, fn, bytes_moved: float = 0, flops: float = 0):
        max_err, rel_err, ok = 0.0, 0.0, True
        for out, expected in zip(outs, refs):
            out, expected = (t.float() if t.element_size() == 1 else t for t in (out, expected))  # fp8 pools
            diff = (out.double() - expected.double())
            finite = bool(torch.isfinite(out).all()) or not bool(torch.isfinite(expected).all())
            max_err = max(max_err, float(diff.abs().nan_to_num(float("inf")).max()) if out.numel() else 0.0)
            norm = float(expected.double().norm()) or 1.0
            rel = float(diff.norm()) / norm
            rel_err = max(rel_err, rel)
            ok = ok and finite and rel <= self.tol and out.shape == expected.shape
        ms = self.time_ms(fn)
        rate = []
        if bytes_moved:
            rate.append(f"{bytes_moved / ms / 1e6:.0f} GB/s ({100 * bytes_moved / ms * 1e3 / COPY_BW:.0f}% of copy)")
        if flops:
            rate.append(f"{flops / ms / 1e9:.1f} TFLOP/s ({100 * flops / ms * 1e3 / MATMUL_RATE:.0f}% of mm)")
        self.rows.append(Row(kernel, case, max_err, rel_err, ok, ms, ", ".join(rate)))
        print(f"{kernel:22s} {case:38s} max {max_err:.2e} rel {rel_err:.2e} {'ok' if ok else 'MISMATCH'}"
              f" {ms:10.4f} ms {', '.join(rate)}", flush=True)

    # ---- inputs

    def paged(self, seq_lens: list[int], num_kv_heads: int, head_dim: int):
        """A pool with random content everywhere and each request's positions on shuffled slots."""
        total = sum(seq_lens)
        num_slots = total + 16
        k_buf = self.randn(num_slots + 1, num_kv_heads, head_dim, dtype=self.kv_dtype)
        v_buf = self.randn(num_slots + 1, num_kv_heads, head_dim, dtype=self.kv_dtype)
        slots = (torch.randperm(num_slots, device=self.device)[:total] + 1).to(torch.int32)
        rows = len(seq_lens) + 8
        req_to_token = torch.randint(1, num_slots + 1, (rows, max(seq_lens) + 8), dtype=torch.int32,
                                     device=self.device)
        req_pool_indices = torch.randperm(rows, device=self.device)[: len(seq_lens)].to(torch.int32)
        start = 0
        for row, n in zip(req_pool_indices.tolist(), seq_lens):
            req_to_token[row, :n] = slots[start : start + n]
            start += n
        seq = torch.tensor(seq_lens, dtype=torch.int32, device=self.device)
        return k_buf, v_buf, req_to_token, req_pool_indices, seq

    # ---- checks

    def extend(self, case: str, prefix_lens: list[int], extend_lens: list[int], config: AttnConfig | None = None,
               new_kv: bool = False, split_short: bool = False):
        """new_kv: the new tokens' k and v also passed packed (as the engine does with a bf16 pool);
        split_short: the requests with few new tokens through the split kernel (a jump-forward step's)."""
        a = self.args
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        tables = self.paged(seq_lens, a.kv_heads, a.head_dim)
        packed = None
        if new_kv:
            k_buf, v_buf, req_to_token, rows, _ = tables
            slots = torch.cat([req_to_token[r, p : p + e].long()
                               for r, p, e in zip(rows.tolist(), prefix_lens, extend_lens)])
            packed = (k_buf[slots].to(self.dtype), v_buf[slots].to(self.dtype))
        q = self.randn(sum(extend_lens), a.heads, a.head_dim)
        ext = torch.tensor(extend_lens, dtype=torch.int32, device=self.device)
        starts = torch.cumsum(ext, 0) - ext
        scale = a.head_dim**-0.5
        expected = ref.extend_attention(q.float(), *(t.float() if t.is_floating_point() else t for t in tables),
                                        ext, scale).to(self.dtype)
        self.poison(q.shape, q.dtype)
        max_ext = max(extend_lens)
        call = lambda: tri.extend_attention(q, *tables, ext, scale, starts, max_ext, config=config,  # noqa: E731
                                            new_kv=packed, split_short=split_short)
        out = call()
        pairs = sum(e * p + e * (e + 1) // 2 for p, e in zip(prefix_lens, extend_lens))
        flops = 4 * pairs * a.heads * a.head_dim
        self.record("extend_attention", case, [out], [expected], call, flops=flops)

    def decode(self, case: str, seq_lens: list[int], config: AttnConfig | None = None, splits: int | None = None):
        a = self.args
        tables = self.paged(seq_lens, a.kv_heads, a.head_dim)
        q = self.randn(len(seq_lens), a.heads, a.head_dim)
        scale = a.head_dim**-0.5
        expected = ref.decode_attention(q.float(), *(t.float() if t.is_floating_point() else t for t in tables),
                                        scale).to(self.dtype)
        self.poison(q.shape, q.dtype)
        call = lambda: tri.decode_attention(q, *tables, scale, splits, config=config)  # noqa: E731
        out = call()
        elt = q.element_size()
        kv_bytes = 2 * sum(seq_lens) * a.kv_heads * a.head_dim * tables[0].element_size()
        self.record("decode_attention", case, [out], [expected], call, bytes_moved=kv_bytes + 2 * q.numel() * elt)

    def store_kv(self, num_tokens: int):
        a = self.args
        num_slots = 2 * num_tokens
        k_buf = self.randn(num_slots + 1, a.kv_heads, a.head_dim, dtype=self.kv_dtype)
        v_buf = self.randn(num_slots + 1, a.kv_heads, a.head_dim, dtype=self.kv_dtype)
        k_exp, v_exp = k_buf.clone(), v_buf.clone()
        kv = self.randn(num_tokens, 2, a.kv_heads, a.head_dim)
        kv[:2, 0, 0, :4] = 1e6 * torch.tensor([1, -1, 1, -1], device=self.device)  # past fp8's range: saturates
        k, v = kv[:, 0], kv[:, 1]  # strided, as out of a fused projection
        loc = (torch.randperm(num_slots, device=self.device)[:num_tokens] + 1).to(torch.int32)
        ref.store_kv(k_exp, v_exp, loc, k, v)
        tri.store_kv(k_buf, v_buf, loc, k, v)
        self.record("store_kv", f"T={num_tokens}{self._kv_tag(k_buf, [k_exp, v_exp], [k_buf, v_buf])}",
                    [k_buf, v_buf], [k_exp, v_exp], lambda: tri.store_kv(k_buf, v_buf, loc, k, v),
                    bytes_moved=2 * k.numel() * (k.element_size() + k_buf.element_size()))

    def _kv_tag(self, pool: torch.Tensor, expected: list[torch.Tensor], got: list[torch.Tensor]) -> str:
        """For an fp8 pool: its dtype and the share of stored bytes equal to the reference's."""
        if pool.element_size() != 1:
            return ""
        same = sum(int((e.view(torch.uint8) == g.view(torch.uint8)).sum()) for e, g in zip(expected, got))
        return f" {str(pool.dtype).removeprefix('torch.')} bytes equal {same / sum(e.numel() for e in expected):.4%}"

    def norms(self, num_tokens: int):
        a = self.args
        x, res, w = self.randn(num_tokens, a.hidden), self.randn(num_tokens, a.hidden), self.randn(a.hidden)
        self.poison(x.shape, x.dtype)
        out = tri.rms_norm(x, w, 1e-5)
        self.record("rms_norm", f"T={num_tokens}", [out], [ref.rms_norm(x.float(), w.float(), 1e-5).to(self.dtype)],
                    lambda: tri.rms_norm(x, w, 1e-5), bytes_moved=2 * x.numel() * x.element_size())
        exp_out, exp_sum = ref.fused_add_rms_norm(x, res, w, 1e-5)
        self.poison(x.shape, x.dtype)
        outs = tri.fused_add_rms_norm(x, res, w, 1e-5)
        self.record("fused_add_rms_norm", f"T={num_tokens}", list(outs), [exp_out, exp_sum],
                    lambda: tri.fused_add_rms_norm(x, res, w, 1e-5), bytes_moved=4 * x.numel() * x.element_size())

    def rotary_inputs(self, num_tokens: int):
        """q, k, v as strided views of one fused QKV output, positions, and a cos/sin cache of random angles."""
        a = self.args
        qkv = self.randn(num_tokens, (a.heads + 2 * a.kv_heads) * a.head_dim)
        q, k, v = qkv.split([a.heads * a.head_dim, a.kv_heads * a.head_dim, a.kv_heads * a.head_dim], dim=-1)
        q, k, v = (x.view(num_tokens, -1, a.head_dim) for x in (q, k, v))
        max_pos = 8192
        angles = torch.rand(max_pos, a.head_dim // 2, device=self.device, dtype=torch.float64) * 1000
        cache = torch.cat((angles.cos(), angles.sin()), dim=-1).float()
        positions = torch.randint(0, max_pos, (num_tokens,), device=self.device)
        return q, k, v, positions, cache

    def rotary(self, num_tokens: int):
        q, k, _, positions, cache = self.rotary_inputs(num_tokens)
        self.poison(q.shape, q.dtype)
        outs = tri.apply_rotary(q, k, positions, cache)
        expected = [t.to(self.dtype) for t in ref.apply_rotary(q.float(), k.float(), positions, cache)]
        moved = 2 * (q.numel() + k.numel()) * q.element_size()
        self.record("apply_rotary", f"T={num_tokens}", list(outs), expected,
                    lambda: tri.apply_rotary(q, k, positions, cache), bytes_moved=moved)

    def rotary_store_kv(self, num_tokens: int):
        """The fused kernel against its twin, then timed beside the unfused pair it replaces."""
        a = self.args
        q, k, v, positions, cache = self.rotary_inputs(num_tokens)
        num_slots = 2 * num_tokens
        k_buf = self.randn(num_slots + 1, a.kv_heads, a.head_dim, dtype=self.kv_dtype)
        v_buf = self.randn(num_slots + 1, a.kv_heads, a.head_dim, dtype=self.kv_dtype)
        loc = (torch.randperm(num_slots, device=self.device)[:num_tokens] + 1).to(torch.int32)
        if k_buf.element_size() == 1:
            # An fp8 pool: the reference stores the rotated k, rounded to the model's dtype as the kernel
            # does, into a pool of the same fp8 dtype (from fp32 its rounding would differ).
            k_exp, v_exp = k_buf.clone(), v_buf.clone()
            q_exp = ref.apply_rotary_store_kv(q, k, v, positions, cache, k_exp, v_exp, loc)
        else:
            k_exp, v_exp = k_buf.float(), v_buf.float()
            q_exp = ref.apply_rotary_store_kv(q.float(), k.float(), v.float(), positions, cache, k_exp, v_exp, loc)
        self.poison(q.shape, q.dtype)
        q_out = tri.apply_rotary_store_kv(q, k, v, positions, cache, k_buf, v_buf, loc)
        elt = q.element_size()
        tag = self._kv_tag(k_buf, [k_exp.to(k_buf.dtype), v_exp.to(v_buf.dtype)], [k_buf, v_buf])
        self.record("rotary_store_kv", f"T={num_tokens} fused{tag}", [q_out, k_buf, v_buf],
                    [q_exp.to(self.dtype), k_exp.to(self.dtype), v_exp.to(self.dtype)],
                    lambda: tri.apply_rotary_store_kv(q, k, v, positions, cache, k_buf, v_buf, loc),
                    bytes_moved=2 * (q.numel() + k.numel() + v.numel()) * elt)

        def pair():
            q_rot, k_rot = tri.apply_rotary(q, k, positions, cache)
            tri.store_kv(k_buf, v_buf, loc, k_rot, v)

        # The pair also writes the rotated k out and reads it back: 2 * |k| more bytes.
        self.record("rotary_store_kv", f"T={num_tokens} unfused pair (timing only)", [], [], pair,
                    bytes_moved=2 * (q.numel() + 2 * k.numel() + v.numel()) * elt)

    def silu(self, num_tokens: int):
        a = self.args
        gate_up = self.randn(num_tokens, 2 * a.inter)
        self.poison((num_tokens, a.inter), gate_up.dtype)
        out = tri.silu_and_mul(gate_up)
        expected = ref.silu_and_mul(gate_up.float()).to(self.dtype)
        self.record("silu_and_mul", f"T={num_tokens}", [out], [expected], lambda: tri.silu_and_mul(gate_up),
                    bytes_moved=1.5 * gate_up.numel() * gate_up.element_size())

    def sampling(self, batch: int):
        a = self.args
        allowed = torch.rand(batch, a.vocab, device=self.device) < 0.5
        bitmask = ref.pack_token_mask(allowed)
        logits = self.randn(batch, a.vocab, dtype=torch.float32)
        expected = logits.masked_fill(~allowed, float("-inf"))
        out = logits.clone()
        tri.apply_token_bitmask(out, bitmask)
        self.record("apply_token_bitmask", f"B={batch} V={a.vocab}", [out.nan_to_num()], [expected.nan_to_num()],
                    lambda: tri.apply_token_bitmask(out, bitmask),
                    bytes_moved=bitmask.numel() * 4 + allowed.numel() * 2)  # ~half the logits written
        # The engine's top-k/top-p/min-p filter is plain torch ops: timed here to see whether it needs a kernel.
        reqs = [SimpleNamespace(params=SamplingParams(top_k=50, top_p=0.9, min_p=0.05)) for _ in range(batch)]
        probs = torch.softmax(logits, dim=-1)
        self.record("sampler top-k/p/min-p", f"B={batch} V={a.vocab} (torch, timing only)", [], [],
                    lambda: Sampler._filter(probs, reqs))


def prefill_peers(c: Checker, batch: int, length: int) -> None:
    """Timing only: non-paged attention kernels on the prefill shape (no prefix), the ceilings a paged
    kernel is measured against: torch's SDPA backends and FlashAttention's varlen kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    a = c.args
    flops = 4 * batch * length * (length + 1) // 2 * a.heads * a.head_dim
    q = c.randn(batch, a.heads, length, a.head_dim)
    k, v = (c.randn(batch, a.kv_heads, length, a.head_dim) for _ in range(2))
    qt, kt, vt = (x.transpose(1, 2).reshape(batch * length, -1, a.head_dim) for x in (q, k, v))
    cu = torch.arange(0, batch + 1, device=c.device, dtype=torch.int32) * length

    def sdpa(backend):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    peers = {f"sdpa {b.name.lower()}": functools.partial(sdpa, b) for b in
             (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)}
    peers["flash varlen"] = lambda: torch.ops.aten._flash_attention_forward(
        qt, kt, vt, cu, cu, length, length, 0.0, True, False, scale=a.head_dim**-0.5)[0]
    for name, fn in peers.items():
        try:
            c.record(name, f"{batch}x{length} causal (timing only)", [], [], fn, flops=flops)
        except RuntimeError as e:  # a backend this build or device lacks
            print(f"{name}: {str(e)[:200]}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--kv-dtype", choices=list(KV_CACHE_DTYPES), default="auto",
                   help="the KV pool's dtype (auto: --dtype), as the engine's kv_cache_dtype")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--max-seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--inter", type=int, default=14336)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sweep", action="store_true", help="also time alternative attention launch shapes")
    p.add_argument("--tiny", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    args = p.parse_args(argv)
    if args.tiny:
        args.dtype = "fp32" if args.dtype == "bf16" else args.dtype  # the interpreter has no bf16 tl.dot
        args.batch, args.max_seq, args.heads, args.kv_heads, args.head_dim = 3, 40, 4, 2, 64
        args.hidden, args.inter, args.vocab, args.iters, args.warmup = 64, 96, 1000, 1, 0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        print("no CUDA device: run on the GPU machine, or pass --tiny for a CPU smoke run", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    c = Checker(args)
    if not args.tiny:
        print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {__import__('triton').__version__}")
    gen = torch.Generator().manual_seed(args.seed)

    def uniform(lo: int, hi: int, n: int) -> list[int]:
        return torch.randint(lo, hi + 1, (n,), generator=gen).tolist()

    b, s = args.batch, args.max_seq
    # Extend: ragged prefixes (some 0) and new tokens, all within max_seq; then the prefill shape of
    # the benchmarks (16 x 1024, no prefix) at the same batch scale when max_seq allows.
    prefixes = [p if i % 4 else 0 for i, p in enumerate(uniform(0, s // 2, b))]
    ragged = [max(1, e) for e in uniform(1, s // 2, b)]
    prefill, prefill_batch = min(1024, s), (2 if args.tiny else 16)
    for new_kv in (False, True):
        tag = ", new kv packed" if new_kv else ""
        c.extend(f"B={b} ragged<= {s}, prefixes{tag}", prefixes, ragged, new_kv=new_kv)
        c.extend(f"B={prefill_batch} x {prefill}, no prefix{tag}", [0] * prefill_batch, [prefill] * prefill_batch,
                 new_kv=new_kv)
    # A jump-forward step: most requests ride along with one token, a few compute forced text; with the
    # short ones through the split kernel (as the engine runs such steps) and without.
    riders = [1 if i % 6 else 2 + i % 7 for i in range(b)]
    for split_short in (False, True):
        c.extend(f"B={b} jump step (1-8 new tokens){', short split' if split_short else ''}", uniform(1, s // 2, b),
                 riders, new_kv=True, split_short=split_short)
    c.decode(f"B={b} ragged <= {s}", uniform(1, s, b))
    c.decode(f"B=1 L={s}", [s])
    c.decode(f"B=1 L={8 * s}", [8 * s])
    if not args.tiny:
        prefill_peers(c, prefill_batch, prefill)
    if args.sweep:
        for cfg in [AttnConfig(64, 32, 4, 3), AttnConfig(64, 64, 4, 3), AttnConfig(64, 32, 4, 4),
                    AttnConfig(128, 64, 8, 3), AttnConfig(128, 64, 8, 2), AttnConfig(128, 32, 8, 3),
                    AttnConfig(64, 64, 4, 2)]:
            for new_kv in (False, True):
                tag = f"cfg {tuple(cfg)}{' new' if new_kv else ''}"
                c.extend(f"{prefill_batch}x{prefill} {tag}", [0] * prefill_batch, [prefill] * prefill_batch,
                         config=cfg, new_kv=new_kv)
                c.extend(f"B={b} ragged {tag}", prefixes, ragged, config=cfg, new_kv=new_kv)
        for cfg in [AttnConfig(0, 32, 4, 2), AttnConfig(0, 64, 4, 3), AttnConfig(0, 128, 8, 2),
                    AttnConfig(0, 64, 8, 2), AttnConfig(0, 32, 2, 3)]:
            c.decode(f"B={b} L={s // 2} cfg {tuple(cfg)}", [s // 2] * b, config=cfg)
        for splits in (1, 4, 8, 16, 32, 64):
            c.decode(f"B=1 L={s} splits={splits}", [s], splits=splits)
    for tokens in (b, prefill_batch * prefill):
        c.store_kv(tokens)
        c.norms(tokens)
        c.rotary(tokens)
        c.silu(tokens)
    for tokens in (1, b, prefill_batch * prefill):  # 1: the batch-1 decode step
        c.rotary_store_kv(tokens)
    c.sampling(b)

    print(f"\ndefaults: extend {tuple(extend_config(args.head_dim, c.device))}, "
          f"decode {tuple(decode_config(args.head_dim, c.device))} (block_m, block_n, warps, stages)")
    print(f"{'kernel':23s}{'case':40s}{'rel err':>9s}{'ok':>5s}{'ms':>11s}  rate")
    for r in c.rows:
        print(f"{r.kernel:23s}{r.case:40s}{r.rel_err:9.1e}{'ok' if r.ok else 'FAIL':>5s}{r.ms:11.4f}  {r.rate}")
    failed = [r for r in c.rows if not r.ok]
    print(f"\n{len(c.rows) - len(failed)}/{len(c.rows)} ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
