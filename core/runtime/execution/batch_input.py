"""One step's work as the scheduler hands it to the model runner: token ids, positions, KV slots and
the rows of the request-to-token table, in host lists."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radixlm.core.runtime.messages import ImageInput


@dataclass
class ImageSpan:
    """Feature rows [first_row, first_row + count) of an image go to the step's new tokens from
    token_start on."""

    image: ImageInput
    token_start: int
    first_row: int
    count: int


@dataclass
class BatchInput:
    """One step's work in host lists, as the scheduler hands it over.

    For a decode batch the runner itself records each request's new slot in the request-to-token table
    (table[rows[i], positions[i]] = out_cache_loc[i]); extend batches find their slots already written
    by the scheduler (ReqToTokenPool.write)."""

    is_decode: bool
    input_ids: list[int]
    positions: list[int]
    out_cache_loc: list[int]
    rows: list[int]
    seq_lens: list[int]
    extend_lens: list[int]
    logit_rows: list[int]  # which of the new tokens need logits (indices into input_ids)
    # Overlap scheduling: the step's input ids as a device tensor (a decode step's: the previous step's
    # sampled tokens, not yet on the host; an extend step's: its ids with such tokens scattered in); when
    # set, input_ids holds placeholders where those tokens go.
    input_future: torch.Tensor | None = None
    images: list[ImageSpan] = field(default_factory=list)  # extend steps over image positions
    # M-RoPE models (Qwen2-VL), steps holding requests with images: the rotary positions (t, h, w rows);
    # None: the rotary positions are `positions`.
    rope_positions: list[list[int]] | None = None
    # Models that read a float input per token beside its id (an EAGLE head: the target's states or its own
    # outputs), [tokens, width] on the device, in the new tokens' order; None for every other model.
    features: torch.Tensor | None = None
    # Verify steps of draft trees: each new token's parent, as an index among its request's new tokens (-1:
    # the token follows the prefix); attention then sees a token's ancestors only (kernels' tree_mask).
    # None: causal. Such steps run eagerly (no CUDA graph).
    tree_parents: list[int] | None = None
