"""The verify step's pieces: its model input (each request's newest token and its draft as one extend),
the requests as the sampler sees them at each verify row, and the grammar's mask at each row. Drafts are
trees (core.runtime.speculative.tree; a chain is one)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from radixlm.core.runtime.execution.batch_input import BatchInput
from radixlm.core.runtime.request import Req
from radixlm.core.runtime.speculative.tree import DraftTree


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


def verify_batch(reqs: list[Req], drafts: list[DraftTree], slots: list[int], table: Any) -> tuple[BatchInput, list[list[int]]]:
    """One extend step computing, per request, its newest token (which has no KV yet) followed by its
    draft's nodes, into `slots` (written to the request-to-token table here, in row order), with logits at
    every row. A node's position is the newest token's plus its depth; where any draft is a tree (not a
    chain) the step carries every row's parent, so that rows attend to their ancestors only. Returns the
    input and each request's slots."""
    batch = BatchInput(False, [], [], [], [], [], [], [])
    mine: list[list[int]] = []
    trees = not all(d.is_chain for d in drafts)
    batch.tree_parents = [] if trees else None
    at = 0
    for req, draft in zip(reqs, drafts):
        n, start = len(draft) + 1, req.seq_len - 1
        own = slots[at:at + n]
        at += n
        table.write(req.row, start, own)
        mine.append(own)
        batch.input_ids.append(req.output_ids[-1])
        batch.input_ids.extend(draft.tokens)
        batch.positions.append(start)
        batch.positions.extend(start + draft.depth(i) for i in range(len(draft)))
        batch.out_cache_loc.extend(own)
        batch.rows.append(req.row)
        batch.seq_lens.append(start + n)
        batch.extend_lens.append(n)
        if trees:
            batch.tree_parents.extend(draft.row_parents())
    batch.logit_rows = list(range(len(batch.input_ids)))
    if any(req.inp.rope_delta for req in reqs):  # M-RoPE after images: positions shifted, t = h = w (as decoding)
        deltas = [req.inp.rope_delta for req, draft in zip(reqs, drafts) for _ in range(len(draft) + 1)]
        shifted = [p + d for p, d in zip(batch.positions, deltas)]
        batch.rope_positions = [shifted, shifted, shifted]
    return batch, mine


def views(req: Req, draft: DraftTree) -> list[DraftView]:
    """The request at each of its verify rows: the root (no draft token), then each node after its path."""
    return [DraftView(req, [])] + [DraftView(req, draft.path_tokens(i)) for i in range(len(draft))]


def allows(mask: torch.Tensor, token: int, packed: bool) -> bool:
    if packed:  # int32 words, bit token % 32 of word token // 32
        return token < mask.numel() * 32 and bool((int(mask[token // 32]) >> (token % 32)) & 1)
    return token < mask.numel() and bool(mask[token])


def constrained_draft(req: Req, draft: DraftTree, vocab_size: int,
                      packed: bool) -> tuple[DraftTree, list[torch.Tensor | None]]:
    """The draft without its nodes the request's grammar forbids after their path (or after which the
    grammar is done: the request ends there), and their subtrees; and the grammar's mask at each verify
    row. A copy of the constraint walks each node's path (a fork of its parent's); the request's own
    stays where it is."""
    c = req.constraint
    if c is None:
        return draft, [None] * (len(draft) + 1)
    walkers = {-1: c.fork()}
    masks = [walkers[-1].allowed_token_mask(vocab_size, packed)]
    row_mask = {-1: masks[0]}
    kept = DraftTree([], [])
    index: dict[int, int] = {-1: -1}  # node -> its index in `kept`
    children_left = Counter(draft.parents)
    for i, (token, parent) in enumerate(zip(draft.tokens, draft.parents)):
        children_left[parent] -= 1
        if parent not in index or not allows(row_mask[parent], token, packed):
            continue
        # A parent's last child takes its walker (a chain forks nothing); earlier ones walk a copy.
        walker = walkers.pop(parent) if children_left[parent] == 0 else walkers[parent].fork()
        walker.advance(token)
        if walker.is_finished():
            continue
        index[i], walkers[i] = len(kept), walker
        kept.tokens.append(token)
        kept.parents.append(index[parent])
        row_mask[i] = walker.allowed_token_mask(vocab_size, packed)
        masks.append(row_mask[i])
    return kept, masks
