"""The verify step's pieces: its model input (each request's newest token and its draft as one extend),
the requests as the sampler sees them at each draft position, the grammar's mask at each position, and
how many draft tokens the target agrees with."""

from __future__ import annotations

from typing import Any

import torch

from radixlm.core.runtime.execution.batch_input import BatchInput
from radixlm.core.runtime.request import Req


class DraftView:
    """A request as it would be with `extra` more output tokens: what the sampler reads of it (its
    parameters, its output for penalties, min_new_tokens and seeded draws, its logprob options), so that
    the token sampled at a draft position is the one sampled there without speculation."""

    __slots__ = ("inp", "output_ids")

    def __init__(self, req: Req, extra: list[int]) -> None:
        self.inp = req.inp
        self.output_ids = req.output_ids + extra if extra else req.output_ids

    @property
    def params(self) -> Any:
        return self.inp.sampling_params

    @property
    def fill_ids(self) -> list[int]:
        return self.inp.input_ids + self.output_ids


def verify_batch(reqs: list[Req], drafts: list[list[int]], slots: list[int], table: Any) -> tuple[BatchInput, list[list[int]]]:
    """One extend step computing, per request, its newest token (which has no KV yet) followed by its
    draft, into `slots` (written to the request-to-token table here), with logits at every position.
    Returns the input and each request's slots."""
    batch = BatchInput(False, [], [], [], [], [], [], [])
    mine: list[list[int]] = []
    at = 0
    for req, draft in zip(reqs, drafts):
        n, start = len(draft) + 1, req.seq_len - 1
        own = slots[at:at + n]
        at += n
        table.write(req.row, start, own)
        mine.append(own)
        batch.input_ids.append(req.output_ids[-1])
        batch.input_ids.extend(draft)
        batch.positions.extend(range(start, start + n))
        batch.out_cache_loc.extend(own)
        batch.rows.append(req.row)
        batch.seq_lens.append(start + n)
        batch.extend_lens.append(n)
    batch.logit_rows = list(range(len(batch.input_ids)))
    if any(req.inp.rope_delta for req in reqs):  # M-RoPE after images: positions shifted, t = h = w (as decoding)
        deltas = [req.inp.rope_delta for req, draft in zip(reqs, drafts) for _ in range(len(draft) + 1)]
        shifted = [p + d for p, d in zip(batch.positions, deltas)]
        batch.rope_positions = [shifted, shifted, shifted]
    return batch, mine


def views(req: Req, draft: list[int]) -> list[DraftView]:
    """The request at each position of its verify rows: after 0, 1, ..., len(draft) draft tokens."""
    return [DraftView(req, draft[:j]) for j in range(len(draft) + 1)]


def allows(mask: torch.Tensor, token: int, packed: bool) -> bool:
    if packed:  # int32 words, bit token % 32 of word token // 32
        return token < mask.numel() * 32 and bool((int(mask[token // 32]) >> (token % 32)) & 1)
    return token < mask.numel() and bool(mask[token])


def constrained_draft(req: Req, draft: list[int], vocab_size: int,
                      packed: bool) -> tuple[list[int], list[torch.Tensor | None]]:
    """The draft cut before its first token the request's grammar forbids (or after which the grammar is
    done: the request ends there), and the grammar's mask at each verify row. A copy of the constraint
    walks the draft; the request's own stays where it is."""
    c = req.constraint
    if c is None:
        return draft, [None] * (len(draft) + 1)
    walker = c.fork()
    masks = [walker.allowed_token_mask(vocab_size, packed)]
    kept: list[int] = []
    for token in draft:
        if not allows(masks[-1], token, packed):
            break
        walker.advance(token)
        if walker.is_finished():
            break
        kept.append(token)
        masks.append(walker.allowed_token_mask(vocab_size, packed))
    return kept, masks


def accepted_length(draft: list[int], sampled: list[int]) -> int:
    """How many leading draft tokens equal the tokens the target sampled before them: sampled[j] is the
    target's token after draft[:j]."""
    a = 0
    while a < len(draft) and draft[a] == sampled[a]:
        a += 1
    return a
