"""Compiles every Triton kernel for Hopper (sm_90) without a GPU and prints what the compiler made.

    python benchmarks/compile_check_kernels.py [--dtype bf16] [--head-dim 128] [--kv-dtype fp8_e4m3] [--only gemv]

For each kernel at Llama-3-8B shapes: shared memory, registers, stack bytes (spills), and counts of the
SASS instructions that tell whether the Hopper habits took: HGMMA (warpgroup matrix ops) or HMMA
(older mma), LDGSTS (cp.async, software pipelining), LDG.E.128 (16-byte loads), LDL/STL (local memory,
i.e. spills). Arguments get the specialization the runtime gives them: unit inner strides become
constants, pointers and other strides are taken as 16-divisible. Needs only the triton package (its
bundled ptxas and cuobjdump); run it where TRITON_INTERPRET is unset. Layouts differ between Triton
releases: to see what the GPU image's (triton 3.6.0) makes, install that wheel apart and put it first,
`pip install --no-deps --target DIR triton==3.6.0; PYTHONPATH=DIR:... python benchmarks/compile_check_kernels.py`. --kv-dtype gives the KV pool's
pointers (the attention kernels' K and V, the stores' KBuf and VBuf) an fp8 type, as kv_cache_dtype does.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from radixlm.kernels.triton import attention, decode_gemv, elementwise, sampling

INDEX_PTRS = {"ReqToToken", "ReqPoolIndices", "SeqLens", "ExtendLens", "ExtendStartLoc", "Loc", "Positions"}
FP32_PTRS = {"PartOut", "PartLse", "CosSin", "Sums"}
FLOAT_ARGS = {"scale_log2", "eps"}
UNALIGNED_INTS = {"num_splits", "m"}  # sizes of real models (4096, 14336, 128256) are 16-divisible
SASS_OPS = ("HGMMA", "HMMA", "LDGSTS", "LDG.E.128", "LDL", "STL")
# Inside the main loop (the first backward branch's body): shared-memory round trips (layout conversions,
# cp.async reads), barriers, shuffles, and global loads by width.
LOOP_OPS = ("LDS", "STS", "LDSM", "BAR.SYNC", "SHFL", "LDG.E.128", "LDG.E.64", "LDG.E ", "LDG.E.U16")
# kv_cache_dtype -> (Triton pointer type, the stores' saturation constexpr SAT)
KV_TYPES = {"auto": (None, 0.0), "fp8_e4m3": ("fp8e4nv", 448.0), "fp8_e5m2": ("fp8e5", 57344.0)}
ATTENTION_POOL, STORE_POOL = {"K", "V"}, {"KBuf", "VBuf"}


def compile_for_hopper(kernel, constexprs: dict, dtype: str, index: str, num_warps: int, num_stages: int,
                       pool: set[str] = frozenset(), kv_type: str | None = None, pointers: dict | None = None):
    """`pointers`: types of pointer arguments that differ from the rule below (a 4-bit weight's words)."""
    signature, consts, attrs = {}, dict(constexprs), {}
    for i, name in enumerate(kernel.arg_names):
        if name in consts:
            signature[name] = "constexpr"
        elif name[0].isupper():  # pointer arguments are capitalized in these kernels
            if pointers and name in pointers:
                signature[name] = pointers[name]
            elif name == "Bitmask":
                signature[name] = "*i32"
            elif name == "TreeMask":  # a draft tree's ancestor bits, 64 a row
                signature[name] = "*i64"
            else:
                signature[name] = (f"*{index}" if name in INDEX_PTRS else "*fp32" if name in FP32_PTRS
                                   else f"*{kv_type}" if name in pool and kv_type else f"*{dtype}")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in FLOAT_ARGS:
            signature[name] = "fp32"
        elif re.fullmatch(r"stride_\w*[dc]", name):  # innermost strides are 1 at run time
            signature[name], consts[name] = "constexpr", 1
        else:
            signature[name] = "i32"
            if name not in UNALIGNED_INTS:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(kernel, signature, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages})


def report(label: str, compiled, num_warps: int, num_stages: int) -> None:
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    counts = " ".join(f"{op}={len(re.findall(re.escape(op) + r'[ .]', sass))}" for op in SASS_OPS)
    print(f"{label:34s} warps={num_warps} stages={num_stages} smem={compiled.metadata.shared:6d} "
          f"regs={regs.group(1) if regs else '?':>3s} stack={stack.group(1) if stack else '?':>3s}  {counts}")
    loop = _main_loop(sass)
    if loop:
        ops = " ".join(f"{op.strip()}={sum(o == op.strip() or o.startswith(op) for o in loop)}" for op in LOOP_OPS)
        print(f"{'':34s} main loop: {len(loop)} instructions; {ops}")


def _main_loop(sass: str) -> list[str]:
    """The opcodes (with modifiers) of the longest loop's body: from a backward branch's target to it (a
    kernel may run a short loop first, as the packed 4-bit GEMV's pass over x)."""
    code = re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
    loops = [[]]
    for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+@!?U?P\w+\s+BRA\s+(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", sass):
        if m.group(2) and int(m.group(2), 16) < int(m.group(1), 16):
            start, end = int(m.group(2), 16), int(m.group(1), 16)
            loops.append([op for addr, op in code if start <= int(addr, 16) <= end])
    return max(loops, key=len)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--index", choices=["i32", "i64"], default="i32")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--kv-dtype", choices=list(KV_TYPES), default="auto")
    p.add_argument("--only", help="compile only the kernels whose label contains this")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: this compiles the kernels, it does not interpret them", file=sys.stderr)
        return 2
    cuda = type("CudaDevice", (), {"type": "cuda"})()  # the launch-shape tables only look at .type
    d, block_d = args.head_dim, max(16, triton.next_power_of_2(args.head_dim))
    group = args.heads // args.kv_heads
    precision = "ieee" if args.dtype == "fp32" else "tf32"
    kv_type, sat = KV_TYPES[args.kv_dtype]
    ext, dec = attention.extend_config(d, cuda), attention.decode_config(d, cuda)
    jobs = [
        *((f"extend_attention{' (new kv)' if new_kv else ''}{' (tree)' if tree else ''}", attention._extend_kernel,
           ext.num_warps, ext.num_stages,
           dict(GROUP=group, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=ext.block_m, BLOCK_N=ext.block_n,
                PRECISION=precision, NEW_KV=new_kv, SKIP_SHORT=attention.SHORT_EXTEND_TOKENS, TREE=tree),
           ATTENTION_POOL) for new_kv, tree in ((False, False), (True, False), (False, True))),
        ("decode_attention (split)", attention._decode_split_kernel, dec.num_warps, dec.num_stages,
         dict(GROUP=group, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_H=max(16, triton.next_power_of_2(group)),
              BLOCK_N=dec.block_n, PRECISION=precision, DIRECT=False, TOKENS=1), ATTENTION_POOL),
        ("decode_attention (reduce)", attention._decode_reduce_kernel, 4, 3,
         dict(HEAD_DIM=d, BLOCK_D=block_d, BLOCK_S=4, TOKENS=1)),
        ("store_kv", elementwise._store_kv_kernel, 4, 3,
         dict(NUM_KV_HEADS=args.kv_heads, HEAD_DIM=d, BLOCK_H=triton.next_power_of_2(args.kv_heads), BLOCK_D=block_d,
              SAT=sat), STORE_POOL),
        ("rms_norm", elementwise._rms_norm_kernel, elementwise._row_warps(triton.next_power_of_2(args.hidden)), 3,
         dict(HAS_RESIDUAL=False, BLOCK=triton.next_power_of_2(args.hidden))),
        ("fused_add_rms_norm", elementwise._rms_norm_kernel, elementwise._row_warps(triton.next_power_of_2(args.hidden)), 3,
         dict(HAS_RESIDUAL=True, BLOCK=triton.next_power_of_2(args.hidden))),
        ("silu_and_mul", elementwise._silu_and_mul_kernel, 4, 3, dict(BLOCK=1024)),
        ("apply_rotary", elementwise._rotary_kernel, 4, 3,
         dict(NUM_HEADS=args.heads, NUM_KV_HEADS=args.kv_heads, HALF=d // 2, BLOCK_H=triton.next_power_of_2(args.heads),
              BLOCK_KH=triton.next_power_of_2(args.kv_heads), BLOCK_HALF=triton.next_power_of_2(d // 2))),
        ("apply_rotary_store_kv", elementwise._rotary_store_kv_kernel, 4, 3,
         dict(NUM_HEADS=args.heads, NUM_KV_HEADS=args.kv_heads, HEAD_DIM=d, HALF=d // 2,
              BLOCK_H=triton.next_power_of_2(args.heads), BLOCK_KH=triton.next_power_of_2(args.kv_heads),
              BLOCK_HALF=triton.next_power_of_2(d // 2), BLOCK_D=block_d, SAT=sat, K_OUT=True), STORE_POOL),
        ("apply_token_bitmask", sampling._token_bitmask_kernel, 8, 3, dict(BLOCK=4096)),
    ]
    # The decode GEMVs with the launch shapes the 8B shapes get (the LM head plain, gate_up scaled by its
    # norm, down with its SiLU and the residual epilogue), at 1 and 8 rows.
    for rows in (1, 8):
        for name, flags, (n, k) in (("gemv", {}, (128256, 4096)), ("rms_scaled_gemv", dict(SCALED=True), (28672, 4096)),
                                    ("residual_gemv silu", dict(SILU=True, RESIDUAL=True), (4096, 14336))):
            block_n, block_k, warps, stages = decode_gemv.gemv_config(rows, n, k)
            jobs.append((f"{name} M={rows} {block_n}x{block_k}", decode_gemv._gemv_kernel, warps, stages,
                         dict(dict(SILU=False, SCALED=False, RESIDUAL=False), **flags, HAS_BIAS=False,
                              W_SCALED=False, INT4=False, BLOCK_M=triton.next_power_of_2(rows), BLOCK_N=block_n,
                              BLOCK_K=block_k, BLOCK_S=512 if flags.get("SCALED") else 1, STAGES=stages,
                              EVEN_K=False, PACKED=False)))
    # The four fused products of a layer on 4-bit weights (AWQ/GPTQ: pack_int4's int32 words, fp32 scales and
    # zeros) at one row, the down projection with the SiLU inside or not as INT4_FUSED_SILU says, each on the
    # fp32 path and the packed one (fp16x2); the label gives the weights a lane takes a step (the
    # register-prefetch loop, stages 1, is unrolled twice).
    int4_ptrs = {"W": "*i32", "WScale": "*fp32", "WZero": "*fp32"}
    for (name, flags, (n, k)), packed in itertools.product((("int4 rms_scaled_gemv qkv", dict(SCALED=True), (6144, 4096)),
                                ("int4 residual_gemv o", dict(RESIDUAL=True), (4096, 4096)),
                                ("int4 rms_scaled_gemv gate_up", dict(SCALED=True), (28672, 4096)),
                                ("int4 residual_gemv down", dict(SILU=decode_gemv.INT4_FUSED_SILU, RESIDUAL=True),
                                 (4096, 14336))), (False, True)):
        block_n, block_k, warps, stages = decode_gemv.gemv_config(1, n, k, 0.5)
        per_lane = block_n * block_k // (32 * warps)
        jobs.append((f"{name}{' silu' if flags.get('SILU') else ''}{' packed' if packed else ''} M=1 "
                     f"{block_n}x{block_k} ({per_lane} a lane)",
                     decode_gemv._gemv_kernel, warps, stages,
                     dict(dict(SILU=False, SCALED=False, RESIDUAL=False), **flags, HAS_BIAS=False, W_SCALED=False,
                          INT4=True, BLOCK_M=1, BLOCK_N=block_n, BLOCK_K=block_k,
                          BLOCK_S=512 if flags.get("SCALED") else 1, STAGES=stages, EVEN_K=k % block_k == 0,
                          PACKED=packed), frozenset(), int4_ptrs))
    # The qkv GEMV with the rotary and the KV store in its epilogue (1 row, scaled; 8 rows, after the
    # first layer's norm; 1 row on 4-bit weights), storing into the pool.
    for rows, scaled, int4, packed in ((1, True, False, False), (8, False, False, False), (1, True, True, False),
                                       (1, True, True, True)):
        block_n, block_k, warps, stages = decode_gemv.gemv_config(rows, (args.heads + 2 * args.kv_heads) * d, 4096,
                                                                  0.5 if int4 else 2)
        jobs.append((f"{'int4 ' if int4 else ''}rotary_qkv_gemv{' packed' if packed else ''} M={rows} "
                     f"{block_n}x{block_k}",
                     decode_gemv._rotary_qkv_kernel, warps, stages,
                     dict(NUM_HEADS=args.heads, NUM_KV_HEADS=args.kv_heads, HEAD_DIM=d, HAS_BIAS=False, SCALED=scaled,
                          W_SCALED=False, INT4=int4, BLOCK_M=triton.next_power_of_2(rows), PAIRS=block_n // 2,
                          BLOCK_K=block_k, BLOCK_S=512 if scaled else 1, STAGES=stages, SAT=sat,
                          EVEN_K=int4 and 4096 % block_k == 0, PACKED=packed), STORE_POOL,
                     int4_ptrs if int4 else None))
    print(f"triton {triton.__version__}, sm_90, {args.dtype}, {args.index} indices, head_dim {d}, GQA {group}, "
          f"KV pool {kv_type or args.dtype}")
    for label, kernel, warps, stages, constexprs, *extra in jobs:
        if args.only and args.only not in label:
            continue
        compiled = compile_for_hopper(kernel, constexprs, args.dtype, args.index, warps, stages,
                                      pool=extra[0] if extra else frozenset(), kv_type=kv_type,
                                      pointers=extra[1] if len(extra) > 1 else None)
        report(label, compiled, warps, stages)
    return 0


if __name__ == "__main__":
    sys.exit(main())
