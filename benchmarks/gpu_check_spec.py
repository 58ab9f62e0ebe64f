"""gpu_check.py's step for speculative decoding's verify steps on CUDA graphs (issue 36). A verify step (each
request's newest token and its draft, logits at every token) replays the decode graphs with one decode row
per token (core/runtime/execution/cuda_graph_runner.as_decode_rows); these checks hold it against the eager
extend it replaces, on the tiny Llama (float32 and bfloat16) and on the Llama-3-8B shape (bfloat16, random
weights):

1. Verify logits, graphs on against off, in one engine's runner: after an eager prefill of each request's
   context (one spanning several KV splits), verify steps of 1 request with 8 drafts, 3 with 4, and 8
   with 0 to 8 (ride-alongs among them), whose logits come from a decode-graph replay (counted), against
   the eager extend of the same tokens into the same slots. Bound on every row's relative error
   (max |on - off| / max |off|): 1e-4 in float32 (the two paths differ in summation order only), 1e-1 in
   bfloat16 (rounding through every layer, 5.6e-2 measured on the 8B shape; a wrong key, slot or mask
   moves a row by its whole size). Rows whose argmax
   differs are reported.
2. Greedy tokens with speculation drafting at every step (speculative_adaptive off; the drafts are the
   output without speculation, one token of most corrupted, so that every accepted length occurs),
   graphs on against off, and against speculation off: float32 equal; bfloat16
   reported (the two paths round differently, so near-ties of random weights may go either way). The
   graphs-on engine's verify steps must have replayed the decode graphs.

3. EAGLE on the graphs (check_eagle_graphs, `--checks eagle_graphs`): the target's decode and verify steps
   replay its decode graphs, which export the hidden states the head reads; the head's own decode steps
   replay graphs of their own. Greedy outputs and the head's every input, graphs on against off.

4. Draft trees (check_spec_trees, `--checks spec_trees`): tree verify steps run eagerly, their rows attending
   through the extend kernel's tree mask; greedy outputs against speculation off.

    python3 benchmarks/gpu_check.py --skip-kernels --checks spec_graphs eagle_graphs spec_trees --out gpu_check.json
    python3 benchmarks/gpu_check.py --cpu-smoke --checks spec_graphs eagle_graphs  # the logic, graphs' eager twin
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import make_model_dir  # noqa: E402

import radixlm  # noqa: E402
from radixlm.core.runtime.execution.batch_input import BatchInput  # noqa: E402
from radixlm.core.runtime.execution.cuda_graph_runner import DecodeGraphRunner  # noqa: E402
from radixlm.testing.checkpoints import build_checkpoint  # noqa: E402
from radixlm.testing.eagle import (build_eagle3_head, build_eagle_head, count_replays, head_inputs_differ,  # noqa: E402
                                   record_head_inputs, skip_some_drafts)
from radixlm.testing.speculative import OracleProposer  # noqa: E402

GRAPH_MAX_BS = 32  # 3 requests x 9 rows fit
# fp32 checks the arithmetic (1.7e-6 measured on an H100); in bf16 the graphs' decode kernels and the eager
# extend's round differently, through every layer: 1.8e-2 on the tiny model, 5.6e-2 on the 8B shape's 32
# layers (2026-12-07), so bf16 is held to 1e-1 (a wrong mask or position is O(1)).
REL_BOUND = {"float32": 1e-4, "bfloat16": 1e-1}
# (context lengths, draft lengths) of the verify steps of check 1
VERIFY_CASES = [([1500], [8]), ([40, 300, 7], [4, 4, 4]), ([20, 90, 3, 64, 1, 200, 33, 5], [8, 0, 3, 1, 0, 6, 2, 2])]
PROMPTS = [list(range(200, 230)) * 3 + [200, 201], [9, 8, 7] * 10, list(range(50, 120)) * 2]  # distinct
GREEDY = {"max_new_tokens": 32, "temperature": 0.0, "ignore_eos": True}


def replay_counter(runner: Any, device: str) -> list[int]:
    """Counts the runner's decode-graph replays that were verify steps (rows sharing a request); on the
    CPU first gives the runner the graphs' eager twin (the same padded static buffers, no capture)."""
    if runner.graph_runner is None and device == "cpu":
        runner.graph_runner = DecodeGraphRunner(runner, GRAPH_MAX_BS, capture=False)
    graphs, verify_rows = runner.graph_runner, []
    real_run = graphs.run

    def run(batch: BatchInput) -> torch.Tensor:
        if len(set(batch.rows)) < len(batch.rows):
            verify_rows.append(len(batch.rows))
        return real_run(batch)

    graphs.run = run
    return verify_rows


def verify_logits(runner: Any, contexts: list[int], drafts: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(graphs on, graphs off) logits of one verify step after an eager prefill of the contexts. Slots are
    taken from 1 on: the engine is idle and its allocator never sees them."""
    g = torch.Generator().manual_seed(seed)
    vocab = runner.cfg.vocab_size
    rows = [runner.req_to_token.alloc() for _ in contexts]
    prefill = BatchInput(False, [], [], [], rows, list(contexts), list(contexts), [])
    verify = BatchInput(False, [], [], [], rows, [c + d + 1 for c, d in zip(contexts, drafts)],
                        [d + 1 for d in drafts], [])
    at = 1
    for row, context, draft in zip(rows, contexts, drafts):
        slots = list(range(at, at + context + draft + 1))
        at += len(slots)
        runner.req_to_token.write(row, 0, slots)
        prefill.input_ids += torch.randint(0, vocab, (context,), generator=g).tolist()
        prefill.positions += range(context)
        prefill.out_cache_loc += slots[:context]
        verify.input_ids += torch.randint(0, vocab, (draft + 1,), generator=g).tolist()
        verify.positions += range(context, context + draft + 1)
        verify.out_cache_loc += slots[context:]
    verify.logit_rows = list(range(len(verify.input_ids)))
    graphs = runner.graph_runner
    try:
        runner.graph_runner = None
        runner.forward(prefill)
        off = runner.forward(verify).clone()
        runner.graph_runner = graphs
        on = runner.forward(verify).clone()
    finally:
        runner.graph_runner = graphs
        for row in rows:
            runner.req_to_token.free(row)
    return on, off


def logits_on_off(engine: radixlm.Engine, dtype: str, device: str) -> dict[str, Any]:
    runner = engine._runner
    replays = replay_counter(runner, device)
    cases = []
    for i, (contexts, drafts) in enumerate(VERIFY_CASES):
        assert sum(drafts) + len(drafts) <= runner.graph_runner.max_bs
        on, off = verify_logits(runner, contexts, drafts, seed=i)
        rel = ((on - off).abs().amax(dim=-1) / off.abs().amax(dim=-1)).max()
        cases.append({"contexts": contexts, "drafts": drafts, "max_rel_err": float(rel),
                      "finite": bool(torch.isfinite(on).all()),
                      "argmax_differs": int((on.argmax(-1) != off.argmax(-1)).sum()), "rows": on.shape[0]})
    ok = len(replays) == len(VERIFY_CASES) and all(c["finite"] and c["max_rel_err"] <= REL_BOUND[dtype]
                                                   for c in cases)
    return {"ok": ok, "graph_replays": len(replays), "cases": cases}


def greedy_on_off(ckpt: str, dtype: str, device: str, opts: dict[str, Any]) -> dict[str, Any]:
    common = {"dtype": dtype, "device": device, "log_level": "warning", "max_total_tokens": 16384,
              "cuda_graph_max_bs": GRAPH_MAX_BS, "enable_overlap_schedule": False, **opts}
    spec = {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 8, "speculative_adaptive": False}
    out: dict[str, list[list[int]]] = {}
    verify_replays: list[int] = []
    for label, kw in (("plain", {}), ("spec_graphs", spec), ("spec_eager", {**spec, "disable_cuda_graph": True})):
        with radixlm.Engine(ckpt, **common, **kw) as e:
            if label == "spec_graphs":
                verify_replays = replay_counter(e._runner, device)
            if kw:
                speculator = e.frontend.scheduler.scheduler.speculator
                expected = {tuple(p): o for p, o in zip(PROMPTS, out["plain"])}
                speculator.proposer = OracleProposer(expected, e.vocab_size)
            out[label] = [o["output_ids"] for o in e.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
            out[label] += [e.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)["output_ids"]]  # batch 1
            if kw:
                out[label + "_verify_steps"] = e.get_stats()["spec_verify_steps_total"]

    def first_diff(a: list[list[int]], b: list[list[int]]) -> list[int | None]:
        return [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), None) for p, q in zip(a, b)]

    result = {"graphs_vs_eager_first_difference": first_diff(out["spec_graphs"], out["spec_eager"]),
              "graphs_vs_plain_first_difference": first_diff(out["spec_graphs"], out["plain"]),
              "verify_steps": out["spec_graphs_verify_steps"], "verify_graph_replays": len(verify_replays)}
    equal = out["spec_graphs"] == out["spec_eager"] == out["plain"]
    replayed = len(verify_replays) > 0 and len(verify_replays) == out["spec_graphs_verify_steps"]
    result["ok"] = replayed and (equal or dtype == "bfloat16")
    return result


def check_spec_graphs(tiny: str, report: dict[str, Any], device: str) -> bool:
    ok = True
    models = [("tiny", tiny, "float32", {}), ("tiny", tiny, "bfloat16", {})]
    if device == "cuda":
        big, extra = make_model_dir("llama3-8b-shape", tempfile.mkdtemp(prefix="radixlm-spec-check-"))
        # no extend graphs: what is checked is the decode graphs, and capturing those takes minutes at 8B
        models.append(("llama3_8b_shape", big, "bfloat16", {**extra, "cuda_graph_max_extend_tokens": 0}))
    for name, ckpt, dtype, opts in models:
        with radixlm.Engine(ckpt, dtype=dtype, device=device, log_level="warning", max_total_tokens=16384,
                            cuda_graph_max_bs=GRAPH_MAX_BS, **opts) as e:
            logits = logits_on_off(e, dtype, device)
        greedy = greedy_on_off(ckpt, dtype, device, opts)
        report[f"spec_graphs_{name}_{dtype}"] = {"logits": logits, "greedy": greedy}
        ok = ok and logits["ok"] and greedy["ok"]
        worst = max(c["max_rel_err"] for c in logits["cases"])
        print(f"verify on decode graphs, {name} {dtype}: logits {'ok' if logits['ok'] else 'FAIL'} (max rel err "
              f"{worst:.2e}, bound {REL_BOUND[dtype]:.0e}, argmax differs in "
              f"{sum(c['argmax_differs'] for c in logits['cases'])} of {sum(c['rows'] for c in logits['cases'])} rows, "
              f"{logits['graph_replays']} replays); greedy {'ok' if greedy['ok'] else 'FAIL'} "
              f"(first difference graphs vs eager {greedy['graphs_vs_eager_first_difference']}, vs plain "
              f"{greedy['graphs_vs_plain_first_difference']}; {greedy['verify_graph_replays']} of "
              f"{greedy['verify_steps']} verify steps replayed)", flush=True)
    return ok


# ---- EAGLE on the CUDA graphs (issue 36): the target's steps export its hidden states from the decode graphs
# and the head's own decode steps replay graphs of their own.

EAGLE_STEPS = 4
# fp32: the head's inputs on the graphs against eager steps differ by summation order only (the target's
# states straight from its kernels, the head's outputs one layer later); a wrong row, position or a state
# overwritten by a later replay is O(1).
HEAD_INPUT_BOUND = 1e-3


def eagle_run(ckpt: str, head: str, algorithm: str, dtype: str, device: str, graphs: bool) -> dict[str, Any]:
    """Greedy outputs of PROMPTS (a batch, then PROMPTS[0] alone) with the head drafting EAGLE_STEPS tokens
    at every step but one request's step in three (skip_some_drafts), the head's every input, and the
    decode-graph replays of the target (verify steps: rows sharing a request) and of the head."""
    opts = {"dtype": dtype, "device": device, "log_level": "warning", "max_total_tokens": 16384,
            "cuda_graph_max_bs": GRAPH_MAX_BS, "enable_overlap_schedule": False, "speculative_algorithm": algorithm,
            "speculative_draft_model_path": head, "speculative_num_steps": EAGLE_STEPS,
            "speculative_adaptive": False, "disable_cuda_graph": not graphs}
    with radixlm.Engine(ckpt, **opts) as e:
        inputs = record_head_inputs(e)
        skip_some_drafts(e)
        target, heads = [], []
        if graphs:
            target = count_replays(e._runner, GRAPH_MAX_BS)
            heads = count_replays(e.frontend.scheduler.scheduler.speculator.proposer.runner, GRAPH_MAX_BS)
        out = [o["output_ids"] for o in e.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
        out.append(e.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)["output_ids"])
        verify_steps = e.get_stats()["spec_verify_steps_total"]
    return {"outputs": out, "inputs": inputs, "verify_steps": verify_steps,
            "target_verify_replays": sum(len(set(b.rows)) < len(b.rows) for b in target),
            "target_decode_replays": sum(len(set(b.rows)) == len(b.rows) for b in target), "head_replays": len(heads)}


def check_eagle_graphs(tiny: str, report: dict[str, Any], device: str) -> bool:
    """`eagle` on the tiny Llama and `eagle3` on an 8-layer one (random heads), float32 and bfloat16: graphs
    on against off (disable_cuda_graph) and against speculation off. float32: outputs equal, the head's
    inputs within HEAD_INPUT_BOUND; bfloat16: reported (near-ties of random weights may round either
    way); both: the target's verify steps and the head's steps replayed graphs."""
    root = tempfile.mkdtemp(prefix="radixlm-eagle-check-")
    deep = build_checkpoint(f"{root}/llama8", "llama", num_hidden_layers=8)
    cases = [("eagle", tiny, build_eagle_head(f"{root}/eagle", tiny)),
             ("eagle3", deep, build_eagle3_head(f"{root}/eagle3", deep, draft_vocab=300))]
    ok = True
    for algorithm, ckpt, head in cases:
        for dtype in ("float32", "bfloat16"):
            with radixlm.Engine(ckpt, dtype=dtype, device=device, log_level="warning", max_total_tokens=16384,
                                cuda_graph_max_bs=GRAPH_MAX_BS, enable_overlap_schedule=False) as e:
                plain = [o["output_ids"] for o in e.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
                plain.append(e.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)["output_ids"])
            on, off = (eagle_run(ckpt, head, algorithm, dtype, device, graphs) for graphs in (True, False))
            differ = head_inputs_differ(on["inputs"], off["inputs"], HEAD_INPUT_BOUND)
            result = {key: on[key] for key in ("verify_steps", "target_verify_replays", "target_decode_replays",
                                                "head_replays")}
            result.update(outputs_equal_eager=on["outputs"] == off["outputs"],
                          outputs_equal_plain=on["outputs"] == plain,
                          head_inputs_differ=differ, head_inputs=sum(len(v) for v in on["inputs"].values()))
            replayed = on["target_verify_replays"] > 0 and on["head_replays"] > 0
            exact = result["outputs_equal_eager"] and result["outputs_equal_plain"] and not differ
            result["ok"] = replayed and (exact or dtype == "bfloat16")
            report[f"eagle_graphs_{algorithm}_{dtype}"] = result
            ok = ok and result["ok"]
            print(f"{algorithm} on CUDA graphs, {dtype}: {'ok' if result['ok'] else 'FAIL'} (outputs equal to eager "
                  f"{result['outputs_equal_eager']}, to plain {result['outputs_equal_plain']}; head inputs "
                  f"{'equal' if not differ else differ[:2]} over {result['head_inputs']}; replays: "
                  f"{on['target_verify_replays']} of {on['verify_steps']} verify steps, "
                  f"{on['target_decode_replays']} decode, {on['head_replays']} head)",
                  flush=True)
    return ok


# ---- Draft trees (issue 36): a verify step of a tree runs eagerly, its rows attending through the extend
# kernel's tree mask (ancestor bits) to the request's prefix and their own ancestors only.

def tree_outputs(ckpt: str, dtype: str, device: str, spec: dict[str, Any], oracle: dict | None) -> tuple[list, int]:
    """Greedy outputs of PROMPTS (a batch, then PROMPTS[0] alone) with `spec`; with `oracle` (prompt ->
    plain output) its drafts come from OracleProposer's trees (the truth beside wrong branches that come
    first among siblings); the engine's verify steps."""
    with radixlm.Engine(ckpt, dtype=dtype, device=device, log_level="warning", max_total_tokens=16384,
                        enable_overlap_schedule=False, **spec) as e:
        if oracle is not None:
            e.frontend.scheduler.scheduler.speculator.proposer = OracleProposer(oracle, e.vocab_size, tree=True)
        out = [o["output_ids"] for o in e.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
        out.append(e.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)["output_ids"])
        return out, e.get_stats()["spec_verify_steps_total"] if spec else 0


def check_spec_trees(tiny: str, report: dict[str, Any], device: str) -> bool:
    """Greedy outputs with draft trees against speculation off on the tiny Llama, float32 (equal) and
    bfloat16 (reported): oracle trees through `ngram`'s verify path, and `eagle` with
    speculative_eagle_topk 2 (a random head: its trees are mostly rejected, the verify path is what is
    checked)."""
    head = build_eagle_head(tempfile.mkdtemp(prefix="radixlm-tree-check-") + "/eagle", tiny)
    runs = {"oracle_tree": ({"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 8,
                             "speculative_adaptive": False}, True),
            "eagle_topk2": ({"speculative_algorithm": "eagle", "speculative_draft_model_path": head,
                             "speculative_eagle_topk": 2, "speculative_num_steps": 3,
                             "speculative_num_draft_tokens": 6, "speculative_adaptive": False}, False)}
    ok = True
    for dtype in ("float32", "bfloat16"):
        plain, _ = tree_outputs(tiny, dtype, device, {}, None)
        oracle = {tuple(p): o for p, o in zip(PROMPTS, plain)}
        for name, (spec, use_oracle) in runs.items():
            out, steps = tree_outputs(tiny, dtype, device, spec, oracle if use_oracle else None)
            equal = out == plain
            good = steps > 0 and (equal or dtype == "bfloat16")
            report[f"spec_trees_{name}_{dtype}"] = {"ok": good, "outputs_equal_plain": equal, "verify_steps": steps}
            ok = ok and good
            print(f"draft trees, {name} {dtype}: {'ok' if good else 'FAIL'} (outputs equal to plain {equal}, "
                  f"{steps} verify steps)", flush=True)
    return ok
