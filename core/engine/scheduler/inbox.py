"""The messages the scheduler's inbox takes besides requests (GenerateInput): abort one request, and
call a function on the scheduler thread (flush, stats, checks)."""

from __future__ import annotations

import queue
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class AbortMsg:
    rid: str


@dataclass
class CallMsg:
    """Runs `fn(scheduler)` on the scheduler thread and hands back its result (flush, stats, checks)."""

    fn: Callable[[Any], Any]
    reply: "queue.Queue[tuple[bool, Any]]" = field(default_factory=lambda: queue.Queue(maxsize=1))
