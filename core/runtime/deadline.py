"""A request's time limit: its own `timeout` (seconds) or the engine's `request_timeout`, turned into
the wall-clock deadline the scheduler enforces (scheduler/deadlines.py). Wall-clock time, so that a
scheduler in its own process reads the same clock."""

from __future__ import annotations

import math
import time

from radixlm.core.errors import InvalidRequestError


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


# What the client of a request ended by its deadline reads.
TIMEOUT_MESSAGE = "the request ran past its time limit (timeout / request_timeout)"
