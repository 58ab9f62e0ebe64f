"""A step's model input from the scheduler's plan (BatchInput, host lists), and the prompt logprobs
read from an extend step's logits."""

from __future__ import annotations

import torch

from radixlm.core.runtime.execution.batch_input import BatchInput, ImageSpan
from radixlm.core.runtime.request import Req
from radixlm.core.runtime.execution.sampler import device_tensor, top_logprob_entries
from radixlm.core.runtime.scheduler.prefill import Extend


def extend_batch(extends: list[Extend], future: torch.Tensor | None = None) -> tuple[BatchInput, list[tuple[int, int, int]]]:
    """The extend step's input, and per extend which rows of its logits it uses (input logprob rows,
    then the sampling row) as (first logit index, first position, count). With `future` (overlap: a
    pending decode step's tokens on the device), the extends riding `ahead` take those tokens, in order,
    as their input: the step's input ids go to the device with them scattered in (`input_future`)."""
    batch = BatchInput(False, [], [], [], [], [], [], [])
    logit_use: list[tuple[int, int, int]] = []
    ahead: list[int] = []  # indices of the input ids that come from `future`
    for ext in extends:
        req, base = ext.req, len(batch.input_ids)
        end = ext.start + ext.length
        if ext.ahead:
            ahead.append(base)
            batch.input_ids.append(0)  # a placeholder: the token is on the device
        else:
            batch.input_ids.extend(req.fill_ids[ext.start:end])
        batch.positions.extend(range(ext.start, end))
        batch.out_cache_loc.extend(req.slots[ext.start:end])
        batch.rows.append(req.row)
        batch.seq_lens.append(end)
        batch.extend_lens.append(ext.length)
        # Logits are needed from the first input-logprob position on, and at the last prompt
        # position when the prompt completes (it gives the next token).
        lp_start = req.input_logprob_start()
        first = end if lp_start is None else min(max(lp_start - 1, ext.start), end)
        if ext.finishes_prompt:
            first = min(first, end - 1)
        logit_use.append((len(batch.logit_rows), first, end - first))
        batch.logit_rows.extend(range(base + first - ext.start, base + end - ext.start))
        for image in req.inp.images:  # the step's positions of each image (a chunk may hold part of one)
            lo, hi = max(ext.start, image.offset), min(end, image.offset + image.length)
            if lo < hi:
                batch.images.append(ImageSpan(image, base + lo - ext.start, lo - image.offset, hi - lo))
    if any(ext.req.inp.rope_positions is not None for ext in extends):
        batch.rope_positions = [[], [], []]
        for ext in extends:
            for row, part in zip(batch.rope_positions, rope_positions(ext.req, ext.start, ext.start + ext.length)):
                row.extend(part)
    if ahead:
        assert future is not None and len(ahead) == len(future), "one pending token per extend riding ahead"
        ids, at = device_tensor(batch.input_ids + ahead, torch.int64, future.device).split([len(batch.input_ids), len(ahead)])
        batch.input_future = ids.index_copy(0, at, future)
    return batch, logit_use


def rope_positions(req: Req, start: int, end: int) -> list[list[int]]:
    """The M-RoPE positions (t, h, w rows) of positions [start, end) of a request: its prompt's as the
    front end computed them, later ones (its output, re-prefilled) index + rope_delta; for a request
    without them (text only), t = h = w = index."""
    known = req.inp.rope_positions
    n = 0 if known is None else min(max(known.shape[1] - start, 0), end - start)
    tail = list(range(start + n + req.inp.rope_delta, end + req.inp.rope_delta))
    return [(known[c, start:start + n].tolist() if n else []) + tail for c in range(3)]


def decode_batch(running: list[Req], new_slots: list[int], future: torch.Tensor | None = None) -> BatchInput:
    """One token for every running request, into `new_slots` (the runner records them in the table).
    With `future` (overlap scheduling: the previous step's tokens on the device, one per request in this
    order, not yet appended to their outputs) the input is those tokens, one position further on."""
    n = len(running)
    ahead = 0 if future is None else 1
    batch = BatchInput(True, [], [], new_slots, [], [], [1] * n, list(range(n)), input_future=future)
    for req, slot in zip(running, new_slots):
        pos = req.seq_len - 1 + ahead
        req.slots.append(slot)
        batch.input_ids.append(req.output_ids[-1] if future is None else 0)
        batch.positions.append(pos)
        batch.rows.append(req.row)
        batch.seq_lens.append(pos + 1)
    if any(req.inp.rope_delta for req in running):  # M-RoPE after images: positions shifted, t = h = w
        shifted = [p + req.inp.rope_delta for p, req in zip(batch.positions, running)]
        batch.rope_positions = [shifted, shifted, shifted]
    return batch


def record_input_logprobs(req: Req, logits: torch.Tensor, first_pos: int) -> None:
    """logits[j] is the distribution after position first_pos + j, i.e. over token first_pos + j + 1."""
    prompt = req.inp.input_ids
    start = req.input_logprob_start()
    if start == 0 and not req.input_token_logprobs:
        req.input_token_logprobs.append((None, prompt[0], None))
        req.input_top_logprobs.append(None)
    logprobs = torch.log_softmax(logits, dim=-1)
    for j in range(logits.shape[0]):
        target = first_pos + j + 1
        if target >= len(prompt) or target < start:
            continue
        if prompt[target] >= logprobs.shape[-1]:  # an image position: no token, no logprob
            req.input_token_logprobs.append((None, prompt[target], None))
            req.input_top_logprobs.append(None)
            continue
        req.input_token_logprobs.append((float(logprobs[j, prompt[target]]), prompt[target], None))
        k = req.inp.top_logprobs_num
        req.input_top_logprobs.append(top_logprob_entries(logprobs[j], k) if k else None)
