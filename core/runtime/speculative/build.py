"""The speculator an engine's options ask for (None when speculative decoding is off)."""

from __future__ import annotations

from typing import Any

from radixlm.core.engine.options import EngineOptions
from radixlm.core.runtime.speculative.ngram import NgramProposer
from radixlm.core.runtime.speculative.speculator import Speculator


def build_speculator(opts: EngineOptions, runner: Any, executor: Any, context_len: int) -> Speculator | None:
    algorithm = opts.speculative_algorithm
    if algorithm is None:
        return None
    if algorithm == "ngram":
        proposer = NgramProposer(opts.speculative_ngram_min_match_window_size,
                                 opts.speculative_ngram_max_match_window_size)
    else:
        raise ValueError(f"speculative_algorithm {algorithm!r} is not built")
    return Speculator(proposer, executor, opts.speculative_num_draft_tokens, opts.speculative_adaptive, context_len)
