"""Applies sampled tokens to their requests: per request the token appended, its logprobs, its finish,
its constraint and jump forward (after which it waits to compute the jumped text), its stream chunk.
Also sampling a step with the requests' masks, and finding the request at fault when a batch's
sampling fails. A failure in one request's own work (its constraint, its sampling values, its
detokenizer) ends that request alone (RequestQueues.fail).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from radixlm.core.runtime.options import EngineOptions
from radixlm.core.runtime.request import Req
from radixlm.core.runtime.execution.sampler import SampleResult, Sampler
from radixlm.core.runtime.scheduler.constraints import constraint_mask, jump_forward
from radixlm.core.runtime.scheduler.finish import Finish, check_finish
from radixlm.core.runtime.scheduler.output import emit
from radixlm.core.runtime.scheduler.queues import RequestQueues
from radixlm.core.runtime.stats import EngineStats

logger = logging.getLogger("radixlm")


class TokenAdvance:
    def __init__(self, sampler: Sampler, queues: RequestQueues, stats: EngineStats, opts: EngineOptions,
                 tokenizer: Any, eos_token_ids: list[int], context_len: int, device: torch.device) -> None:
        self.sampler = sampler
        self.queues = queues
        self.stats = stats
        self.opts = opts
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.context_len = context_len
        self.device = device

    def sample_and_advance(self, reqs: list[Req], logits: torch.Tensor) -> None:
        """Samples each request's next token and moves it on."""
        masks = self.masks(reqs)
        if any(r.finished for r in reqs):
            keep = [i for i, r in enumerate(reqs) if not r.finished]
            reqs, masks = [reqs[i] for i in keep], [masks[i] for i in keep]
            logits = logits[torch.tensor(keep, device=logits.device)]
        if not reqs:
            return
        try:
            result = self.sampler.sample(logits, reqs, masks)
            rows: list[tuple[SampleResult, int] | None] = [(result, i) for i in range(len(reqs))]
        except Exception:  # find the request(s) at fault: sample each alone
            logger.warning("sampling a batch of %d failed; sampling its requests one by one", len(reqs))
            rows = [self._sample_alone(req, logits[i : i + 1], mask) for i, (req, mask) in enumerate(zip(reqs, masks))]
        self.apply(reqs, rows)

    def apply(self, reqs: list[Req], rows: list[tuple[SampleResult, int] | None]) -> None:
        """Appends each request's sampled token (row i of a result), then its finish, constraint and
        stream chunk."""
        now = time.monotonic()
        for req, row in zip(reqs, rows):
            if row is not None:
                self.apply_token(req, *row, now)

    def apply_token(self, req: Req, result: SampleResult, i: int, now: float) -> None:
        """Appends row i's token to the request, then its finish, constraint and stream chunk (a verify
        step of speculative decoding applies several rows to one request, one by one)."""
        stage = "sampling"
        try:
            if i in result.invalid:
                raise ValueError("its adjusted logits or sampling distribution are not numbers")
            stage = "constraining"
            token = result.token_ids[i]
            req.output_ids.append(token)
            self.stats.generated_tokens_total += 1
            if req.first_token_time is None:
                req.first_token_time = now
            if req.inp.return_logprob:
                req.output_token_logprobs.append((result.logprobs[i], token, None))
                req.output_top_logprobs.append(result.top_logprobs[i])
            if req.constraint is not None:
                req.constraint.advance(token)
            stage = "detokenizing"
            finish = check_finish(req, token, self.eos_token_ids, self.context_len)
            if finish is not None:
                self.queues.finish(req, finish)
                return
            if req.constraint is not None:
                stage = "constraining"
                self._after_constrained_token(req)
                if req.finished:
                    return
            if req.inp.stream and len(req.output_ids) - req.streamed_ids >= self.opts.stream_interval:
                stage = "detokenizing"
                emit(req, self.queues.outbox, final=False)
        except Exception:
            self.queues.fail(req, stage)

    def jump(self, req: Req) -> bool:
        """Jumps the request forward over the text its constraint forces (finishing it if that ends it).
        True if tokens were appended."""
        if not self.jumps_forward(req):
            return False
        jumped, finish = jump_forward(req, self.tokenizer, self.context_len)
        if finish is not None:
            self.queues.finish(req, finish)
        return jumped

    def jumps_forward(self, req: Req) -> bool:
        return req.constraint is not None and not (self.opts.disable_jump_forward or req.params.disable_jump_forward)

    def _after_constrained_token(self, req: Req) -> None:
        """Finishes the request when its constraint allows nothing but the end; otherwise jumps forward
        over forced text, after which the request takes an extend step to compute the jumped tokens."""
        if req.constraint.is_finished():
            self.queues.finish(req, Finish("stop"))
        elif self.jump(req) and not req.finished:
            self.queues.requeue(req, retracted=False)

    def masks(self, reqs: list[Req]) -> list[torch.Tensor | None]:
        packed = self.device.type == "cuda"  # bit-packed masks: a small copy, unpacked on the GPU
        masks: list[torch.Tensor | None] = []
        for r in reqs:
            try:
                masks.append(constraint_mask(r, self.sampler.vocab_size, packed))
            except Exception:
                self.queues.fail(r, "constraining")
                masks.append(None)
        return masks

    def _sample_alone(self, req: Req, logits: torch.Tensor,
                      mask: torch.Tensor | None) -> tuple[SampleResult, int] | None:
        try:
            return self.sampler.sample(logits, [req], [mask]), 0
        except Exception:
            self.queues.fail(req, "sampling")
            return None
