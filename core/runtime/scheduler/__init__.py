"""The scheduler: a loop (loop.py) that applies the decisions of small units to its request queues and
runs the steps through the model runner.

  loop.py         Scheduler: inbox and outbox (core.runtime.messages), the step, flush, stats, checks
  policy.py       SchedulePolicy: the order of the waiting queue (lpm, dfs-weight, fcfs, ...), fairness
  prefill.py      PrefillPlanner: which requests compute which tokens next (budget, chunks, sharing)
  memory.py       KVMemory: slots, eviction, table rows, and whom to retract when decode runs short
  queues.py       RequestQueues: waiting / running / chunked, and finishing a request
  execute.py      Executor: runs a step through the model runner; overlap's pending and chained steps
  advance.py      TokenAdvance: applies sampled tokens (finish, constraint, jump forward, stream chunk)
  batch.py        the model input of a step, and prompt logprobs from its logits
  constraints.py  constraint masks, jump-forward, gathering jump-forward continuations
  finish.py       Finish and check_finish: when a request ends
  output.py       GenerateOutput: what a request's client receives

`Scheduler` is imported on first use so that importing the policy (options.py does) does not load torch.
"""

from typing import Any

__all__ = ["Scheduler"]


def __getattr__(name: str) -> Any:
    if name == "Scheduler":
        from radixlm.core.runtime.scheduler.loop import Scheduler

        return Scheduler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
