"""The scheduler's own host cost: wall time per step with a null model runner (no model, no KV), so that
what is timed is scheduling, table bookkeeping, sampling and finishing alone.

    python benchmarks/bench_scheduler.py --batch 64 --prompt-len 128 --new-tokens 256 --repeats 5
    python benchmarks/bench_scheduler.py --batch 1024 --max-running 64 --shared-prefixes 16 --prompt-len 1024 \
        --new-tokens 8 --policy lpm                                  # the policy's cost at 256+ waiting

Each repeat submits `batch` requests at once (distinct random prompts, greedy, ignore_eos) to a fresh
Scheduler and runs its loop until every request is done; it reports the median over repeats of the
time per generated token (wall, and the process's CPU time, which a busy machine disturbs less) and
per step. The runner flushes the request-to-token table as the real one does, then returns zero logits
(a small vocabulary, so that the sampler's argmax stays cheap). With --overlap (enable_overlap_schedule)
it also reports how much of each step's host time applies a pending step's results after the next
step's launch.
Uses only the Scheduler's constructor, inbox, run_forever and stop, so the same script times any
version of the scheduler.

With --max-running below --batch the rest wait, so each step also orders a long queue: with
--shared-prefixes K the prompts start with one of K shared prefixes (3/4 of --prompt-len), in
arrival order i % K, which is what the cache-aware policies (--policy) look up. Then it also reports
the median wall time per step over the steps that left 256 or more requests waiting.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from types import SimpleNamespace

import torch

from radixlm.core.runtime.memory.memory_pool import ReqToTokenPool
from radixlm.core.runtime.execution.batch_input import BatchInput
from radixlm.core.runtime.options import EngineOptions
from radixlm.core.runtime.messages import GenerateRequest
from radixlm.core.runtime.sampling_params import SamplingParams
from radixlm.core.runtime.scheduler import Scheduler

VOCAB = 256


class NullTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "x" * len(ids)


class NullRunner:
    def __init__(self, num_slots: int, max_running_requests: int, context_len: int) -> None:
        self.cfg = SimpleNamespace(vocab_size=VOCAB, context_len=context_len)
        self.num_slots = num_slots
        self.device = torch.device("cpu")
        self.req_to_token = ReqToTokenPool(max_running_requests + 1, context_len + 1, "cpu")
        self.steps = 0
        self.waiting = lambda: 0  # the scheduler's waiting queue's length, once it exists
        self.busy_steps: list[float] = []  # wall time since the previous forward, for steps leaving 256+ waiting
        self._last: float | None = None

    def forward(self, batch: BatchInput) -> torch.Tensor:
        self.req_to_token.flush()
        self.steps += 1
        now = time.perf_counter()
        if self._last is not None and self.waiting() >= 256:
            self.busy_steps.append(now - self._last)
        self._last = now
        return torch.zeros(len(batch.logit_rows), VOCAB)

    def idle(self) -> None:  # the loop is about to wait for a request
        pass


def run_once(batch: int, prompt_len: int, new_tokens: int, seed: int, max_running: int | None = None,
             policy: str = "lpm", shared_prefixes: int = 0,
             overlap: bool = False) -> tuple[float, float, int, list[float], float]:
    """Wall and CPU seconds, steps, the timed steps leaving 256+ waiting, and the seconds spent applying
    pending steps' results (overlap)."""
    max_running = max_running or batch
    opts = EngineOptions.from_kwargs({"device": "cpu", "max_running_requests": max_running,
                                      "schedule_policy": policy, "enable_overlap_schedule": overlap})
    context = prompt_len + new_tokens + 1
    runner = NullRunner(batch * context, max_running, context)
    sched = Scheduler(runner, opts, NullTokenizer(), [VOCAB - 1])
    runner.waiting = lambda: len(sched.queues.waiting)
    resolve, deferred = sched.executor.resolve, [0.0]

    def timed_resolve(pending) -> None:
        t = time.perf_counter()
        resolve(pending)
        deferred[0] += time.perf_counter() - t

    sched.executor.resolve = timed_resolve
    rng = random.Random(seed)
    shared = [[rng.randrange(VOCAB - 1) for _ in range(prompt_len * 3 // 4)] for _ in range(shared_prefixes)]
    params = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True})
    for i in range(batch):
        head = shared[i % shared_prefixes] if shared else []
        prompt = head + [rng.randrange(VOCAB - 1) for _ in range(prompt_len - len(head))]
        sched.inbox.put(GenerateRequest(f"b{i}", prompt, params))
    thread = threading.Thread(target=sched.run_forever)
    start, start_cpu = time.perf_counter(), time.process_time()
    thread.start()
    left = batch
    while left:
        left -= sched.outbox.get().finish is not None
    elapsed, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    sched.stop()
    thread.join()
    return elapsed, cpu, runner.steps, runner.busy_steps, deferred[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-running", type=int, help="max_running_requests (default: --batch, nobody waits)")
    parser.add_argument("--policy", default="lpm", help="schedule_policy (default lpm)")
    parser.add_argument("--shared-prefixes", type=int, default=0, help="prompts start with one of this many prefixes")
    parser.add_argument("--overlap", action="store_true", help="with enable_overlap_schedule")
    args = parser.parse_args()
    torch.set_num_threads(1)
    runs = [run_once(args.batch, args.prompt_len, args.new_tokens, seed, args.max_running, args.policy,
                     args.shared_prefixes, args.overlap) for seed in range(args.repeats)]
    tokens = args.batch * args.new_tokens
    busy = [t for run in runs for t in run[3]]
    print(json.dumps({
        "batch": args.batch, "overlap": args.overlap, "max_running": args.max_running or args.batch, "policy": args.policy,
        "shared_prefixes": args.shared_prefixes, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "steps": runs[0][2],
        "us_per_token": round(statistics.median(r[0] for r in runs) / tokens * 1e6, 2),
        "cpu_us_per_token": round(statistics.median(r[1] for r in runs) / tokens * 1e6, 2),
        "ms_per_step": round(statistics.median(r[0] / r[2] for r in runs) * 1e3, 3),
        "steps_256_waiting": len(busy) // args.repeats,
        "ms_per_step_256_waiting": round(statistics.median(busy) * 1e3, 3) if busy else None,
        # overlap: the part of each step's host time applying the previous step's results
        "deferred_ms_per_step": round(statistics.median(r[4] / r[2] for r in runs) * 1e3, 3),
    }))


if __name__ == "__main__":
    main()
