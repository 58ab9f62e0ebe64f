"""The scheduling policies on the paper's workloads without a GPU: a simulated device clock.

    python benchmarks/sim_policies.py --workloads hellaswag llm_judge --policies lpm dfs-weight fcfs

A real Engine (scheduler, radix cache, program frontend, the small local tokenizer) runs the workloads
at their GPU sizes, with `SimRunner` in place of the model runner: its forward returns fixed logits
(every generated token is one the tokenizer does not have, so it decodes to nothing, as the random 8B
model's tokens mostly do in the H200 run) and charges the step the H200 device model's time
(workloads/estimate.py's DeviceCost): an extend step its fixed part plus its computed tokens at the
prefill rate, a decode step its fixed part, its rows and their KV reads. It sleeps that time times
--time-scale, so that the programs' threads see a device-shaped clock; a scale above 1 makes this
machine's Python host relatively as fast as the H200's.

Reported per workload and policy: "device seconds" (the sum of the modeled step times: what the order
changes on the device), wall seconds, prefill and decode steps, prefill tokens, the mean decode batch,
the cache hit rate (the engine's count) against the optimal (workloads/recorder.py), retractions, and the
scheduler's host time per step (the step's wall time less the runner's) and the policy's share of it,
with the waiting queue's length as the step began: median over all steps, and over steps with 256+
waiting.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import hashlib
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import torch

from bench_engine import LLAMA3_8B_SHAPE, parse_engine_options
from bench_workloads import H200_LLAMA3_8B, instance_counts
from workloads import WORKLOADS
from workloads.estimate import DeviceCost
from workloads.recorder import RecordingEngine, hit_rates

import radixlm
import radixlm.core.runtime.engine as engine_module
from radixlm.core.runtime.memory.memory_pool import ReqToTokenPool
from radixlm.core.runtime.execution.batch_input import BatchInput
from radixlm.testing.checkpoints import build_tokenizer
from radixlm.core.runtime.tokenizer.loader import load_tokenizer

KV_POOL_TOKENS = 800_000  # the H200 run's pool for the 8B shape (a workload's engine_options may set less)
SIM_ENGINE = {"chunked_prefill_size": 16384, "max_running_requests": 256}  # bench_workloads' 8B preset


class SimRunner:
    """Stands where ModelRunner does: no weights, fixed logits, a device clock from `cost`."""

    def __init__(self, vocab: int, context_len: int, num_slots: int, max_running: int, cost: DeviceCost,
                 time_scale: float) -> None:
        self.cfg = SimpleNamespace(vocab_size=vocab + 1, context_len=context_len)
        self.num_slots = num_slots
        self.device = torch.device("cpu")
        self.req_to_token = ReqToTokenPool(max_running + 1, context_len + 1, "cpu")
        self.cost = cost
        self.time_scale = time_scale
        self.steps: list[dict[str, Any]] = []
        self.load_seconds: dict[str, float] = {}  # the engine's start-up breakdown: nothing loads here
        self._order_s = 0.0  # the policy's time in this step
        self._forward_s = 0.0  # this runner's time in this step (its sleep)
        self._waiting = 0  # the waiting queue's length as the step began

    def watch(self, scheduler: Any) -> None:
        """Times each step of `scheduler` (less this runner's own time) and its policy's ordering."""
        step, order = scheduler.step, scheduler.policy.order

        def timed_order(waiting: list[Any], free_slots: int | None = None) -> list[Any]:
            start = time.perf_counter()
            out = order(waiting, free_slots)
            self._order_s += time.perf_counter() - start
            return out

        def timed_step() -> None:
            self._order_s = self._forward_s = 0.0
            self._waiting = len(scheduler.queues.waiting)
            steps = len(self.steps)
            start = time.perf_counter()
            step()
            if len(self.steps) > steps:
                self.steps[-1]["host_s"] = time.perf_counter() - start - self._forward_s
                self.steps[-1]["order_s"] = self._order_s

        scheduler.step = timed_step
        scheduler.policy.order = timed_order

    def forward(self, batch: BatchInput) -> torch.Tensor:
        start = time.perf_counter()
        self.req_to_token.flush()
        if batch.is_decode:  # the real runner records decode slots itself
            table = self.req_to_token.table
            table[torch.tensor(batch.rows), torch.tensor(batch.positions)] = torch.tensor(
                batch.out_cache_loc, dtype=torch.int32)
        c = self.cost
        if batch.is_decode:
            rows = len(batch.input_ids)
            seconds = c.decode_step_s + rows * c.decode_s_per_row + sum(batch.seq_lens) * c.kv_s_per_token
        else:
            seconds = c.decode_step_s + len(batch.input_ids) * c.prefill_s_per_token
        self.steps.append({"decode": batch.is_decode, "tokens": len(batch.input_ids),
                           "requests": len(batch.extend_lens) if not batch.is_decode else len(batch.input_ids),
                           "device_s": seconds, "waiting": self._waiting})
        time.sleep(seconds * self.time_scale)
        logits = torch.zeros(len(batch.logit_rows), self.cfg.vocab_size)
        logits[:, -1] = 10.0  # an id past the tokenizer's: decodes to nothing
        self._forward_s += time.perf_counter() - start
        return logits

    def idle(self) -> None:  # the loop is about to wait for a request
        pass

    def release(self) -> None:
        pass


def model_dir(root: str) -> str:
    """The small local tokenizer and the 8B shape's config (for the context length; no weights)."""
    build_tokenizer(root)
    with open(os.path.join(root, "config.json"), "w") as f:
        json.dump(LLAMA3_8B_SHAPE, f)
    return root


@contextlib.contextmanager
def sim_engine(path: str, cost: DeviceCost, time_scale: float, **options: Any) -> Iterator[tuple[Any, SimRunner]]:
    made: list[SimRunner] = []
    vocab = len(load_tokenizer(path))

    def make_runner(model_path: str, cfg: Any, opts: Any) -> SimRunner:
        made.append(SimRunner(vocab, cfg.context_len, opts.max_total_tokens or KV_POOL_TOKENS, opts.max_running_requests, cost,
                              time_scale))
        return made[0]

    real = engine_module.ModelRunner
    engine_module.ModelRunner = make_runner  # Engine builds its runner by this name
    try:
        engine = radixlm.Engine(path, device="cpu", **SIM_ENGINE, **options)
    finally:
        engine_module.ModelRunner = real
    runner = made[0]
    runner.watch(engine.frontend.scheduler.scheduler)  # the LocalScheduler's loop
    try:
        yield engine, runner
    finally:
        engine.shutdown()


class QueuedTogether:
    """Engine-shaped, for one batch: its first `requests` generate calls that decode (a batch's prefix
    precache, max_new_tokens 0, passes through) wait for one another, then enter the scheduler's inbox
    one at a time in a fixed order (their prompts' hashes: a shuffle that is the same every run) while
    its loop is held. The first step then sees them all, in the same order every run, whichever order
    the submitting threads got the CPU in (the order-sensitive comparisons flaked on that)."""

    def __init__(self, engine: Any, backend: Any, requests: int) -> None:
        self._backend = backend
        self._scheduler = engine.frontend.scheduler.scheduler
        self._requests = requests
        self._gated = itertools.count()
        self._keys: list[tuple[bytes, int]] = [(b"", 0)] * requests
        self._hold = self._scheduler.paused()
        self._queued_before = 0
        self._held = threading.Event()
        self._barrier = threading.Barrier(requests, action=self._hold_loop, timeout=60)

    def _hold_loop(self) -> None:  # the last caller to arrive runs it, before any is let through
        self._hold.__enter__()
        self._queued_before = self._scheduler.inbox.qsize()
        self._held.set()

    def _wait_queued(self, count: int) -> None:
        while self._scheduler.inbox.qsize() < self._queued_before + count:
            time.sleep(0.0005)

    def generate(self, prompt: Any = None, sampling_params: Any = None, **kwargs: Any) -> Any:
        slot = next(self._gated) if (sampling_params or {}).get("max_new_tokens") != 0 else self._requests
        if slot < self._requests:
            self._keys[slot] = (hashlib.sha256(repr((prompt, kwargs.get("input_ids"))).encode()).digest(), slot)
            self._barrier.wait()
            self._wait_queued(sorted(self._keys).index(self._keys[slot]))  # the ones before it are in
        return self._backend.generate(prompt=prompt, sampling_params=sampling_params, **kwargs)

    def run(self, run_batch: Callable[[Any], Any]) -> Any:
        """`run_batch(self)`, the loop let go once the batch's first requests are all in its inbox."""
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            result = pool.submit(run_batch, self)
            while not self._held.wait(0.01):
                if result.done():
                    return result.result()
            self._wait_queued(self._requests)
            self._hold.__exit__(None, None, None)
            return result.result()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


def simulate(path: str, name: str, policy: str, instances: int, cost: DeviceCost, time_scale: float,
             seed: int = 0, size: str = "gpu", **options: Any) -> dict[str, Any]:
    workload = WORKLOADS[name]
    batch = workload.make_args(instances, workload.sizes[size], random.Random(f"{name}:{seed}"))
    options = {**workload.engine_options.get(size, {}), **options}
    with sim_engine(path, cost, time_scale, schedule_policy=policy, **options) as (engine, runner):
        backend = RecordingEngine(engine)
        workload.run_batch(backend, batch[:4])  # as bench_workloads' warm-up, then a flushed cache
        if not engine.flush_cache():
            raise RuntimeError("cache not flushed")
        backend.take_requests()
        runner.steps.clear()
        before = engine.get_stats()
        start = time.perf_counter()
        QueuedTogether(engine, backend, len(batch)).run(lambda gated: workload.run_batch(gated, batch))
        wall = time.perf_counter() - start
        after = engine.get_stats()
        requests = backend.take_requests()
    steps = runner.steps
    decodes = [s for s in steps if s["decode"]]
    prefills = [s for s in steps if not s["decode"]]
    busy = [s["host_s"] for s in steps if s["waiting"] >= 256]
    cache = hit_rates(requests)
    return {
        "workload": name, "policy": policy, "instances": instances, "wall_s": wall,
        "device_s": sum(s["device_s"] for s in steps),
        "prefill_steps": len(prefills), "prefill_tokens": sum(s["tokens"] for s in prefills),
        "mean_prefill_tokens": statistics.mean(s["tokens"] for s in prefills) if prefills else 0.0,
        "decode_steps": len(decodes),
        "mean_decode_batch": statistics.mean(s["tokens"] for s in decodes) if decodes else 0.0,
        "hit_rate": cache["hit_rate"], "optimal_hit_rate": cache["optimal_hit_rate"],
        "retractions": after["retractions_total"] - before["retractions_total"],
        "host_ms_per_step": 1e3 * statistics.median(s["host_s"] for s in steps),
        "order_ms_per_step": 1e3 * statistics.median(s["order_s"] for s in steps),
        "host_ms_per_step_256_waiting": 1e3 * statistics.median(busy) if busy else None,
        "host_s": sum(s["host_s"] for s in steps),
        "peak_waiting": max((s["waiting"] for s in steps), default=0),
        "steps": steps,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="+", default=["hellaswag", "llm_judge", "mmlu", "generative_agents",
                                                       "skeleton_of_thought", "prefix_pressure"])
    p.add_argument("--policies", nargs="+", default=["lpm", "dfs-weight", "fcfs"])
    p.add_argument("--instances", nargs="+", metavar="NAME=N", help="default: the workload's gpu preset")
    p.add_argument("--time-scale", type=float, default=4.0,
                   help="sleep this many times each step's modeled device time (default 4)")
    p.add_argument("--engine-options", nargs="+", metavar="KEY=VALUE", help="over the 8B preset's")
    p.add_argument("--out", help="write every run's results (with its per-step log) as JSON here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    counts = instance_counts(args.instances, {n: w.instances["gpu"] for n, w in WORKLOADS.items()})
    options = parse_engine_options(args.engine_options, "--engine-options")
    results = []
    with tempfile.TemporaryDirectory() as root:
        path = model_dir(root)
        for name in args.workloads:
            for policy in args.policies:
                r = simulate(path, name, policy, counts[name], H200_LLAMA3_8B, args.time_scale, **options)
                results.append(r)
                busy = r["host_ms_per_step_256_waiting"]
                print(f"{name:20s} {policy:10s} device {r['device_s']:7.3f} s wall {r['wall_s']:6.2f} s | "
                      f"prefill {r['prefill_steps']:4d} steps {r['prefill_tokens']:7d} tok "
                      f"(mean {r['mean_prefill_tokens']:6.0f}) | decode {r['decode_steps']:4d} steps "
                      f"mean batch {r['mean_decode_batch']:5.1f} | hit {r['hit_rate']:.3f} "
                      f"(opt {r['optimal_hit_rate']:.3f}) | host {r['host_s']:.2f} s, {r['host_ms_per_step']:.2f} ms/step "
                      f"(order {r['order_ms_per_step']:.2f})"
                      + (f", {busy:.2f} at 256+ waiting" if busy is not None else "")
                      + f" | peak waiting {r['peak_waiting']}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
