"""A request's time limit: its own `timeout` (seconds) or the engine's `request_timeout`, turned into
the wall-clock deadline the scheduler enforces (scheduler/deadlines.py). Wall-clock time, so that a
scheduler in its own process reads the same clock.

The front end keeps the deadline too, so that the caller hears of it on time even when the scheduler
is in a long step or the caller's outputs are queued behind a busy event loop: DEADLINE_GRACE_S past
the deadline it ends the call itself with the timeout ending (`timeout_output`) and aborts the
request, which the scheduler then frees."""

from __future__ import annotations

import math
import time

from radixlm.core.errors import InvalidRequestError
from radixlm.core.runtime.messages import FinishReason, GenerateOutput, GenerateRequest

# What the client of a request ended by its deadline reads.
TIMEOUT_MESSAGE = "the request ran past its time limit (timeout / request_timeout)"
# How long after the deadline the front end waits for the scheduler's own ending (which carries the
# text generated until then) before it ends the call itself.
DEADLINE_GRACE_S = 0.2


def deadline_of(timeout: float | None, default: float | None) -> float | None:
    """The deadline (time.time()) of a request arriving now with `timeout`, else the `default` limit;
    None when neither is set. A timeout that is not a positive number of seconds is refused."""
    if timeout is None:
        timeout = default
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
        raise InvalidRequestError("timeout must be a number of seconds > 0", "timeout")
    return time.time() + timeout


def caller_limit(deadline: float | None) -> float | None:
    """When (time.time()) the front end ends a call with this deadline itself; None: never."""
    return None if deadline is None else deadline + DEADLINE_GRACE_S


def seconds_left(until: float | None) -> float | None:
    """Seconds from now to `until` (0 once past); None for None."""
    return None if until is None else max(0.0, until - time.time())


def timeout_output(req: GenerateRequest, completion_tokens: int) -> GenerateOutput:
    """The final output the front end gives a caller at its deadline (the scheduler's own was late):
    no new tokens, `completion_tokens` the ones the caller was given."""
    return GenerateOutput(rid=req.rid, output_ids=[], prompt_tokens=len(req.input_ids),
                          completion_tokens=completion_tokens,
                          finish=FinishReason("abort", None, TIMEOUT_MESSAGE, 408))
