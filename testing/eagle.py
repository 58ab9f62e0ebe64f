"""Tiny EAGLE-1/2 and EAGLE-3 heads for tests: the published layouts (core.runtime.models.eagle) for a target
checkpoint; and what tests and GPU checks watch of an engine's EAGLE proposer: the head's inputs and the
decode graphs' replays (on the CPU, of the graphs' eager twin)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from radixlm.core.runtime.execution.batch_input import BatchInput
from radixlm.core.runtime.execution.cuda_graph_runner import DecodeGraphRunner


class _Head:
    """What both layouts' builders share: the target's config with `updates`, its sizes (hidden h,
    intermediate i, q and kv widths), a seeded random source, and the writing of the head."""

    def __init__(self, target_dir: str, seed: int, scale: float, **updates) -> None:
        self.cfg = json.loads(Path(target_dir, "config.json").read_text())
        self.vocab = self.cfg["vocab_size"]
        self.cfg.update(num_hidden_layers=1, **updates)
        self.h, self.i = self.cfg["hidden_size"], self.cfg["intermediate_size"]
        d = self.cfg.get("head_dim") or self.h // self.cfg["num_attention_heads"]
        self.q, self.kv = self.cfg["num_attention_heads"] * d, self.cfg["num_key_value_heads"] * d
        self.g = torch.Generator().manual_seed(seed)
        self.scale = scale

    def rand(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.g) * self.scale

    def write(self, out_dir: str, tensors: dict[str, torch.Tensor]) -> str:
        from safetensors.torch import save_file

        os.makedirs(out_dir, exist_ok=True)
        save_file(tensors, os.path.join(out_dir, "model.safetensors"))
        Path(out_dir, "config.json").write_text(json.dumps(self.cfg, indent=2))
        return out_dir


def build_eagle_head(out_dir: str, target_dir: str, *, seed: int = 0, fc_bias: bool = True,
                     scale: float = 0.2, embedding: bool = True) -> str:
    """Writes a random head for the checkpoint at target_dir into out_dir (config.json as the EAGLE
    repository writes it: the target's config with one layer; model.safetensors with fc and layers.0
    without an input norm, and, with `embedding`, the target-sized embed_tokens the published heads
    carry too); returns out_dir."""
    head = _Head(target_dir, seed, scale, bias=fc_bias)
    h, i, q, kv, rand = head.h, head.i, head.q, head.kv, head.rand
    tensors = {"fc.weight": rand(h, 2 * h),
               "layers.0.self_attn.q_proj.weight": rand(q, h), "layers.0.self_attn.k_proj.weight": rand(kv, h),
               "layers.0.self_attn.v_proj.weight": rand(kv, h), "layers.0.self_attn.o_proj.weight": rand(h, q),
               "layers.0.mlp.gate_proj.weight": rand(i, h), "layers.0.mlp.up_proj.weight": rand(i, h),
               "layers.0.mlp.down_proj.weight": rand(h, i),
               "layers.0.post_attention_layernorm.weight": 1 + rand(h)}
    if fc_bias:
        tensors["fc.bias"] = rand(h)
    if embedding:
        tensors["embed_tokens.weight"] = rand(head.vocab, h)
    return head.write(out_dir, tensors)


def build_eagle3_head(out_dir: str, target_dir: str, *, seed: int = 0, draft_vocab: int | None = None,
                      scale: float = 0.2) -> str:
    """Writes a random EAGLE-3 head for the checkpoint at target_dir into out_dir: config.json with one
    layer and draft_vocab_size; model.safetensors with fc (3 x hidden -> hidden), midlayer (q/k/v over
    2 x hidden), norm, lm_head over `draft_vocab` tokens (default: the target's vocabulary) and, when
    smaller, d2t mapping them to every few target ids (t2d beside it); returns out_dir."""
    head = _Head(target_dir, seed, scale, architectures=["LlamaForCausalLMEagle3"])
    vocab = head.vocab
    draft_vocab = head.cfg["draft_vocab_size"] = draft_vocab or vocab
    h, i, q, kv, rand, g = head.h, head.i, head.q, head.kv, head.rand, head.g
    p = "midlayer."
    tensors = {"fc.weight": rand(h, 3 * h), f"{p}self_attn.q_proj.weight": rand(q, 2 * h),
               f"{p}self_attn.k_proj.weight": rand(kv, 2 * h), f"{p}self_attn.v_proj.weight": rand(kv, 2 * h),
               f"{p}self_attn.o_proj.weight": rand(h, q), f"{p}mlp.gate_proj.weight": rand(i, h),
               f"{p}mlp.up_proj.weight": rand(i, h), f"{p}mlp.down_proj.weight": rand(h, i),
               f"{p}hidden_norm.weight": 1 + rand(h), f"{p}input_layernorm.weight": 1 + rand(h),
               f"{p}post_attention_layernorm.weight": 1 + rand(h), "norm.weight": 1 + rand(h),
               "lm_head.weight": rand(draft_vocab, h)}
    if draft_vocab < vocab:
        ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
        tensors["d2t"] = ids - torch.arange(draft_vocab)
        tensors["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill(0, ids, True)
    return head.write(out_dir, tensors)


def record_head_inputs(engine: Any) -> dict[tuple[int, ...], list[tuple[int, int, torch.Tensor, bool]]]:
    """Starts recording every input of the engine's EAGLE head, per prompt (its input ids) in the order the
    head reads them: (position, token, features row, chain): the target's state at the position (a
    catch-up, chain False) or the head's own last output (a chain step). A request's inputs do not depend
    on the batch it ran in."""
    proposer = engine.frontend.scheduler.scheduler.speculator.proposer
    runner, seen = proposer.runner, {}
    forward = runner.forward

    def record(batch: BatchInput) -> torch.Tensor:
        at = 0
        for req, n in zip(proposer.in_step, batch.extend_lens):
            rows = zip(batch.positions[at:at + n], batch.input_ids[at:at + n], batch.features[at:at + n].cpu().clone(),
                       [batch.is_decode] * n)
            seen.setdefault(tuple(req.inp.input_ids), []).extend(rows)
            at += n
        return forward(batch)

    runner.forward = record
    return seen


def skip_some_drafts(engine: Any) -> None:
    """Makes the engine's proposer draft nothing for a request one call in three (a request of a batch that
    the adaptive policy leaves out, or a plain decode step at batch 1), by a rule that does not depend on
    timing: the head then catches up over target states of several steps."""
    proposer = engine.frontend.scheduler.scheduler.speculator.proposer
    propose, calls = proposer.propose, []

    def skipping(reqs: list[Any], budgets: list[int]) -> list[list[int]]:
        calls.append(1)
        return propose(reqs, [0 if (len(calls) + i) % 3 == 0 else k for i, k in enumerate(budgets)])

    proposer.propose = skipping


def count_replays(runner: Any, max_bs: int) -> list[BatchInput]:
    """Starts recording the batches the runner's decode graphs replay; a runner without graphs (the CPU)
    first gets the graphs' eager twin (the same padded static buffers, no capture) of up to max_bs rows."""
    if runner.graph_runner is None and runner.device.type == "cpu":
        runner.graph_runner = DecodeGraphRunner(runner, max_bs, capture=False)
    graphs, seen = runner.graph_runner, []
    if graphs is None:  # none captured (disable_cuda_graph, or a capture that failed): nothing replays
        return seen
    real_run = graphs.run
    graphs.run = lambda batch: seen.append(batch) or real_run(batch)
    return seen


def head_inputs_differ(a: dict, b: dict, tol: float) -> list[str]:
    """Where two recordings of record_head_inputs differ: prompts, counts, positions or tokens, or a feature
    row further than `tol` (relative to the row's largest value) from the other's; [] when they agree."""
    if a.keys() != b.keys():
        return ["the prompts differ"]
    out = []
    for prompt in a:
        if len(a[prompt]) != len(b[prompt]):
            out.append(f"prompt {prompt[:4]}...: {len(a[prompt])} vs {len(b[prompt])} inputs")
            continue
        for i, ((pa, ta, fa, ca), (pb, tb, fb, cb)) in enumerate(zip(a[prompt], b[prompt])):
            err = float((fa.float() - fb.float()).abs().max() / fb.float().abs().max().clamp_min(1e-30))
            if (pa, ta, ca) != (pb, tb, cb) or fa.shape != fb.shape or not err <= tol:
                out.append(f"prompt {prompt[:4]}... input {i}: {(pa, ta, ca, tuple(fa.shape))} vs "
                           f"{(pb, tb, cb, tuple(fb.shape))}, features rel err {err:.2e}")
                break
    return out
