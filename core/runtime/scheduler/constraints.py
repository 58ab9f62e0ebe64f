"""Constrained decoding in the scheduler: the next-token mask, jump-forward over forced text, and
when jump-forward continuations wait to gather into one extend step.

A request's constraint is the TokenConstraint of core.runtime.constraint. After a jump the request
computes the forced tokens in an extend step; those continuations are gathered, not run one by one.
"""

from __future__ import annotations

from typing import Any

import torch

from radixlm.core.runtime.request import Req
from radixlm.core.runtime.scheduler.finish import Finish

# Jump-forward continuations wait (decoding goes on) until they are a quarter of the running batch or
# have waited this many steps; not at all when their extend step would chain on a pending decode step.
JUMP_GATHER_RATIO = 4
JUMP_GATHER_STEPS = 4


class JumpGather:
    """When only jump-forward continuations wait, and few next to the decoding batch, lets them gather
    for a few steps: one extend step for many jumps instead of an extend step that syncs nearly every
    step, which made jump-forward slower than plain decoding at batch 64. An extend step chained on a
    pending decode step (overlap) costs about what a decode step does, so then nothing waits: every step
    a continuation waited delayed its request by a step (at batch 64, 61 steps against 55)."""

    def __init__(self) -> None:
        self.waited = 0  # decode steps the continuations have been left waiting

    def should_wait(self, waiting: list[Req], running: list[Req], chains: bool) -> bool:
        if (not chains and running and all(r.row is not None for r in waiting)
                and len(waiting) * JUMP_GATHER_RATIO < len(running) and self.waited < JUMP_GATHER_STEPS):
            self.waited += 1
            return True
        self.waited = 0
        return False


def constraint_mask(req: Req, vocab_size: int, packed: bool) -> torch.Tensor | None:
    """The tokens the request may sample next (None: any); bit-packed with `packed`."""
    c = req.constraint
    return c.allowed_token_mask(vocab_size, packed) if c is not None else None


def jump_forward(req: Req, tokenizer: Any, context_len: int) -> tuple[bool, Finish | None]:
    """Appends the text the constraint forces next as canonical tokens (re-tokenizing the newest
    token with it when that token has no KV yet). Returns whether tokens were appended, and the
    request's finish when the jump ends it (a stop string, the constraint's end, max_new_tokens)."""
    c, p = req.constraint, req.params
    decoded = req.detok.lazy or req.detok.read_offset == len(req.detok.ids)
    max_replace = min(len(req.fill_ids) - req.kv_len, len(req.output_ids)) if decoded else 0
    room = min(p.max_new_tokens - len(req.output_ids), context_len - req.seq_len - 1)
    plan = c.jump_forward(req.output_ids, tokenizer, max_replace=max_replace, max_new_tokens=room)
    if plan is None:
        return False, None
    replaced, tokens = plan
    kept = len(req.output_ids) - replaced
    if kept < req.streamed_ids:  # the stream's next output replaces ids it has already sent
        req.replaced_sent += req.streamed_ids - kept
        req.streamed_ids = kept
    del req.output_ids[kept:]
    req.output_ids.extend(tokens)
    matched = req.detok.replace_tail(replaced, tokens)
    if matched is not None:
        return True, Finish("stop", matched)
    if c.is_finished():
        return True, Finish("stop")
    if len(req.output_ids) >= p.max_new_tokens:
        return True, Finish("length")
    return True, None
