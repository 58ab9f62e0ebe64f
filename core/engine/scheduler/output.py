"""What a request's client receives: the output dict of a stream chunk or of the final result,
delivered through the request's sink."""

from __future__ import annotations

import logging
import time
from typing import Any

from radixlm.core.engine.request import Req

logger = logging.getLogger("radixlm")


def emit(req: Req, final: bool) -> None:
    """Sends the request's new output (streaming) or its whole output; a stream chunk with nothing new
    is not sent. A sink that raises harms nobody else: its failure is logged."""
    if req.inp.sink is None:
        return
    out = _take_output(req, final)
    if out is None:
        return
    try:
        req.inp.sink(out)
    except Exception:  # the receiver's failure is its own; nobody else's output may depend on it
        logger.exception("request %s: delivering its output failed", req.rid)


def _take_output(req: Req, final: bool) -> dict[str, Any] | None:
    stream = req.inp.stream
    text = req.detok.take_new_text(final) if stream else req.detok.text
    ids = req.output_ids[req.streamed_ids :] if stream else list(req.output_ids)
    if stream and not text and not final and len(ids) == 0:
        return None
    out_lp = req.output_token_logprobs[req.streamed_logprobs :] if stream else req.output_token_logprobs
    out_top = req.output_top_logprobs[req.streamed_logprobs :] if stream else req.output_top_logprobs
    req.streamed_ids = len(req.output_ids)
    req.streamed_logprobs = len(req.output_token_logprobs)
    meta: dict[str, Any] = {
        "id": req.rid,
        "prompt_tokens": len(req.inp.input_ids),
        "completion_tokens": len(req.output_ids),
        "cached_tokens": req.cached_tokens or 0,
        "finish_reason": {"type": req.finish_type, "matched": req.finish_matched} if final else None,
    }
    if final and req.error_status is not None:
        meta["finish_reason"]["status_code"] = req.error_status
    if req.inp.return_logprob:
        meta["input_token_logprobs"] = list(req.input_token_logprobs)
        meta["input_top_logprobs"] = list(req.input_top_logprobs)
        meta["output_token_logprobs"] = list(out_lp)
        meta["output_top_logprobs"] = list(out_top)
    if final and req.first_token_time is not None:
        meta["e2e_latency"] = time.monotonic() - req.created
        meta["ttft"] = req.first_token_time - req.created
    if final and req.scheduled_time is not None:
        meta["queue_time"] = req.scheduled_time - req.created
    if final and req.error is not None:
        meta["error"] = req.error
    return {"text": text, "output_ids": ids, "meta_info": meta}
