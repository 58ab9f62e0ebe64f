"""The GPU check of the CUDA path, in one run: kernels at real sizes, the engine against HF transformers
on a tiny model (fp32 and bf16), and decode and short extends with CUDA graphs against without.

    python3 benchmarks/gpu_check.py [--sweep] [--tune] [--out gpu_check.json]   # on the H200; exit 1 on failure

1. Kernels: benchmarks/gpu_check_kernels.py (Llama-3-8B shapes, bf16, against the fp32 references).
2. Engine vs HF, on a tiny Llama built in-process (testing.checkpoints; 2 layers, 4 heads,
   2 KV heads, head_dim 16), on prompts of 3 to ~1500 tokens decoded together (the long one spans
   several decode KV splits). The oracle is HF transformers in fp32, greedy by hand (argmax of the
   last logits, no generation processors), with the top-1/top-2 logit margin of every step.
   - fp32 engine: greedy tokens equal the oracle's; prompt logprobs (top 5 per position) within 1e-3.
   - bf16 engine: prompt logprobs within twice HF-bf16's own error against the oracle (+0.01); greedy
     tokens equal the oracle's until a step whose oracle margin is under twice our measured logprob
     error (a near tie bf16 may break either way), which is reported, not failed.
3. CUDA graphs: the same batches with graphs on and off (batch sizes that pad to a captured size and
   one larger than the largest; prefills under 512 tokens and continuations past a cached prefix
   replay extend graphs): fp32 tokens must be equal; bf16 agreement is reported.
4. The radix cache's host tier (hicache_size_gb): returning prompts whose prefixes spill out of a
   small device pool and come back from pinned host memory on the copy stream; fp32 greedy tokens
   with the tier off, write-back and write-through must be equal, with host hits, every step's slot
   invariant checked.
5. Overlap scheduling (enable_overlap_schedule): fp32 greedy tokens with overlap on equal those with
   it off, with CUDA graphs, at batch sizes that pad, one past the graphs, and under a small pool that
   retracts; decode steps must have taken their input from the device (chained steps counted).
6. An fp8 KV cache (kv_cache_dtype fp8_e4m3 / fp8_e5m2): the KV kernels at real sizes on fp8 pools
   (gpu_check_kernels.py --kv-dtype: attention against the references reading the same fp8 pool, stores
   against the references' saturating casts, bytes equal reported), then the engine against HF fp32 whose
   attention reads its keys and values rounded to the same fp8 format (the fp8 oracle). fp32 engine: its
   logprob error there under a quarter of the quantization's own error (the same engine against plain HF);
   bf16 engine: under twice HF-bf16's own error against the fp8 oracle (HF bf16 reading fp8-rounded KV
   too) + 0.01, as in step 2. Greedy agreement with the fp8 oracle is reported.
7. The fused decode GEMVs (decode_fused_gemv=8 vs 0), with CUDA graphs: fp32 greedy tokens equal at
   batch 1, 5 (fused) and 13 (not), first-token logprobs within 1e-3 (fp32) and 5e-2 (bf16).
8. FP8 weights (quantization=fp8): benchmarks/gpu_check_quant.py.
9. Speculative decoding's verify steps on the decode CUDA graphs, against eager extends: verify logits
   and greedy tokens, the tiny Llama and the Llama-3-8B shape: benchmarks/gpu_check_spec.py.
10. EAGLE and EAGLE-3 (random heads, tiny Llamas) on CUDA graphs against disable_cuda_graph: greedy tokens
   and the head's every input (`eagle_graphs`, benchmarks/gpu_check_spec.py).
11. Draft trees (eager verify steps through the extend kernel's tree mask): oracle trees and `eagle` with
   speculative_eagle_topk 2, greedy tokens against speculation off (`spec_trees`, gpu_check_spec.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

_HERE = Path(__file__).resolve().parent


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


kernel_check = _load("gpu_check_kernels", _HERE / "gpu_check_kernels.py")
quant_check = _load("gpu_check_quant", _HERE / "gpu_check_quant.py")
spec_check = _load("gpu_check_spec", _HERE / "gpu_check_spec.py")

import radixlm  # noqa: E402
from radixlm.core.runtime.models.config import ModelConfig  # noqa: E402
from radixlm.testing.checkpoints import build_checkpoint  # noqa: E402

NEW_TOKENS = 24
GRAPH_MAX_BS = 16
# "cuda", or "cpu" for a smoke run of this script's logic (--cpu-smoke: no graphs, no kernels).
DEVICE = "cuda"


def prompts_for(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = [3, 17, 64, 200, 1500]
    return [torch.randint(0, vocab - 8, (n,), generator=g).tolist() for n in lens]


class Oracle:
    """HF transformers in fp32: greedy decoding by hand with every step's top-1/top-2 margin, and
    prompt logprobs."""

    def __init__(self, ckpt: str, dtype: torch.dtype, **hf_options: Any) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype, **hf_options).to(DEVICE).eval()

    @torch.inference_mode()
    def logits(self, ids: list[int]) -> torch.Tensor:
        return self.model(torch.tensor([ids], device=DEVICE)).logits[0].float()

    def greedy(self, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
        ids, margins = list(prompt), []
        for _ in range(n):
            top = self.logits(ids)[-1].topk(2)
            margins.append(float(top.values[0] - top.values[1]))
            ids.append(int(top.indices[0]))
        return ids[len(prompt):], margins


def logprob_error(ours: list, oracle_logits: torch.Tensor) -> tuple[float, int]:
    """Max |our logprob - oracle logprob| over our top-5 tokens of every prompt position, and the
    number of positions whose top-1 token differs."""
    lsm = torch.log_softmax(oracle_logits, dim=-1)
    err, top1_diff = 0.0, 0
    for i, entries in enumerate(ours):
        if entries is None:
            continue
        row = lsm[i - 1]
        for lp, tok, _ in entries:
            err = max(err, abs(lp - float(row[tok])))
        top1_diff += int(entries[0][1] != int(row.argmax()))
    return err, top1_diff


def hf_logprob_error(model, prompt: list[int], oracle_logits: torch.Tensor) -> float:
    with torch.inference_mode():
        lsm = torch.log_softmax(model(torch.tensor([prompt], device=DEVICE)).logits[0].float(), dim=-1)
    ref = torch.log_softmax(oracle_logits, dim=-1)
    top = lsm.topk(5, dim=-1).indices
    return float((lsm.gather(1, top) - ref.gather(1, top)).abs().max())


def new_engine(ckpt: str, dtype: str, **opts: Any) -> radixlm.Engine:
    opts = {"max_total_tokens": 16384, **opts}
    return radixlm.Engine(ckpt, dtype=dtype, device=DEVICE, cuda_graph_max_bs=GRAPH_MAX_BS, log_level="warning",
                          **opts)


def uses_graphs(engine: radixlm.Engine) -> bool:
    runner = engine._runner
    return (runner.graph_runner is not None and runner.extend_graphs is not None) or DEVICE == "cpu"


GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}


def greedy_tokens(engine: radixlm.Engine, prompts: list[list[int]]) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=GREEDY)]


def prompt_top_logprobs(engine: radixlm.Engine, prompts: list[list[int]]) -> list[list]:
    scored = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 1}, return_logprob=True,
                             logprob_start_len=0, top_logprobs_num=5)
    return [o["meta_info"]["input_top_logprobs"] for o in scored]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def check_engine_vs_hf(ckpt: str, report: dict[str, Any]) -> bool:
    oracle = Oracle(ckpt, torch.float32)
    prompts = prompts_for(oracle.model.config.vocab_size)
    expected = [oracle.greedy(p, NEW_TOKENS) for p in prompts]
    prompt_logits = [oracle.logits(p) for p in prompts]
    ok = True
    for dtype in ("float32", "bfloat16"):
        with new_engine(ckpt, dtype) as engine:
            tokens, top_lps, graphs = greedy_tokens(engine, prompts), prompt_top_logprobs(engine, prompts), \
                uses_graphs(engine)
        errs = [logprob_error(lp, lg) for lp, lg in zip(top_lps, prompt_logits)]
        lp_err = max(e for e, _ in errs)
        rows = []
        for p, got, (want, margins) in zip(prompts, tokens, expected):
            at = first_divergence(got, want)
            rows.append({"prompt_len": len(p), "equal_tokens": NEW_TOKENS if at is None else at,
                         "margin_at_divergence": None if at is None else margins[at],
                         "min_margin": min(margins)})
        entry: dict[str, Any] = {"cuda_graphs": graphs, "logprob_max_err": lp_err,
                                 "top1_differs_at_positions": sum(d for _, d in errs), "greedy": rows}
        if dtype == "float32":
            passed = lp_err <= 1e-3 and all(r["equal_tokens"] == NEW_TOKENS for r in rows)
        else:
            hf_bf16 = Oracle(ckpt, torch.bfloat16).model
            hf_err = max(hf_logprob_error(hf_bf16, p, lg) for p, lg in zip(prompts, prompt_logits))
            entry["hf_bf16_logprob_max_err"] = hf_err
            tie = 2 * lp_err
            near_ties = [r for r in rows if r["margin_at_divergence"] is not None and r["margin_at_divergence"] < tie]
            real = [r for r in rows if r["margin_at_divergence"] is not None and r["margin_at_divergence"] >= tie]
            entry["diverged_at_near_tie"] = len(near_ties)
            passed = lp_err <= 2 * hf_err + 1e-2 and not real
        entry["ok"] = passed and graphs
        ok = ok and entry["ok"]
        report[f"engine_vs_hf_{dtype}"] = entry
        print(f"engine vs HF ({dtype}): {'ok' if entry['ok'] else 'FAIL'}  logprob err {lp_err:.2e}"
              + (f" (HF bf16 {entry['hf_bf16_logprob_max_err']:.2e})" if dtype == "bfloat16" else "")
              + f"; greedy equal tokens per prompt {[r['equal_tokens'] for r in rows]} of {NEW_TOKENS}"
              + f"; CUDA graphs {graphs}", flush=True)
    return ok


def check_graphs(ckpt: str, report: dict[str, Any]) -> bool:
    vocab = ModelConfig.from_dir(ckpt).vocab_size
    g = torch.Generator().manual_seed(1)
    ok = True
    for dtype in ("float32", "bfloat16"):
        results = {}
        with new_engine(ckpt, dtype) as with_graphs, new_engine(ckpt, dtype, disable_cuda_graph=True) as without:
            graphs = uses_graphs(with_graphs)
            earlier: list[list[int]] = []
            for batch in (1, 3, 5, 13, GRAPH_MAX_BS + 4, "continuations"):
                # 5 and 13 pad to 8 and 16; GRAPH_MAX_BS + 4 decodes eagerly. Prompts under 512 tokens
                # prefill through the extend graphs; continuations of earlier prompts extend a few
                # tokens past a cached prefix, as jump-forward and multi-turn programs do.
                if batch == "continuations":
                    prompts = [p + torch.randint(0, vocab - 8, (5,), generator=g).tolist() for p in earlier[:24]]
                else:
                    lens = torch.randint(2, 300, (batch,), generator=g).tolist()
                    prompts = [torch.randint(0, vocab - 8, (n,), generator=g).tolist() for n in lens]
                    earlier += prompts
                on, off = greedy_tokens(with_graphs, prompts), greedy_tokens(without, prompts)
                equal = sum(a == b for a, b in zip(on, off))
                results[batch] = {"equal_requests": equal, "of": len(prompts), "cuda_graphs": graphs}
        passed = all(r["cuda_graphs"] for r in results.values())
        if dtype == "float32":
            passed = passed and all(r["equal_requests"] == r["of"] for r in results.values())
        report[f"graphs_on_off_{dtype}"] = {"ok": passed, "batches": results}
        ok = ok and passed
        print(f"CUDA graphs on vs off ({dtype}): {'ok' if passed else 'FAIL'} "
              + ", ".join(f"B={b}: {r['equal_requests']}/{r['of']} equal" for b, r in results.items()), flush=True)
    return ok


def check_host_tier(ckpt: str, report: dict[str, Any]) -> bool:
    vocab = ModelConfig.from_dir(ckpt).vocab_size
    g = torch.Generator().manual_seed(2)
    histories = [torch.randint(0, vocab - 8, (60,), generator=g).tolist() for _ in range(8)]
    rounds = [[h + torch.randint(0, vocab - 8, (4,), generator=g).tolist() for h in histories] for _ in range(3)]
    results = {}
    for size_gb, policy in ((0.0, "write_back"), (0.001, "write_back"), (0.001, "write_through")):
        with radixlm.Engine(ckpt, dtype="float32", device=DEVICE, max_total_tokens=160, hicache_size_gb=size_gb,
                            hicache_write_policy=policy, debug_check_invariants=True, log_level="warning") as engine:
            tokens = [t for prompts in rounds for t in greedy_tokens(engine, prompts)]
            results[policy if size_gb else "off"] = tokens, engine.get_stats()["hicache_host_hit_tokens_total"]
    off = results["off"][0]
    rows = {name: {"equal_requests": sum(a == b for a, b in zip(off, tokens)), "of": len(off), "host_hit_tokens": hits}
            for name, (tokens, hits) in results.items() if name != "off"}
    passed = all(r["equal_requests"] == r["of"] and r["host_hit_tokens"] > 0 for r in rows.values())
    report["host_tier"] = {"ok": passed, **rows}
    print(f"host tier vs off (fp32): {'ok' if passed else 'FAIL'} " + ", ".join(
        f"{n}: {r['equal_requests']}/{r['of']} equal, {r['host_hit_tokens']} tokens from the host"
        for n, r in rows.items()), flush=True)
    return passed


# Requests whose sampling reads the newest token (overlap samples their chained steps late): JSON with
# jump-forward, a penalty, seeded draws, a min_new_tokens ban.
LATE_SAMPLED = [{**GREEDY, "json_schema": json.dumps({"type": "object", "properties": {"a": {"type": "integer"},
                                                       "b": {"type": "string", "maxLength": 12}},
                                                       "required": ["a", "b"]})},
                {**GREEDY, "frequency_penalty": 1.0}, {**GREEDY, "temperature": 1.0, "seed": 11},
                {**GREEDY, "min_new_tokens": 20}]


def late_sampled_tokens(engine: radixlm.Engine, prompts: list[list[int]], kinds: list[dict] = LATE_SAMPLED) -> list[list[int]]:
    params = [kinds[i % len(kinds)] for i in range(len(prompts))]
    return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]


def check_overlap(ckpt: str, report: dict[str, Any]) -> bool:
    vocab = ModelConfig.from_dir(ckpt).vocab_size
    g = torch.Generator().manual_seed(3)
    batches = [[torch.randint(0, vocab - 8, (n,), generator=g).tolist() for n in torch.randint(2, 300, (b,),
                                                                                              generator=g).tolist()]
               for b in (1, 5, 13, GRAPH_MAX_BS + 4)]
    results: dict[str, Any] = {}
    for pool in (16384, 400):  # 400 slots: the largest batch retracts
        tokens, chained, chained_extends = {}, 0, 0
        for overlap in (False, True):
            with new_engine(ckpt, "float32", max_total_tokens=pool, enable_overlap_schedule=overlap,
                            debug_check_invariants=True) as engine:
                runner, forward = engine._runner, engine._runner.forward

                def counting(batch, forward=forward):
                    nonlocal chained, chained_extends
                    chained += batch.input_future is not None
                    # extend steps computing jumped text, with riders on a pending step's tokens
                    chained_extends += batch.input_future is not None and not batch.is_decode
                    return forward(batch)

                runner.forward = counting
                tokens[overlap] = [greedy_tokens(engine, prompts) for prompts in batches]
                tokens[overlap].append(late_sampled_tokens(engine, batches[2]))
                # all JSON with jump-forward: extend steps of jumped text, chained with riders
                tokens[overlap].append(late_sampled_tokens(engine, batches[2], LATE_SAMPLED[:1]))
                retractions = engine.get_stats()["retractions_total"]
        equal = [sum(a == b for a, b in zip(x, y)) for x, y in zip(tokens[False], tokens[True])]
        results[f"pool_{pool}"] = {"equal_requests": equal, "of": [len(b) for b in batches] + [len(batches[2])] * 2,
                                   "chained_steps": chained, "chained_extend_steps": chained_extends,
                                   "retractions": retractions}
    passed = all(r["equal_requests"] == r["of"] and r["chained_steps"] > 0 and r["chained_extend_steps"] > 0
                 for r in results.values())
    report["overlap_on_off"] = {"ok": passed, **results}
    print(f"overlap on vs off (fp32): {'ok' if passed else 'FAIL'} " + ", ".join(
        f"{name}: {r['equal_requests']}/{r['of']} equal, {r['chained_steps']} chained steps "
        f"({r['chained_extend_steps']} of them extends), "
        f"{r['retractions']} retractions" for name, r in results.items()), flush=True)
    return passed


def check_fp8_kv(ckpt: str, report: dict[str, Any]) -> bool:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from radixlm.core.runtime.options import KV_CACHE_DTYPES
    from radixlm.kernels.reference import to_kv_dtype

    ok, results = True, {}
    plain = Oracle(ckpt, torch.float32)
    prompts = prompts_for(plain.model.config.vocab_size)
    for fmt in ("fp8_e4m3", "fp8_e5m2"):
        kv_dtype = getattr(torch, KV_CACHE_DTYPES[fmt])
        if DEVICE == "cuda":
            print(f"-- KV kernels on a {fmt} pool", flush=True)
            kernels_ok = kernel_check.main(["--kv-dtype", fmt]) == 0
        else:
            kernels_ok = True

        def attention(module, query, key, value, *args, kv_dtype=kv_dtype, **kwargs):
            key, value = (to_kv_dtype(x, kv_dtype).to(x.dtype) for x in (key, value))
            return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

        AttentionInterface.register(f"radixlm_{fmt}", attention)
        oracle = Oracle(ckpt, torch.float32, attn_implementation=f"radixlm_{fmt}")
        oracle_logits = [oracle.logits(p) for p in prompts]
        hf_bf16 = Oracle(ckpt, torch.bfloat16, attn_implementation=f"radixlm_{fmt}").model
        hf_bf16_err = max(hf_logprob_error(hf_bf16, p, lg) for p, lg in zip(prompts, oracle_logits))
        plain_logits = [plain.logits(p) for p in prompts]
        entry: dict[str, Any] = {"kernels_ok": kernels_ok, "hf_bf16_logprob_err_vs_fp8_oracle": hf_bf16_err}
        for dtype in ("float32", "bfloat16"):
            with new_engine(ckpt, dtype, kv_cache_dtype=fmt) as engine:
                assert engine._runner.kv_pool.kv.dtype == kv_dtype
                tokens, top_lps = greedy_tokens(engine, prompts), prompt_top_logprobs(engine, prompts)
            err = max(logprob_error(lp, lg)[0] for lp, lg in zip(top_lps, oracle_logits))
            quantization = max(logprob_error(lp, lg)[0] for lp, lg in zip(top_lps, plain_logits))
            equal = [NEW_TOKENS if (at := first_divergence(t, oracle.greedy(p, NEW_TOKENS)[0])) is None else at
                     for p, t in zip(prompts, tokens)]
            entry[dtype] = {"logprob_err_vs_fp8_oracle": err, "logprob_err_vs_plain_hf": quantization,
                            "greedy_equal_tokens": equal}
        bounds = {"float32": 0.25 * entry["float32"]["logprob_err_vs_plain_hf"], "bfloat16": 2 * hf_bf16_err + 0.01}
        entry["ok"] = kernels_ok and all(entry[d]["logprob_err_vs_fp8_oracle"] <= b for d, b in bounds.items())
        ok = ok and entry["ok"]
        results[fmt] = entry
        print(f"fp8 KV {fmt}: {'ok' if entry['ok'] else 'FAIL'} kernels {'ok' if kernels_ok else 'FAIL'}; " + "; ".join(
            f"{d} engine: logprob err {entry[d]['logprob_err_vs_fp8_oracle']:.2e} vs HF on the same fp8 KV "
            f"(bound {bounds[d]:.2e}), {entry[d]['logprob_err_vs_plain_hf']:.2e} vs plain HF, greedy equal tokens "
            f"{entry[d]['greedy_equal_tokens']} of {NEW_TOKENS}" for d in ("float32", "bfloat16")), flush=True)
    report["fp8_kv"] = results
    return ok


def check_fused_gemv(ckpt: str, report: dict[str, Any]) -> bool:
    """decode_fused_gemv=8 against 0, with CUDA graphs: batches of 1 and 5 decode through the fused GEMVs
    (short prompts prefill through them too), 13 through cuBLAS; the first decoded token's logprob and
    the greedy tokens (fp32) must agree."""
    vocab = ModelConfig.from_dir(ckpt).vocab_size
    g = torch.Generator().manual_seed(4)
    batches = [[torch.randint(0, vocab - 8, (n,), generator=g).tolist() for n in lens]
               for lens in ([5], [3, 8, 40, 200, 1500], torch.randint(2, 300, (13,), generator=g).tolist())]
    ok, entries = True, {}
    for dtype in ("float32", "bfloat16"):
        runs = {}
        for rows in (0, 8):
            with new_engine(ckpt, dtype, decode_fused_gemv=rows) as engine:
                fused = engine._runner.model.fused_gemv_rows == rows
                outs = [engine.generate(input_ids=b, sampling_params=GREEDY, return_logprob=True) for b in batches]
                # Logprobs compared where the token histories surely agree: each request's first token.
                runs[rows] = fused, [[o["output_ids"] for o in out] for out in outs], [
                    o["meta_info"]["output_token_logprobs"][0][0] for out in outs for o in out]
        equal = [sum(a == b for a, b in zip(x, y)) for x, y in zip(runs[0][1], runs[8][1])]
        lp_err = max(abs(a - b) for a, b in zip(runs[0][2], runs[8][2]))
        # (The CPU smoke run has no fused GEMVs: it checks this function's logic only.)
        passed = (runs[8][0] or DEVICE == "cpu") and lp_err <= (1e-3 if dtype == "float32" else 5e-2)
        if dtype == "float32":
            passed = passed and equal == [len(b) for b in batches]
        entries[dtype] = {"ok": passed, "fused_path_on": runs[8][0], "equal_requests": equal,
                          "of": [len(b) for b in batches], "first_logprob_max_err": lp_err}
        ok = ok and passed
        print(f"decode_fused_gemv 8 vs 0 ({dtype}): {'ok' if passed else 'FAIL'} fused path {runs[8][0]}, "
              f"{equal} of {[len(b) for b in batches]} requests equal, first-token logprob err {lp_err:.2e}",
              flush=True)
    report["fused_gemv_on_off"] = {"ok": ok, **entries}
    return ok


def check_qwen2vl(ckpt: str, report: dict[str, Any]) -> bool:
    """Qwen2-VL (its own tiny checkpoint; `ckpt` unused) against transformers on the same weights: M-RoPE
    rows through the rotary in the qkv GEMV (batch-1 decode) and the batched path, greedy tokens equal in
    fp32; in bf16 the first token's logprob as close to fp32 HF's as twice HF's own in bf16 (+ 0.01), as
    check_engine_vs_hf asks."""
    from radixlm.testing.vision import QWEN2_VL_IMAGE, build_qwen2_vl_checkpoint, sample_image

    oracle_module = _load("qwen2vl_oracle", _HERE.parent / "tests" / "qwen2vl_oracle.py")
    path = build_qwen2_vl_checkpoint(tempfile.mkdtemp(prefix="radixlm-gpu-check-") + "/qwen2vl")
    oracle = oracle_module.Qwen2VLOracle(path)
    prompts = [f"<|im_start|>user\n{QWEN2_VL_IMAGE}What is in this picture?<|im_end|>\n<|im_start|>assistant\n",
               f"<|im_start|>user\n{QWEN2_VL_IMAGE} and {QWEN2_VL_IMAGE}: which?<|im_end|>\n<|im_start|>assistant\n"]
    images = [sample_image(1, (56, 84)), [sample_image(2, (112, 112)), sample_image(0)]]
    want = [oracle.greedy(p, im, NEW_TOKENS) for p, im in zip(prompts, images)]
    first_lp = [oracle.logprobs(p, im)[1][-1] for p, im in zip(prompts, images)]
    oracle.model.to(torch.bfloat16)
    hf_err = max(float((oracle.logprobs(p, im)[1][-1] - lp).abs()[w[0]]) for p, im, lp, w in
                 zip(prompts, images, first_lp, want))
    ok, entries = True, {}
    for dtype in ("float32", "bfloat16"):
        with new_engine(path, dtype) as engine:
            single = engine.generate(prompts[0], GREEDY, image_data=images[0], return_logprob=True)
            batched = engine.generate(prompts, GREEDY, image_data=images, return_logprob=True)
        outs = [single, *batched]
        equal = [first_divergence(o["output_ids"], w) for o, w in zip(outs, [want[0], *want])]
        lp_err = max(abs(o["meta_info"]["output_token_logprobs"][0][0] - float(lp[o["output_ids"][0]]))
                     for o, lp in zip(outs, [first_lp[0], *first_lp]))
        passed = lp_err <= (1e-3 if dtype == "float32" else 2 * hf_err + 1e-2)
        if dtype == "float32":
            passed = passed and equal == [None] * 3
        entries[dtype] = {"ok": passed, "first_divergence": equal, "first_logprob_max_err": lp_err,
                          "hf_bf16_first_logprob_max_err": hf_err}
        ok = ok and passed
        print(f"Qwen2-VL vs HF ({dtype}): {'ok' if passed else 'FAIL'} first divergence (single, batched) {equal} "
              f"of {NEW_TOKENS}, first-token logprob err {lp_err:.2e} (HF bf16 {hf_err:.2e})", flush=True)
    report["qwen2vl_vs_hf"] = {"ok": ok, **entries}
    return ok


def tune_attention(report: dict[str, Any]) -> bool:
    """Launch shapes of the attention kernels on the benchmarks' own shapes (bf16, Llama-3-8B heads):
    prefill 16 x 1024, ragged extends with prefixes, and decode batches like the throughput run's."""
    from radixlm.kernels.triton.attention import AttnConfig

    args = kernel_check.parse_args([])
    checker = kernel_check.Checker(args)
    g = torch.Generator().manual_seed(5)
    ragged = torch.randint(64, 1024, (48,), generator=g).tolist()
    prefixes = torch.randint(0, 1024, (48,), generator=g).tolist()
    long_decode = torch.randint(128, 1536, (256,), generator=g).tolist()
    for cfg in [None, AttnConfig(128, 64, 8, 2), AttnConfig(64, 64, 4, 3), AttnConfig(64, 32, 4, 2),
                AttnConfig(128, 32, 4, 3)]:
        checker.extend(f"16 x 1024 cfg {tuple(cfg) if cfg else 'default'}", [0] * 16, [1024] * 16, config=cfg)
        checker.extend(f"48 ragged+prefix cfg {tuple(cfg) if cfg else 'default'}", prefixes, ragged, config=cfg)
    for cfg in [None, AttnConfig(0, 64, 4, 3), AttnConfig(0, 128, 4, 3), AttnConfig(0, 32, 4, 3),
                AttnConfig(0, 128, 8, 3)]:
        checker.decode(f"B=256 L=128..1536 cfg {tuple(cfg) if cfg else 'default'}", long_decode, config=cfg)
        checker.decode(f"B=1 L=288 cfg {tuple(cfg) if cfg else 'default'}", [288], config=cfg)
    report["attention_tuning"] = [r.__dict__ for r in checker.rows]
    return all(r.ok for r in checker.rows)


ENGINE_CHECKS = {"hf": ("engine vs HF transformers (tiny Llama)", check_engine_vs_hf),
                 "graphs": ("CUDA graphs on vs off", check_graphs),
                 "host_tier": ("the radix cache's host tier", check_host_tier),
                 "overlap": ("overlap scheduling on vs off", check_overlap),
                 "fp8_kv": ("an fp8 KV cache (kv_cache_dtype)", check_fp8_kv),
                 "fused_gemv": ("decode_fused_gemv on vs off", check_fused_gemv),
                 "qwen2vl": ("Qwen2-VL (M-RoPE) vs HF transformers", check_qwen2vl),
                 "fp8_weights": ("fp8 weights (quantization=fp8; gpu_check_quant.py)", lambda ckpt, report:
                                 quant_check.check_fp8_weights(ckpt, report, DEVICE, prompts_for(
                                     ModelConfig.from_dir(ckpt).vocab_size))),
                 "spec_graphs": ("verify steps on the decode CUDA graphs (gpu_check_spec.py)", lambda ckpt, report:
                                 spec_check.check_spec_graphs(ckpt, report, DEVICE)),
                 "eagle_graphs": ("EAGLE / EAGLE-3 on CUDA graphs (gpu_check_spec.py)", lambda ckpt, report:
                                  spec_check.check_eagle_graphs(ckpt, report, DEVICE)),
                 "spec_trees": ("draft trees through the tree-masked extend (gpu_check_spec.py)", lambda ckpt, report:
                                spec_check.check_spec_trees(ckpt, report, DEVICE))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep", action="store_true", help="also time alternative attention launch shapes")
    p.add_argument("--skip-kernels", action="store_true")
    p.add_argument("--tune", action="store_true", help="time attention launch shapes on the benchmarks' shapes")
    p.add_argument("--out", help="write the engine checks' results as JSON here")
    p.add_argument("--cpu-smoke", action="store_true", help="run the engine checks on the CPU (script logic only)")
    p.add_argument("--checks", nargs="+", choices=ENGINE_CHECKS, default=list(ENGINE_CHECKS),
                   help="which engine checks to run (default: all)")
    args = p.parse_args(argv)
    global DEVICE
    if args.cpu_smoke:
        DEVICE, args.skip_kernels = "cpu", True
    elif not torch.cuda.is_available():
        print("no CUDA device: run on the GPU machine (or --cpu-smoke)", file=sys.stderr)
        return 2
    report: dict[str, Any] = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    ok = True
    if not args.skip_kernels:
        print("== kernels at real sizes", flush=True)
        code = kernel_check.main(["--sweep"] if args.sweep else [])
        report["kernels_ok"] = code == 0
        ok = ok and code == 0
    if args.tune:
        print("== attention launch shapes on the benchmark shapes", flush=True)
        ok = tune_attention(report) and ok
    ckpt = build_checkpoint(tempfile.mkdtemp(prefix="radixlm-gpu-check-") + "/tiny", "llama")
    for name in args.checks:
        title, check = ENGINE_CHECKS[name]
        print(f"== {title}", flush=True)
        ok = check(ckpt, report) and ok
    report["ok"] = ok
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    print(f"\nGPU check: {'all ok' if ok else 'FAILED'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
