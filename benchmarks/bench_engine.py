"""Engine benchmarks: batch-1 latency, offline throughput, prefill, and the CPU cost of a decode step,
with HF transformers `generate` on the same weights and workloads as the peer, in one run.

    python benchmarks/bench_engine.py --model llama3-8b-shape --out results.json   # the H200
    python benchmarks/bench_engine.py --model tiny                                 # CPU, seconds (CI)

Models: `llama3-8b-shape` is Llama-3-8B's shape (hidden 4096, 32 layers, 32 heads, 8 KV heads,
intermediate 14336, vocab 128256) with random bf16 weights made on the device (load_format "dummy":
nothing is downloaded or read); its tokenizer is the small local one, so prompts are random token
ids. `tiny` is the 2-layer test checkpoint (testing.checkpoints). The HF peer is
transformers' LlamaForCausalLM whose parameters are views of radixlm's (fused QKV and gate-up split
back), so both run exactly the same weights; it runs after radixlm's engine has been shut down and its
KV pool freed.

Workloads (the 8B sizes; `tiny` scales them down):
- latency: batch 1, 32-token prompt, 256 output tokens, greedy; ms per output token is
  (time(256 tokens) - time(1 token)) / 255, so prefill is not counted.
- throughput: 1000 requests, input lengths uniform 128..1024, outputs uniform 128..512 (seed 0),
  ignore_eos, greedy, all submitted at once; output and total (input + output) tokens/s. HF runs a
  fixed subset (the first --hf-requests) in static batches, left-padded, each batch generating as many
  tokens as its longest request (only each request's own length is counted); radixlm runs that subset
  too, so the ratio is on the same work.
- prefill: 16 prompts x 1024 tokens, one output token; TFLOP/s counts 2 x parameters x tokens for the
  layers, the causal attention's QK and PV products, and the lm_head for the 16 sampled rows.
- decode step: with B requests decoding, wall time per scheduler step, the GPU time of that step alone
  (its CUDA graph replayed, timed with events), their difference (host time per step), and where the
  host time goes (cProfile, top functions).
"""

from __future__ import annotations

import argparse
import ast
import cProfile
import gc
import io
import json
import os
import platform
import pstats
import statistics
import sys
import tempfile
import threading
import time
import weakref
from typing import Any

import torch

import radixlm
from radixlm.core.runtime.models.registry import model_spec
from radixlm.testing.checkpoints import build_checkpoint, build_tokenizer

LLAMA3_8B_SHAPE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}

# Workload sizes per model. The tiny ones keep the CPU run (and its CI test) within seconds.
WORKLOADS = {
    "llama3-8b-shape": dict(lat_prompt=32, lat_out=256, n_req=1000, in_lo=128, in_hi=1024, out_lo=128, out_hi=512,
                            prefill_batch=16, prefill_len=1024, hf_requests=64, hf_batch=64,
                            step_batches=(1, 64, 256), step_iters=20, chunked_prefill_size=16384),
    "tiny": dict(lat_prompt=8, lat_out=12, n_req=12, in_lo=4, in_hi=24, out_lo=4, out_hi=12,
                 prefill_batch=2, prefill_len=32, hf_requests=6, hf_batch=3,
                 step_batches=(1, 4), step_iters=3, chunked_prefill_size=8192),
}
COPY_BW = 4.2e12  # bytes/s, device-to-device copy measured on the H200
MATMUL_RATE = 776e12  # bf16 FLOP/s measured on the H200


# ---- model and workloads ---------------------------------------------------------------------------


def make_model_dir(name: str, root: str) -> tuple[str, dict[str, Any]]:
    """A checkpoint directory for `name` and the engine options it needs."""
    path = os.path.join(root, name)
    if name == "tiny":
        return build_checkpoint(path, "llama"), {}
    build_tokenizer(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(LLAMA3_8B_SHAPE, f, indent=2)
    return path, {"load_format": "dummy"}


def workload(w: dict[str, Any], vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """The throughput requests: random prompts and output lengths, fixed by the seed."""
    g = torch.Generator().manual_seed(seed)
    in_lens = torch.randint(w["in_lo"], w["in_hi"] + 1, (w["n_req"],), generator=g).tolist()
    out_lens = torch.randint(w["out_lo"], w["out_hi"] + 1, (w["n_req"],), generator=g).tolist()
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in in_lens]
    return prompts, out_lens


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count, length), generator=g).tolist()


def prefill_flops(cfg, batch: int, length: int) -> float:
    """2 x layer parameters x tokens + causal attention (QK and PV) + lm_head on one row per prompt."""
    h, q = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    layer_params = h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size
    tokens = batch * length
    pairs = batch * length * (length + 1) // 2
    attention = 4 * pairs * cfg.num_heads * cfg.head_dim
    return cfg.num_layers * (2 * layer_params * tokens + attention) + 2 * batch * h * cfg.vocab_size


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_used_bytes(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return total - free


# ---- radixlm ----------------------------------------------------------------------------------------

PARTS = ("latency", "prefill", "throughput", "decode_step")
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def timed_generate(engine, input_ids, params) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = engine.generate(input_ids=input_ids, sampling_params=params)
    return time.perf_counter() - t0, out


def bench_latency(engine, w, vocab: int, repeats: int) -> dict[str, Any]:
    prompt = random_prompts(1, w["lat_prompt"], vocab, seed=1)[0]
    n = w["lat_out"]
    full, first = [], []
    out = None
    for _ in range(repeats):
        engine.flush_cache()
        t, out = timed_generate(engine, prompt, {**GREEDY, "max_new_tokens": n})
        assert out["meta_info"]["completion_tokens"] == n, out["meta_info"]
        full.append(t)
        engine.flush_cache()
        first.append(timed_generate(engine, prompt, {**GREEDY, "max_new_tokens": 1})[0])
    t_full, t_first = statistics.median(full), statistics.median(first)
    return {"prompt_len": len(prompt), "output_len": n, "ms_per_token": (t_full - t_first) / (n - 1) * 1e3,
            "first_token_ms": t_first * 1e3, "total_s": t_full, "output_ids": out["output_ids"]}


class _ClockStamp:
    """A CUDA event's stand-in on the CPU, where each forward is synchronous: the clock when recorded."""

    def record(self) -> None:
        self.at = time.perf_counter()

    def elapsed_time(self, end: "_ClockStamp") -> float:
        return (end.at - self.at) * 1e3  # milliseconds, as CUDA events give them


def bench_throughput(engine, prompts, out_lens, breakdown: bool = False) -> dict[str, Any]:
    """With `breakdown`, every model forward's device time is recorded (CUDA events, read after the run,
    so nothing waits for the device that would not otherwise: overlap keeps working), splitting the
    wall time into prefill forwards, decode forwards and the rest (the device idle: host work that
    nothing hid). On the CPU a forward is timed by the clock (it is synchronous anyway)."""
    engine.flush_cache()
    params = [{**GREEDY, "max_new_tokens": n} for n in out_lens]
    runner = engine._runner
    split = {"prefill_s": 0.0, "prefill_steps": 0, "prefill_tokens": 0, "decode_s": 0.0, "decode_steps": 0,
             "decode_tokens": 0}
    timings: list[tuple[str, Any, Any]] = []
    if breakdown:
        inner = runner.forward
        stamp = (lambda: torch.cuda.Event(enable_timing=True)) if runner.device.type == "cuda" else _ClockStamp

        def timed_forward(batch):
            kind = "decode" if batch.is_decode else "prefill"
            split[f"{kind}_steps"] += 1
            split[f"{kind}_tokens"] += len(batch.input_ids)
            start, end = stamp(), stamp()
            start.record()
            logits = inner(batch)
            end.record()
            timings.append((kind, start, end))
            return logits

        runner.forward = timed_forward  # an instance attribute over the method, removed below
    radix_before = engine.get_stats().get("radix_cache_time_s")
    try:
        t, outs = timed_generate(engine, prompts, params)
    finally:
        runner.__dict__.pop("forward", None)
    if radix_before is not None:
        split["radix_cache_s"] = engine.get_stats()["radix_cache_time_s"] - radix_before
    produced = [o["meta_info"]["completion_tokens"] for o in outs]
    assert produced == out_lens, "ignore_eos requests must produce exactly max_new_tokens"
    n_in, n_out = sum(len(p) for p in prompts), sum(out_lens)
    result = {"requests": len(prompts), "input_tokens": n_in, "output_tokens": n_out, "seconds": t,
              "output_tok_s": n_out / t, "total_tok_s": (n_in + n_out) / t, "requests_s": len(prompts) / t}
    if breakdown:
        sync(runner.device)
        for kind, start, end in timings:
            split[f"{kind}_s"] += start.elapsed_time(end) / 1e3
        split["other_s"] = t - split["prefill_s"] - split["decode_s"]
        split["mean_decode_batch"] = split["decode_tokens"] / max(1, split["decode_steps"])
        result["breakdown"] = split
    return result


def bench_prefill(engine, w, cfg, repeats: int, profile_top: int = 0) -> dict[str, Any]:
    b, n = w["prefill_batch"], w["prefill_len"]
    times = []
    for i in range(repeats + 1):  # the first is a warm-up
        engine.flush_cache()
        t, _ = timed_generate(engine, random_prompts(b, n, cfg.vocab_size, seed=100 + i),
                              {**GREEDY, "max_new_tokens": 1})
        if i:
            times.append(t)
    t = statistics.median(times)
    flops = prefill_flops(cfg, b, n)
    forward_s, kernels = engine.frontend.scheduler.run_paused(
        lambda s: _forward_only_prefill(s, b, n, cfg.vocab_size, repeats, profile_top))
    out = {"batch": b, "len": n, "seconds": t, "tflops": flops / t / 1e12, "tflop": flops / 1e12,
           "forward_s": forward_s, "forward_tflops": flops / forward_s / 1e12}
    if kernels:
        out["forward_kernels"] = kernels
    return out


def _top_kernels(runner, step, top: int) -> list[dict[str, Any]]:
    """One more forward under torch.profiler: the `top` device kernels by total time, with their share of
    the forward's device time (where a prefill forward's time goes: GEMMs against the rest)."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        runner.forward(step)
        sync(runner.device)
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in events) or 1.0
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    kernels = [{"name": e.key[:120], "calls": e.count, "ms": e.self_device_time_total / 1e3,
                "share": e.self_device_time_total / total} for e in events[:top]]
    print(f"prefill forward, device time {total / 1e3:.1f} ms, top kernels:", flush=True)
    for k in kernels:
        print(f"  {k['share'] * 100:5.1f} %  {k['ms']:8.2f} ms  x{k['calls']:<4} {k['name']}", flush=True)
    return kernels


def _forward_only_prefill(s, batch: int, length: int, vocab: int, repeats: int,
                          profile_top: int = 0) -> tuple[float, list[dict[str, Any]]]:
    """The model forward alone for the prefill batch (the scheduler loop paused, nothing else running):
    the number comparable to HF's forward, without scheduling, sampling and radix-cache work; with
    `profile_top` (CUDA) also its top kernels."""
    from radixlm.core.runtime.execution.batch_input import BatchInput

    runner = s.runner
    slots = s.allocator.alloc(batch * length)
    rows = [runner.req_to_token.alloc() for _ in range(batch)]
    try:
        for i, row in enumerate(rows):
            runner.req_to_token.write(row, 0, slots[i * length : (i + 1) * length])
        ids = [t for p in random_prompts(batch, length, vocab, seed=200) for t in p]
        step = BatchInput(False, ids, list(range(length)) * batch, slots, rows, [length] * batch, [length] * batch,
                          [(i + 1) * length - 1 for i in range(batch)])
        times = []
        for i in range(repeats + 1):
            sync(runner.device)
            t0 = time.perf_counter()
            runner.forward(step)
            sync(runner.device)
            if i:
                times.append(time.perf_counter() - t0)
        kernels = _top_kernels(runner, step, profile_top) if profile_top and runner.device.type == "cuda" else []
        return statistics.median(times), kernels
    finally:
        s.allocator.free(slots)
        for row in rows:
            runner.req_to_token.free(row)


def bench_decode_step(engine, batch: int, iters: int, vocab: int, prompt_len: int = 64) -> dict[str, Any]:
    """Host and device time of one decode step with `batch` requests decoding, each `prompt_len` tokens
    in (run on the scheduler thread, between its own steps)."""
    engine.flush_cache()
    prompts = random_prompts(batch, prompt_len, vocab, seed=7)
    rids = [f"step-{batch}-{i}" for i in range(batch)]
    max_new = 4 * iters + 16
    t = threading.Thread(target=engine.generate, kwargs=dict(
        input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": max_new}, rid=rids))
    t.start()

    def measure(s) -> dict[str, Any]:
        while len(s.running) < batch:  # prefill until every request decodes
            s._drain_inbox(block=False)
            s.step()
        walls = []
        for _ in range(iters):
            t0 = time.perf_counter()
            s.step()
            walls.append(time.perf_counter() - t0)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(iters):
            s.step()
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(14)
        gpu_ms = None
        gr = s.runner.graph_runner
        if gr is not None and batch <= gr.max_bs:
            bs = next(x for x in gr.sizes if x >= batch)
            graph = gr.graphs[bs]  # its static inputs still hold the last real step: a replay redoes it
            times = []
            for _ in range(iters):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            gpu_ms = statistics.median(times)
        wall_ms = statistics.median(walls) * 1e3
        return {"batch": batch, "prompt_len": prompt_len, "wall_ms": wall_ms, "gpu_ms": gpu_ms,
                "host_ms": None if gpu_ms is None else wall_ms - gpu_ms,
                "profile_top": _trim_profile(text.getvalue()),
                "kernels": _kernel_profile(s, steps=5) if s.runner.device.type == "cuda" else None}

    result = engine.frontend.scheduler.run_paused(measure)
    for rid in rids:
        engine.abort_request(rid)
    t.join()
    return result


def _kernel_profile(s, steps: int) -> dict[str, Any]:
    """Device time per decode step by kernel, from torch.profiler over eager steps (the same kernels a
    graph replays; eager, so that every launch is traced)."""
    from torch.profiler import ProfilerActivity, profile

    saved, s.runner.graph_runner = s.runner.graph_runner, None
    try:
        s.step()
        sync(s.runner.device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                s.step()
            sync(s.runner.device)
    finally:
        s.runner.graph_runner = saved
    per_kernel: dict[str, list[float]] = {}
    for evt in prof.key_averages():
        us = getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0)
        if us > 0:
            per_kernel[evt.key] = [us / steps / 1e3, evt.count / steps]
    total = sum(ms for ms, _ in per_kernel.values())
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:24]
    return {"device_ms_per_step": total, "launches_per_step": sum(n for _, n in per_kernel.values()),
            "top": [{"kernel": k[:90], "ms_per_step": ms, "calls_per_step": n} for k, (ms, n) in top]}


def _trim_profile(text: str) -> list[str]:
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    start = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls")), 0)
    return lines[start:]


# ---- HF transformers, on radixlm's weights -------------------------------------------------------------


def hf_model_on_shared_weights(model, model_dir: str, device: torch.device):
    """transformers' LlamaForCausalLM whose parameters are views of radixlm's model (no copy, except of
    the linears a CPU engine prepacked)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_cfg)
    ours = dict(model.named_parameters(remove_duplicate=False))
    spec = model_spec(model.config.architecture)
    for name, _ in list(hf.named_parameters(remove_duplicate=False)):
        our_name, shard = spec.parameter_for(name)
        tensor = ours[our_name]
        if tensor.is_mkldnn:  # a CPU engine's prepacked linear (oneDNN's layout): HF gets a plain copy
            tensor = tensor.to_dense()
        if shard is not None:
            tensor = tensor[spec.block_rows(our_name, shard, model.config)]
        module_name, _, leaf = name.rpartition(".")
        hf.get_submodule(module_name)._parameters[leaf] = torch.nn.Parameter(tensor, requires_grad=False)
    with torch.device(device):  # the rotary tables were built on meta: build them for real
        hf.model.rotary_emb = type(hf.model.rotary_emb)(config=hf_cfg)
    hf.generation_config.pad_token_id = 0
    return hf.eval()


@torch.inference_mode()
def hf_generate(hf, batch_ids: list[list[int]], new_tokens: int, device: torch.device) -> tuple[float, torch.Tensor]:
    """Greedy generate of exactly new_tokens for a left-padded batch; returns (seconds, new ids)."""
    width = max(len(p) for p in batch_ids)
    ids = torch.zeros(len(batch_ids), width, dtype=torch.long)
    mask = torch.zeros(len(batch_ids), width, dtype=torch.long)
    for i, p in enumerate(batch_ids):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    sync(device)
    t0 = time.perf_counter()
    out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                      do_sample=False, pad_token_id=0)
    sync(device)
    return time.perf_counter() - t0, out[:, width:].cpu()


def hf_latency(hf, w, vocab: int, device: torch.device) -> dict[str, Any]:
    prompt = random_prompts(1, w["lat_prompt"], vocab, seed=1)[0]
    n = w["lat_out"]
    hf_generate(hf, [prompt], 2, device)  # warm-up
    t_full, out = hf_generate(hf, [prompt], n, device)
    t_first, _ = hf_generate(hf, [prompt], 1, device)
    return {"prompt_len": len(prompt), "output_len": n, "ms_per_token": (t_full - t_first) / (n - 1) * 1e3,
            "first_token_ms": t_first * 1e3, "total_s": t_full, "output_ids": out[0].tolist()}


@torch.inference_mode()
def hf_prefill(hf, w, cfg, device: torch.device, repeats: int) -> dict[str, Any]:
    b, n = w["prefill_batch"], w["prefill_len"]
    times = []
    for i in range(repeats + 1):
        ids = torch.tensor(random_prompts(b, n, cfg.vocab_size, seed=100 + i), device=device)
        sync(device)
        t0 = time.perf_counter()
        hf(input_ids=ids, logits_to_keep=1)
        sync(device)
        if i:
            times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    flops = prefill_flops(cfg, b, n)
    return {"batch": b, "len": n, "seconds": t, "tflops": flops / t / 1e12, "tflop": flops / 1e12}


def hf_throughput(hf, prompts, out_lens, batch: int, device: torch.device) -> dict[str, Any]:
    seconds, generated = 0.0, 0
    for i in range(0, len(prompts), batch):
        chunk, lens = prompts[i : i + batch], out_lens[i : i + batch]
        t, _ = hf_generate(hf, chunk, max(lens), device)
        seconds += t
        generated += max(lens) * len(chunk)
    n_in, n_out = sum(len(p) for p in prompts), sum(out_lens)
    return {"requests": len(prompts), "batch": batch, "input_tokens": n_in, "output_tokens": n_out,
            "generated_tokens_incl_padding": generated, "seconds": seconds, "output_tok_s": n_out / seconds,
            "total_tok_s": (n_in + n_out) / seconds, "requests_s": len(prompts) / seconds}


# ---- the run ---------------------------------------------------------------------------------------------


class Sections:
    """Runs the benchmark's parts one by one: a failing part is recorded and the run goes on, and the
    results so far are saved after each part (a run cut short by its time limit keeps them)."""

    def __init__(self, results: dict[str, Any], out: str | None) -> None:
        self.results, self.out = results, out

    def run(self, where: dict[str, Any], key: str, fn, *fn_args) -> Any:
        t0 = time.perf_counter()
        try:
            where[key] = fn(*fn_args)
        except Exception as exc:  # noqa: BLE001 - recorded, reported, and the next part runs
            import traceback

            where[key] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
            print(f"[{key}] FAILED: {where[key]['error']}", flush=True)
        print(f"[{time.strftime('%H:%M:%S')}] {key} done in {time.perf_counter() - t0:.1f} s", flush=True)
        self.save()
        return where[key]

    def save(self) -> None:
        if self.out:
            with open(self.out, "w") as f:
                json.dump(self.results, f, indent=2, default=str)


def run(args: argparse.Namespace) -> dict[str, Any]:
    w = dict(WORKLOADS[args.model])
    if args.requests:
        w["n_req"] = args.requests
    if args.hf_requests is not None:
        w["hf_requests"] = args.hf_requests
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    results: dict[str, Any] = {
        "model": args.model, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else
        platform.processor() or "cpu", "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "torch": torch.__version__, "workload": dict(w),
    }
    try:
        import transformers
        import triton

        results["transformers"], results["triton"] = transformers.__version__, triton.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        torch.cuda.init()
        results["memory_total_gib"] = torch.cuda.mem_get_info(device)[1] / 2**30
        results["memory_used_before_gib"] = device_used_bytes(device) / 2**30
    sections = Sections(results, args.out)
    root = tempfile.mkdtemp(prefix="radixlm-bench-")
    model_dir, extra = make_model_dir(args.model, root)

    t0 = time.perf_counter()
    engine = radixlm.Engine(model_dir, device=device.type, chunked_prefill_size=w["chunked_prefill_size"],
                            mem_fraction_static=args.mem_fraction_static, log_level="warning",
                            disable_cuda_graph=args.disable_cuda_graph,
                            enable_overlap_schedule=args.overlap, **extra, **parse_engine_options(args.engine_option))
    runner = engine._runner
    cfg = engine.model_config
    results["engine"] = {
        "init_s": time.perf_counter() - t0, "kv_pool_tokens": engine.kv_pool_size, "dtype": engine.options.dtype,
        "kv_cache_dtype": engine.options.kv_cache_dtype,
        "cuda_graphs": runner.graph_runner is not None, "overlap_schedule": args.overlap,
        "cuda_graph_sizes": runner.graph_runner.sizes if runner.graph_runner else [],
        "chunked_prefill_size": w["chunked_prefill_size"], "mem_fraction_static": args.mem_fraction_static,
        "options": parse_engine_options(args.engine_option),
    }
    print(f"engine up in {results['engine']['init_s']:.1f} s; KV pool {engine.kv_pool_size} tokens; "
          f"CUDA graphs {results['engine']['cuda_graphs']}", flush=True)
    used_peak = device_used_bytes(device) or 0

    prompts, out_lens = workload(w, cfg.vocab_size)
    sub = w["hf_requests"]
    ours: dict[str, Any] = {}
    results["radixlm"] = ours
    # Warm-up: every prefill and decode shape class once.
    engine.generate(input_ids=prompts[:4], sampling_params=[{**GREEDY, "max_new_tokens": 4}] * 4)
    parts = set(args.parts)
    if "latency" in parts:
        sections.run(ours, "latency", bench_latency, engine, w, cfg.vocab_size, args.repeats)
    if "prefill" in parts:
        sections.run(ours, "prefill", bench_prefill, engine, w, cfg, args.repeats, args.profile_prefill)
    if "throughput" in parts:
        sections.run(ours, "throughput", bench_throughput, engine, prompts, out_lens, True)
        used_peak = max(used_peak, device_used_bytes(device) or 0)
        sections.run(ours, "throughput_hf_subset", bench_throughput, engine, prompts[:sub], out_lens[:sub])
    if "decode_step" in parts:
        sections.run(ours, "decode_step", lambda: [
            bench_decode_step(engine, b, w["step_iters"], cfg.vocab_size, args.step_prompt_len)
            for b in args.step_batches or w["step_batches"]])
    if device.type == "cuda":
        used_peak = max(used_peak, device_used_bytes(device))
        results["memory"] = {
            "peak_used_gib": used_peak / 2**30,
            "peak_fraction": used_peak / torch.cuda.mem_get_info(device)[1],
            "torch_max_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30,
            "kv_pool_gib": engine.kv_pool_size * runner._kv_bytes_per_token() / 2**30,
            "weights_gib": sum(p.numel() * p.element_size() for p in runner.model.parameters()) / 2**30,
        }

    # The peer runs on the same weights after the engine (and its KV pool, graphs) is gone.
    model = runner.model
    kv_alive = weakref.ref(runner.kv_pool.k_buffers[0])
    engine.shutdown()
    del engine, runner
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        results["memory_used_after_engine_gib"] = device_used_bytes(device) / 2**30
    results["engine_freed"] = kv_alive() is None
    if not args.no_hf:
        hf = hf_model_on_shared_weights(model, model_dir, device)
        peer: dict[str, Any] = {}
        results["hf"] = peer
        sections.run(peer, "latency", hf_latency, hf, w, cfg.vocab_size, device)
        sections.run(peer, "prefill", hf_prefill, hf, w, cfg, device, args.repeats)
        sections.run(peer, "throughput_subset", hf_throughput, hf, prompts[:sub], out_lens[:sub], w["hf_batch"], device)
        try:
            a, b = ours["latency"]["output_ids"], peer["latency"]["output_ids"]
            same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            results["agreement"] = {"latency_greedy_equal_prefix": same, "of": len(a)}
            results["ratios"] = {
                "latency_hf_over_ours": peer["latency"]["ms_per_token"] / ours["latency"]["ms_per_token"],
                "prefill_ours_over_hf": ours["prefill"]["tflops"] / peer["prefill"]["tflops"],
                "throughput_subset_ours_over_hf": ours["throughput_hf_subset"]["output_tok_s"]
                / peer["throughput_subset"]["output_tok_s"],
                "throughput_full_ours_over_hf_subset": ours["throughput"]["output_tok_s"]
                / peer["throughput_subset"]["output_tok_s"],
            }
        except (KeyError, TypeError, ZeroDivisionError) as exc:
            results["ratios"] = {"error": f"a part failed: {exc!r}"}
    for part in (results.get("radixlm", {}), results.get("hf", {})):
        if isinstance(part.get("latency"), dict):
            part["latency"].pop("output_ids", None)
    sections.save()
    return results


def _get(r: dict[str, Any], *path: str) -> Any:
    for key in path:
        if not isinstance(r, dict) or key not in r:
            return None
        r = r[key]
    return r


def summary(r: dict[str, Any]) -> str:
    """The results as a short table (a part that failed shows as '-')."""
    lines = [f"{r['model']} on {r['device']} ({r['date']}), KV pool {r['engine']['kv_pool_tokens']} tokens "
             f"(kv_cache_dtype {r['engine'].get('kv_cache_dtype', 'auto')}), "
             f"CUDA graphs {r['engine']['cuda_graphs']}"]
    row = "{:40s} {:>12s} {:>12s} {:>8s}"
    lines.append(row.format("", "radixlm", "HF generate", "ratio"))

    def add(name: str, ours: float | None, peer: float | None, fmt: str, higher_is_better: bool = True) -> None:
        ratio = "-"
        if ours and peer:
            ratio = f"{(ours / peer if higher_is_better else peer / ours):.2f}x"
        lines.append(row.format(name, fmt.format(ours) if ours is not None else "-",
                                fmt.format(peer) if peer is not None else "-", ratio))

    add("latency ms/token (B=1)", _get(r, "radixlm", "latency", "ms_per_token"),
        _get(r, "hf", "latency", "ms_per_token"), "{:.2f}", higher_is_better=False)
    add("prefill TFLOP/s, end to end", _get(r, "radixlm", "prefill", "tflops"), _get(r, "hf", "prefill", "tflops"),
        "{:.1f}")
    add("prefill TFLOP/s, model forward", _get(r, "radixlm", "prefill", "forward_tflops"),
        _get(r, "hf", "prefill", "tflops"), "{:.1f}")
    hf_out = _get(r, "hf", "throughput_subset", "output_tok_s")
    add(f"out tok/s, HF subset ({_get(r, 'workload', 'hf_requests')} req)",
        _get(r, "radixlm", "throughput_hf_subset", "output_tok_s"), hf_out, "{:.0f}")
    add(f"out tok/s, all {_get(r, 'workload', 'n_req')} req (vs HF subset)",
        _get(r, "radixlm", "throughput", "output_tok_s"), hf_out, "{:.0f}")
    add("total tok/s, all requests", _get(r, "radixlm", "throughput", "total_tok_s"), None, "{:.0f}")
    split = _get(r, "radixlm", "throughput", "breakdown")
    if split:
        lines.append(f"throughput time: prefill forwards {split['prefill_s']:.1f} s ({split['prefill_steps']} steps), "
                     f"decode forwards {split['decode_s']:.1f} s ({split['decode_steps']} steps, mean batch "
                     f"{split['mean_decode_batch']:.0f}), rest (host) {split['other_s']:.1f} s")
    for s in _get(r, "radixlm", "decode_step") or []:
        if isinstance(s, dict) and "wall_ms" in s:
            gpu = "-" if s["gpu_ms"] is None else f"{s['gpu_ms']:.2f}"
            kernels = s.get("kernels") or {}
            extra = (f"; eager kernels {kernels['device_ms_per_step']:.2f} ms in {kernels['launches_per_step']:.0f} "
                     "launches") if kernels else ""
            lines.append(f"decode step B={s['batch']} (prompts of {s.get('prompt_len', 64)}): wall {s['wall_ms']:.2f} ms, "
                         f"GPU (graph) {gpu} ms{extra}")
            for k in kernels.get("top", [])[:12]:
                lines.append(f"    {k['ms_per_step']:7.3f} ms  x{k['calls_per_step']:<5.0f} {k['kernel']}")
    if "memory" in r:
        m = r["memory"]
        lines.append(f"memory: peak {m['peak_used_gib']:.1f} GiB = {m['peak_fraction']:.3f} of the device; "
                     f"KV {m['kv_pool_gib']:.1f} GiB, weights {m['weights_gib']:.1f} GiB")
    if "agreement" in r:
        lines.append(f"greedy agreement with HF (latency prompt): first {r['agreement']['latency_greedy_equal_prefix']}"
                     f" of {r['agreement']['of']} tokens equal")
    return "\n".join(lines)


def parse_engine_options(pairs: list[str] | None, flag: str = "--engine-option") -> dict[str, Any]:
    """KEY=VALUE pairs as Engine keyword arguments: a VALUE is read as JSON (64, true, 0.5), else as a
    Python literal (True, None), else kept as text."""
    options: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"{flag} takes KEY=VALUE (got {pair!r})")
        try:
            options[key] = json.loads(value)
        except ValueError:
            try:
                options[key] = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                options[key] = value
    return options


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(WORKLOADS), default="tiny")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--requests", type=int, help="throughput requests (default: the workload's)")
    p.add_argument("--hf-requests", type=int, help="HF throughput subset size (default: the workload's)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers peer")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile-prefill", type=int, default=0, metavar="N",
                   help="CUDA: also profile one prefill forward and print its N longest kernels")
    p.add_argument("--mem-fraction-static", type=float, default=0.9)
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--overlap", action="store_true", help="radixlm with enable_overlap_schedule (issue 19)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU even when a GPU is present")
    p.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an Engine option for radixlm (repeatable), e.g. schedule_admission_batch=64")
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS, help="what to measure (default: all)")
    p.add_argument("--step-batches", nargs="+", type=int, help="decode_step batch sizes (default: the workload's)")
    p.add_argument("--step-prompt-len", type=int, default=64,
                   help="decode_step prompt length: the context each request's decode step attends to")
    args = p.parse_args(argv)
    results = run(args)
    print(summary(results), flush=True)
    failed = [k for part in ("radixlm", "hf") for k, v in (results.get(part) or {}).items()
              if isinstance(v, dict) and "error" in v]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
