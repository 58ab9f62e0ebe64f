"""Test-only fault injection (issue 37): the environment variable RADIXLM_INJECT_FAULTS names faults
the scheduler raises at chosen points, so that tests and `benchmarks/fault_probe.py` can check what
clients see. Unset (always, in production) nothing is wrapped and nothing is counted.

The value is a comma-separated list of:

  oom@N         the N-th forward (counted from 1) raises torch.OutOfMemoryError (CUDA's)
  host_oom@N    the N-th forward raises MemoryError
  oom_every=K   every K-th forward raises torch.OutOfMemoryError
  oom_over=T    every forward of more than T tokens raises torch.OutOfMemoryError (a request that
                cannot run even alone)
  loop_crash@N  the scheduler loop raises at its N-th iteration, outside any request
  stall_over=T  every forward of more than T tokens first sleeps STALL_S seconds (a step that takes
                long: a huge prefill, a slow device)

e.g. `RADIXLM_INJECT_FAULTS=oom@25 radixlm serve ...`. A scheduler in its own process reads it too
(it inherits the environment).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

ENV = "RADIXLM_INJECT_FAULTS"
STALL_S = 2.0
logger = logging.getLogger("radixlm")


@dataclass
class FaultPlan:
    oom_at: set[int] = field(default_factory=set)
    host_oom_at: set[int] = field(default_factory=set)
    oom_over: int | None = None
    oom_every: int | None = None
    stall_over: int | None = None
    loop_crash_at: set[int] = field(default_factory=set)
    forwards: int = 0
    iterations: int = 0

    @classmethod
    def parse(cls, spec: str) -> "FaultPlan":
        plan = cls()
        for item in filter(None, (part.strip() for part in spec.split(","))):
            name, sep, value = item.partition("@") if "@" in item else item.partition("=")
            if not sep or not value.isdigit():
                raise ValueError(f"{ENV}: cannot read {item!r} (e.g. oom@12, host_oom@3, oom_every=50, oom_over=512, "
                                 "loop_crash@40, stall_over=512)")
            target = {"oom": plan.oom_at, "host_oom": plan.host_oom_at, "loop_crash": plan.loop_crash_at}.get(name)
            if name in ("oom_over", "oom_every", "stall_over") and sep == "=" and int(value) > 0:
                setattr(plan, name, int(value))
            elif target is not None and sep == "@":
                target.add(int(value))
            else:
                raise ValueError(f"{ENV}: unknown fault {item!r}")
        return plan

    def before_forward(self, tokens: int) -> None:
        self.forwards += 1
        if self.stall_over is not None and tokens > self.stall_over:
            logger.warning("injected fault: forward %d (%d tokens) stalls %g s", self.forwards, tokens, STALL_S)
            time.sleep(STALL_S)
        if self.forwards in self.oom_at or (self.oom_over is not None and tokens > self.oom_over) \
                or (self.oom_every is not None and self.forwards % self.oom_every == 0):
            logger.warning("injected fault: CUDA out of memory in forward %d (%d tokens)", self.forwards, tokens)
            raise torch.OutOfMemoryError(f"injected fault ({ENV}): CUDA out of memory in forward {self.forwards}")
        if self.forwards in self.host_oom_at:
            logger.warning("injected fault: host out of memory in forward %d", self.forwards)
            raise MemoryError(f"injected fault ({ENV}): host out of memory in forward {self.forwards}")

    def before_iteration(self) -> None:
        self.iterations += 1
        if self.iterations in self.loop_crash_at:
            raise RuntimeError(f"injected fault ({ENV}): the scheduler loop crashed at iteration {self.iterations}")


def inject_faults(runner: Any) -> FaultPlan | None:
    """The plan RADIXLM_INJECT_FAULTS names, with `runner.forward` wrapped to raise its faults; None
    (the runner untouched) when the variable is unset."""
    spec = os.environ.get(ENV)
    if not spec:
        return None
    plan = FaultPlan.parse(spec)
    forward = runner.forward

    def faulty_forward(batch: Any, *args: Any, **kwargs: Any) -> Any:
        plan.before_forward(len(batch.input_ids))
        return forward(batch, *args, **kwargs)

    runner.forward = faulty_forward
    logger.warning("fault injection on (%s=%s): for tests only", ENV, spec)
    return plan
