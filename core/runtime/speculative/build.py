"""The speculator an engine's options ask for (None when speculative decoding is off)."""

from __future__ import annotations

import dataclasses
from typing import Any

from radixlm.core.runtime.execution.hidden_export import HiddenExport
from radixlm.core.runtime.execution.model_runner import ModelRunner
from radixlm.core.runtime.options import EngineOptions
from radixlm.core.errors import InvalidRequestError
from radixlm.core.runtime.models.config import ModelConfig
from radixlm.core.runtime.models.hub import locate_model
from radixlm.core.runtime.models.eagle import load_eagle_head
from radixlm.core.runtime.speculative.draft_model import DraftModelProposer
from radixlm.core.runtime.speculative.eagle import EagleProposer
from radixlm.core.runtime.speculative.eagle_tree import EagleTreeProposer
from radixlm.core.runtime.speculative.ngram import NgramProposer
from radixlm.core.runtime.speculative.proposer import Proposer
from radixlm.core.runtime.speculative.speculator import Speculator


def build_speculator(opts: EngineOptions, runner: Any, executor: Any, context_len: int) -> Speculator | None:
    algorithm = opts.speculative_algorithm
    if algorithm is None:
        return None
    proposer: Proposer
    max_draft = opts.speculative_num_draft_tokens
    if algorithm == "ngram":
        proposer = NgramProposer(opts.speculative_ngram_min_match_window_size,
                                 opts.speculative_ngram_max_match_window_size, opts.speculative_ngram_radix_cache,
                                 opts.speculative_ngram_max_bfs_breadth)
    elif algorithm in ("eagle", "eagle3"):
        proposer = eagle_proposer(opts, runner)
        if opts.speculative_eagle_topk == 1:
            max_draft = opts.speculative_num_steps or max_draft  # a chain: one token per step
    else:
        proposer = draft_proposer(opts, runner)
    executor.memory.release_hooks.append(proposer.release)
    return Speculator(proposer, executor, max_draft, opts.speculative_adaptive, context_len)


def draft_runner(opts: EngineOptions, target: Any) -> ModelRunner:
    """The draft checkpoint's runner: a KV pool of as many tokens as the target's, the same dtype and
    request rows. On CUDA its weights and pool come out of the memory the target left free."""
    path, _ = locate_model(opts.speculative_draft_model_path)
    cfg = ModelConfig.from_dir(path)
    if cfg.context_len < (opts.context_length or target.cfg.context_len):
        raise InvalidRequestError(f"the draft model's context ({cfg.context_len} tokens) is shorter than the "
                                  "target's: lower context_length to it", "speculative_draft_model_path")
    draft_opts = dataclasses.replace(opts, max_total_tokens=target.num_slots, speculative_algorithm=None)
    return ModelRunner(path, cfg, draft_opts)


def eagle_proposer(opts: EngineOptions, target: Any) -> EagleProposer:
    """The EAGLE head over the target's model, in a runner of its own (one layer of KV, as many tokens as
    the target's pool, the target's context), exporting its outputs; on CUDA its decode steps replay graphs
    of their own, as the target's do (whose runner exports the states the head reads: target_export)."""
    path, _ = locate_model(opts.speculative_draft_model_path)
    version = 3 if opts.speculative_algorithm == "eagle3" else 1
    head, cfg = load_eagle_head(path, target.model, target.dtype, target.device, target.ops, version)
    # its logits (its graphs' buffer) are over the target's vocabulary, whatever its config says (EAGLE-3's
    # lm_head covers a draft vocabulary)
    cfg = dataclasses.replace(cfg, context_len=target.cfg.context_len, vocab_size=target.cfg.vocab_size)
    head_opts = dataclasses.replace(opts, max_total_tokens=target.num_slots, speculative_algorithm=None)
    head_runner = ModelRunner(path, cfg, head_opts, model=head, export=HiddenExport())
    if opts.speculative_eagle_topk > 1:
        steps = opts.speculative_num_steps or opts.speculative_num_draft_tokens
        proposer = EagleTreeProposer(head_runner, target, target.cfg.vocab_size, opts.speculative_eagle_topk, steps)
    else:
        proposer = EagleProposer(head_runner, target, target.cfg.vocab_size)
    proposer.name = opts.speculative_algorithm
    return proposer


def draft_proposer(opts: EngineOptions, target: Any) -> DraftModelProposer:
    # Models of one family may pad their vocabularies differently: drafts stay within the target's.
    return DraftModelProposer(draft_runner(opts, target), target.cfg.vocab_size)
