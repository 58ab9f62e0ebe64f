"""What a request's client receives: a `GenerateOutput` (core.runtime.messages) per stream chunk, or
one with the whole output when it finishes, put on the scheduler's outbox, with its text from the
request's detokenizer (the one that found its stop strings)."""

from __future__ import annotations

import logging
import time
from typing import Any

from radixlm.core.runtime.messages import FinishReason, GenerateOutput
from radixlm.core.runtime.request import Req

logger = logging.getLogger("radixlm")


def emit(req: Req, outbox: Any, final: bool) -> None:
    """Puts the request's next output on the outbox: a stream sends what is new since its last output
    (nothing when nothing is), otherwise only the final output goes, whole."""
    stream = req.inp.stream
    if not stream and not final:
        return
    start = req.streamed_ids if stream else 0
    ids = req.output_ids[start:]
    if not final and not ids and not req.replaced_sent:
        return
    lp_start = req.streamed_logprobs if stream else 0
    out = GenerateOutput(
        rid=req.rid, output_ids=ids, text=_text(req, final), replaced=req.replaced_sent,
        prompt_tokens=len(req.inp.input_ids),
        completion_tokens=len(req.output_ids), cached_tokens=req.cached_tokens or 0)
    req.streamed_ids = len(req.output_ids)
    req.streamed_logprobs = len(req.output_token_logprobs)
    req.replaced_sent = 0
    if req.inp.return_logprob:
        out.input_token_logprobs = list(req.input_token_logprobs)
        out.input_top_logprobs = list(req.input_top_logprobs)
        out.output_token_logprobs = req.output_token_logprobs[lp_start:]
        out.output_top_logprobs = req.output_top_logprobs[lp_start:]
    if final:
        out.finish = FinishReason(req.finish_type, req.finish_matched, req.error, req.error_status)
        now = time.monotonic()
        if req.first_token_time is not None:
            out.e2e_latency = now - req.created
            out.ttft = req.first_token_time - req.created
        if req.scheduled_time is not None:
            out.queue_time = req.scheduled_time - req.created
        if req.spec is not None:
            out.spec_verify_ct, out.spec_accepted_tokens = req.spec.verify_ct, req.spec.accepted
    outbox.put(out)


def _text(req: Req, final: bool) -> str:
    """A stream's text new since its last output (holding back what may start a stop string), or the
    whole text at the end. A decoding failure leaves the output with the text decoded so far."""
    detok = req.detok
    try:
        if final:
            detok.flush()
        return detok.take_new_text(final) if req.inp.stream else detok.text
    except Exception:
        logger.exception("request %s: decoding its output failed", req.rid)
        return "" if req.inp.stream else detok.text
