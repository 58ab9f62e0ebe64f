"""The SGLang paper's workloads (benchmarks/workloads/) on radixlm, its ablations, and HF transformers.

    python benchmarks/bench_workloads.py --model tiny --out results.json          # CPU, seconds each (CI)
    python benchmarks/bench_workloads.py --model llama3-8b-shape --out results.json \\
        --markdown results.md --plot-dir .                                         # one H200, under 8 minutes

Systems, each running the very same programs, measured in this order (each on its own engine), so
that a time limit cuts the least important ones:
- radixlm: everything on (radix cache, lpm scheduling, frontend prefix hints);
- no_radix_cache: Engine(disable_radix_cache=True);
- fcfs: Engine(schedule_policy="fcfs") instead of the default (lpm);
- dfs_weight: Engine(schedule_policy="dfs-weight") (only when --systems names it);
- lpm_always: lpm reordering at any memory pressure (schedule_only_under_pressure=False; only when
  --systems names it): the default keeps arrival order while the free KV slots hold the queue;
- no_frontend_hints: the program model's fork and run_batch prefix pre-caching turned off
  (global_config.enable_fork_precache / enable_precache_with_tracing);
- hf_transformers: HF `generate` through an engine-shaped driver (workloads/hf_driver.py) on the same
  weights, after radixlm's engines are gone, on the first `hf_instances` of each workload's instances
  (HF's own batch is at most --hf-max-batch rows); its throughput runs come before its latency runs.

Per workload and system: throughput (program instances per second, every instance of the workload
in flight at once through run_batch), with the requests in flight (peak and time-mean, counted at the
engine's interface) and, for radixlm systems, the engine's decode batches (peak and mean rows per
decode step, counted at every model forward); and latency (one instance alone, cache flushed first;
median of --latency-repeats). For radixlm systems also the cache hit rate the engine reports against
the optimal one (workloads/recorder.py replays the same token sequences through its own trie) and
the time the scheduler spent in radix cache bookkeeping (EngineStats.radix_cache_time_s); the control
workload's fraction is the paper's overhead number.

Before any engine starts, every workload is profiled without a model (workloads/estimate.py) and the
run's time estimated per measurement; with --time-limit-s, a measurement that would start after the
limit (counted from the start of this script) is skipped, and --out is rewritten after every
measurement, so a run stopped from outside keeps what it measured.

Models (the helpers of bench_engine.py): `tiny` is the 2-layer test checkpoint, sizes scaled down
to seconds on a CPU; `llama3-8b-shape` is Llama-3-8B's shape with random bf16 weights made on the
GPU, with the small local tokenizer (token ids the tokenizer does not have decode to nothing, so a
random model's generated text mostly vanishes from later prompts there; see
benchmarks/results/2026-11-29-paper-workloads.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

START = time.perf_counter()  # --time-limit-s counts from here: imports and engine starts included

import torch  # noqa: E402

from bench_engine import hf_model_on_shared_weights, make_model_dir, parse_engine_options  # noqa: E402

import radixlm  # noqa: E402
from radixlm.core.runtime.tokenizer.loader import load_tokenizer  # noqa: E402
from radixlm.core.lang.config import global_config  # noqa: E402
from workloads import WORKLOADS  # noqa: E402
from workloads.estimate import DeviceCost, Profile, estimate_seconds, profile_workload  # noqa: E402
from workloads.recorder import RecordingEngine, hit_rates  # noqa: E402

SYSTEMS = ("radixlm", "no_radix_cache", "fcfs", "dfs_weight", "lpm_always", "no_frontend_hints",
           "hf_transformers")  # run order
ENGINE_OPTIONS = {"radixlm": {}, "no_radix_cache": {"disable_radix_cache": True}, "fcfs": {"schedule_policy": "fcfs"},
                  "dfs_weight": {"schedule_policy": "dfs-weight"},
                  "lpm_always": {"schedule_only_under_pressure": False}, "no_frontend_hints": {}}
ON_REQUEST = ("dfs_weight", "lpm_always")  # run only when --systems names them
DEFAULT_SYSTEMS = tuple(s for s in SYSTEMS if s not in ON_REQUEST)
PARTS = ("throughput", "latency")

# The device model behind the time estimate, fitted to the H200 run of 2026-11-29
# (benchmarks/results/2026-11-29-paper-workloads.md:
# engine prefill ~41k tokens/s in large batches, decode ~4.7 ms at batch 1 plus the rows' GEMM share
# and KV reads, HF generate ~90 ms per step and ~17k prefill tokens/s); within ~20% per measurement there.
H200_LLAMA3_8B = DeviceCost(
    prefill_s_per_token=24e-6, decode_step_s=4.7e-3, decode_s_per_row=12e-6, kv_s_per_token=4.9e-8,
    host_s_per_request=0.5e-3, run_s=0.3, hf_prefill_s_per_token=59e-6, hf_step_s=0.09, hf_kv_s_per_token=0.5e-6,
    record_s_per_token=0.8e-6, unprofiled_s=5.0, first_engine_start_s=13.0, engine_start_s=2.0)
PRESETS = {
    "tiny": {"size": "tiny", "engine": {}, "hf_max_batch": 32, "hf_max_batch_tokens": 1 << 16,
             "latency_repeats": 1, "time_limit_s": None, "hf_latency": True, "cost": None},
    # Decode batches of up to 256 requests, all replayed from CUDA graphs: the gpu instance counts put
    # at least 256 requests in flight where a workload's structure and the time limit allow (react and
    # json_decoding: 128, dspy_rag: 128). Past ~256 rows a decode step of the 8B shape is bound by its
    # GEMMs' FLOPs and the rows' KV reads, both linear in the rows, so a larger batch would not make a
    # token cheaper, while the KV pool (~800k tokens) would hold far more.
    "llama3-8b-shape": {"size": "gpu", "engine": {"chunked_prefill_size": 16384, "max_running_requests": 256,
                                                  "cuda_graph_max_bs": 256},
                        "hf_max_batch": 64, "hf_max_batch_tokens": 1 << 17, "latency_repeats": 1,
                        "time_limit_s": 455, "hf_latency": False, "cost": H200_LLAMA3_8B},
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def set_frontend_hints(on: bool) -> None:
    global_config.enable_fork_precache = on
    global_config.enable_precache_with_tracing = on


def instance_counts(items: list[str] | None, defaults: dict[str, int]) -> dict[str, int]:
    counts = dict(defaults)
    for item in items or []:
        name, _, n = item.partition("=")
        if name not in WORKLOADS or not n.isdigit() or int(n) < 1:
            raise SystemExit(f"instance counts take NAME=N with NAME one of {list(WORKLOADS)}; got {item!r}")
        counts[name] = int(n)
    return counts


class ForwardCounter:
    """Counts an engine's model forwards: decode steps and their rows, prefill (extend) steps and their
    tokens. An instance attribute over ModelRunner.forward (as bench_engine's breakdown does); it only
    counts, so nothing waits for the device."""

    def __init__(self, engine: Any) -> None:
        self._runner = engine._runner
        inner = self._runner.forward
        self._counts = self._zero()

        def counted(batch: Any) -> Any:
            c = self._counts
            if batch.is_decode:
                c["decode_steps"] += 1
                c["decode_rows"] += len(batch.input_ids)
                c["peak_decode_batch"] = max(c["peak_decode_batch"], len(batch.input_ids))
            else:
                c["prefill_steps"] += 1
                c["prefill_tokens"] += len(batch.input_ids)
            return inner(batch)

        self._runner.forward = counted

    @staticmethod
    def _zero() -> dict[str, int]:
        return {"decode_steps": 0, "decode_rows": 0, "peak_decode_batch": 0, "prefill_steps": 0, "prefill_tokens": 0}

    def take(self) -> dict[str, float]:
        """The counts since the last take (call it while the engine is idle)."""
        counts, self._counts = self._counts, self._zero()
        counts["mean_decode_batch"] = counts["decode_rows"] / counts["decode_steps"] if counts["decode_steps"] else 0.0
        return counts


class Runner:
    """Runs the measurements in the order asked, each only if the time limit has not passed, and
    rewrites the results files after each."""

    def __init__(self, args: argparse.Namespace, results: dict[str, Any], deadline: float | None) -> None:
        self.args = args
        self.results = results
        self.deadline = deadline

    def past_deadline(self) -> bool:
        return self.deadline is not None and time.perf_counter() > self.deadline

    def skip(self, system: str, names: list[str], parts: tuple[str, ...] = PARTS) -> None:
        for name in names:
            entry = self.results["workloads"][name]["systems"].setdefault(system, {})
            for part in parts:
                entry[part] = {"skipped": "time limit"}
        self.save()

    def measure(self, system: str, name: str, backend: RecordingEngine, batch: list[dict[str, Any]],
                read_counters: Any, forwards: ForwardCounter | None, parts: tuple[str, ...] = PARTS) -> None:
        """Throughput and/or latency of one workload on one system. `read_counters()` reads the
        cumulative counters of the engine (or driver) behind the backend."""
        entry = self.results["workloads"][name]["systems"].setdefault(system, {})
        estimate = self.results["estimate"]["cells"].get(name, {}).get(system, {})
        for part in parts:
            if self.past_deadline():
                entry[part] = {"skipped": "time limit"}
                continue
            set_frontend_hints(system != "no_frontend_hints")
            try:
                if part == "throughput":
                    self._throughput(system, name, backend, batch, read_counters, forwards, entry)
                else:
                    entry[part] = self._latency(name, backend, batch)
                entry[part]["estimate_s"] = estimate.get(part)
            except Exception as error:  # one broken workload must not cost the whole run
                log(f"{name} {part} on {system} failed: {error!r}")
                entry[part] = {"error": repr(error)}
            finally:
                set_frontend_hints(True)
            self._log(system, name, part, entry)
            self.save()

    def _throughput(self, system: str, name: str, backend: RecordingEngine, batch: list[dict[str, Any]],
                    read_counters: Any, forwards: ForwardCounter | None, entry: dict[str, Any]) -> None:
        walls = []
        for i in range(self.args.repeats):  # counters and requests are those of the first run
            flush(backend)
            before = read_counters()
            backend.take_in_flight()
            if forwards is not None:
                forwards.take()
            start = time.perf_counter()
            WORKLOADS[name].run_batch(backend, batch)
            walls.append(time.perf_counter() - start)
            if i == 0:
                after, in_flight = read_counters(), backend.take_in_flight()
                counters = {k: after[k] - before[k] for k in after}  # the engine's (or driver's)
                batches = forwards.take() if forwards is not None else None
                # Only radixlm's requests are tokenized again for the optimal replay (the costly part).
                if system == "radixlm":
                    requests = backend.take_requests()
                    entry["cache"] = hit_rates(requests)
                    counts = {"requests": len(requests), "prompt_tokens": entry["cache"]["prompt_tokens"],
                              "output_tokens": sum(len(r.output_ids) for r in requests)}
                else:
                    counts = backend.take_counts()
            backend.take_counts()
        wall = statistics.median(walls)
        out: dict[str, Any] = {
            "instances": len(batch), "seconds": wall, "runs": walls, "programs_per_s": len(batch) / wall,
            "requests": counts["requests"], "prompt_tokens": counts["prompt_tokens"],
            "output_tokens": counts["output_tokens"], "in_flight": in_flight, "counters": counters}
        if batches is not None:
            out["forwards"] = batches
        entry["throughput"] = out
        if system in ENGINE_OPTIONS:
            if "cache" not in entry:  # achieved only: the engine's own count of cached prompt tokens
                entry["cache"] = {"requests": counts["requests"], "prompt_tokens": counts["prompt_tokens"],
                                  "cached_tokens": counts["cached_tokens"],
                                  "hit_rate": counts["cached_tokens"] / max(counts["prompt_tokens"], 1)}
            entry["radix_cache_time_fraction"] = out["counters"]["radix_cache_time_s"] / walls[0]

    def _latency(self, name: str, backend: RecordingEngine, batch: list[dict[str, Any]]) -> dict[str, Any]:
        times = []
        for i in range(self.args.latency_repeats):
            flush(backend)
            start = time.perf_counter()
            WORKLOADS[name].run_one(backend, batch[i % len(batch)])
            times.append(time.perf_counter() - start)
        backend.take_counts()
        return {"seconds": statistics.median(times), "runs": times}

    def _log(self, system: str, name: str, part: str, entry: dict[str, Any]) -> None:
        e = entry[part]
        head = f"{name:20s} {system:18s} {part:10s}"
        if "skipped" in e or "error" in e:
            log(f"{head} {e.get('skipped') or 'error'}")
            return
        guess = f" (estimate {e['estimate_s']:.1f} s)" if e.get("estimate_s") is not None else ""
        if part == "latency":
            log(f"{head} {e['seconds']:.3f} s{guess}")
            return
        line = (f"{head} {e['programs_per_s']:9.2f} programs/s in {e['seconds']:.2f} s{guess}, "
                f"{e['instances']} instances, in flight peak {e['in_flight']['peak']} "
                f"mean {e['in_flight']['mean']:.0f}")
        if "forwards" in e:
            f = e["forwards"]
            line += f", decode batch peak {f['peak_decode_batch']} mean {f['mean_decode_batch']:.0f}"
        if "optimal_hit_rate" in entry.get("cache", {}):
            line += f", hit {entry['cache']['hit_rate']:.3f} (optimal {entry['cache']['optimal_hit_rate']:.3f})"
        log(line)

    def warm_up(self, backend: Any, batches: dict[str, list[dict[str, Any]]]) -> None:
        """Runs a few instances of each workload together, unmeasured (kernel compilation, index building)."""
        for name, batch in batches.items():
            try:
                WORKLOADS[name].run_batch(backend, batch[:4])
            except Exception as error:
                log(f"warm-up of {name} failed: {error!r}")
        flush(backend)

    def save(self) -> None:
        summarize(self.results)
        self.results["elapsed_s"] = time.perf_counter() - START
        for path, text in ((self.args.out, lambda: json.dumps(self.results, indent=1)),
                           (self.args.markdown, lambda: markdown(self.results) + "\n")):
            if path:
                with open(path + ".tmp", "w") as f:
                    f.write(text())
                os.replace(path + ".tmp", path)


def flush(backend: Any) -> None:
    if not backend.flush_cache():
        raise RuntimeError("the cache could not be flushed: requests still in flight")
    backend.take_counts()  # drops what was recorded so far


def engine_stats(engine: Any) -> Any:
    keys = ("prompt_tokens_total", "cached_tokens_total", "prefill_tokens_total", "generated_tokens_total",
            "radix_cache_time_s", "retractions_total")

    def read() -> dict[str, Any]:
        stats = engine.get_stats()
        return {k: stats[k] for k in keys}

    return read


def estimate_run(names: list[str], profiles: dict[str, Profile], counts: dict[str, int], hf_counts: dict[str, int],
                 steps: list[tuple[str, tuple[str, ...]]], cost: DeviceCost, repeats: int = 1) -> dict[str, Any]:
    """Seconds per measurement (a workload without a profile: cost.unprofiled_s each), per step, in all."""
    cells: dict[str, dict[str, dict[str, float]]] = {name: {} for name in names}
    per_step = []
    for system, parts in steps:
        for name in names:
            n = hf_counts[name] if system == "hf_transformers" else counts[name]
            guess = (estimate_seconds(profiles[name], n, system, cost) if name in profiles
                     else {part: cost.unprofiled_s for part in PARTS})
            guess["throughput"] *= repeats  # --repeats throughput runs, each the estimate's
            cells[name].setdefault(system, {}).update({part: guess[part] for part in parts})
        per_step.append({"system": system, "parts": list(parts),
                         "seconds": sum(cells[n][system][part] for n in names for part in parts)})
    engines = [system for system, _ in steps if system in ENGINE_OPTIONS]
    own = sum(1 for n in names if WORKLOADS[n].engine_options)  # each has an engine of its own per system
    starts = (cost.first_engine_start_s + cost.engine_start_s * (len(engines) * (1 + own) - 1)) if engines else 0.0
    warm_up = sum(cells[n][engines[0]]["latency"] for n in names) if engines else 0.0  # a few instances each
    total = starts + warm_up + sum(step["seconds"] for step in per_step)
    return {"cells": cells, "steps": per_step, "engine_starts_s": starts, "warm_up_s": warm_up, "total_s": total}


def run(args: argparse.Namespace) -> dict[str, Any]:
    preset = PRESETS[args.model]
    size = args.size or preset["size"]
    for key in ("hf_max_batch", "hf_max_batch_tokens", "latency_repeats", "time_limit_s", "hf_latency"):
        if getattr(args, key) is None:
            setattr(args, key, preset[key])
    systems = [s for s in SYSTEMS if s in (args.systems or DEFAULT_SYSTEMS)]
    names = list(args.workloads or WORKLOADS)
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise SystemExit(f"unknown workload(s) {unknown}; known: {list(WORKLOADS)}")
    missing = {n: [m for m in WORKLOADS[n].requires if importlib.util.find_spec(m) is None] for n in names}
    names = [n for n in names if not missing[n]]
    counts = instance_counts(args.instances, {n: max(1, round(w.instances[size] * args.scale))
                                              for n, w in WORKLOADS.items()})
    hf_counts = instance_counts(args.hf_instances, {n: w.hf_instances.get(size, counts[n])
                                                    for n, w in WORKLOADS.items()})
    hf_counts = {n: min(hf_counts[n], counts[n]) for n in names}
    batches = {n: WORKLOADS[n].make_args(counts[n], WORKLOADS[n].sizes[size], random.Random(f"{n}:{args.seed}"))
               for n in names}
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    engine_options = {**preset["engine"], "mem_fraction_static": args.mem_fraction_static,
                      **parse_engine_options(args.engine_options, "--engine-options")}
    results: dict[str, Any] = {
        "model": args.model, "command": "python " + " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": machine(device), "systems": systems,
        "settings": {"size": size, "engine": engine_options, **{k: getattr(args, k) for k in (
            "hf_max_batch", "hf_max_batch_tokens", "hf_window_ms", "repeats", "latency_repeats", "time_limit_s",
            "hf_latency", "seed", "scale")}},
        "skipped_workloads": {n: f"needs {m}" for n, m in missing.items() if m},
        "workloads": {n: {"description": WORKLOADS[n].description, "prefix_heavy": WORKLOADS[n].prefix_heavy,
                          "instances": counts[n], "hf_instances": hf_counts[n], "sizes": WORKLOADS[n].sizes[size],
                          "systems": {}}
                      for n in names},
        "engines": {},
    }
    runner = Runner(args, results, None if args.time_limit_s is None else START + args.time_limit_s)
    model_dir, extra = make_model_dir(args.model, tempfile.mkdtemp(prefix="radixlm-workloads-"))

    t0 = time.perf_counter()
    profiles = {}
    tokenizer = load_tokenizer(model_dir)
    for name in names:
        try:
            profiles[name] = profile_workload(WORKLOADS[name], batches[name], tokenizer)
        except Exception as error:  # DSPy's adapter cannot work with the stand-in's empty replies
            log(f"no profile of {name} (the estimate takes a flat guess): {error!r}")
    results["profiles"] = {n: dataclasses.asdict(p) for n, p in profiles.items()}
    steps = plan(systems, args.hf_latency, args.systems)
    results["estimate"] = {"cells": {}}
    if preset["cost"] is not None:
        cost = dataclasses.replace(preset["cost"], hf_max_batch=args.hf_max_batch,
                                   max_running=engine_options.get("max_running_requests", 512))
        results["estimate"] = estimate_run(names, profiles, counts, hf_counts, steps, cost, args.repeats)
        log_estimate(results["estimate"], time.perf_counter() - START, args.time_limit_s, t0)

    hf_batches = {n: batches[n][: hf_counts[n]] for n in names}
    if "hf_transformers" in systems and not args.hf_latency:
        for name in names:
            results["workloads"][name]["systems"].setdefault("hf_transformers", {})["latency"] = {
                "skipped": "not asked for (--hf-latency)"}
    weights = None  # the model of the engine just shut down, when the next step is HF's
    first_engine = True
    for i, (system, parts) in enumerate(steps):
        if runner.past_deadline():
            runner.skip(system, names, parts)
            continue
        if system == "hf_transformers":
            if weights is None:  # no engine before it: one with a small KV pool just to make the weights
                engine = radixlm.Engine(model_dir, device=device.type, log_level="error", max_total_tokens=1024,
                                        disable_cuda_graph=True, **extra)
                weights = release_weights(engine)
                del engine
            run_hf(args, runner, names, hf_batches, weights, model_dir, device, parts)
            weights = None
            free_device_memory(device)
            continue
        # The workloads that ask for engine options of their own (a small KV pool) get an engine each,
        # after the shared one.
        groups = [([n for n in names if not WORKLOADS[n].engine_options.get(size)], {})]
        groups += [([n], WORKLOADS[n].engine_options[size]) for n in names if WORKLOADS[n].engine_options.get(size)]
        groups = [(group, own) for group, own in groups if group]
        for j, (group, own) in enumerate(groups):
            if runner.past_deadline():
                runner.skip(system, group, parts)
                continue
            t0 = time.perf_counter()
            engine = radixlm.Engine(model_dir, device=device.type, log_level="error",
                                    **{**engine_options, **own}, **extra, **ENGINE_OPTIONS[system])
            key = system if not own else f"{system}/{group[0]}"
            results["engines"][key] = {"init_s": time.perf_counter() - t0, "options": {**ENGINE_OPTIONS[system], **own},
                                       "kv_pool_tokens": engine.kv_pool_size,
                                       "max_running_requests": engine.options.max_running_requests,
                                       "cuda_graph_max_bs": engine.options.cuda_graph_max_bs}
            log(f"engine for {key} up in {time.perf_counter() - t0:.1f} s, KV pool {engine.kv_pool_size} tokens")
            backend = RecordingEngine(engine)
            forwards = ForwardCounter(engine)
            if first_engine:
                runner.warm_up(backend, {n: batches[n] for n in group})
                first_engine = False
            for name in group:
                runner.measure(system, name, backend, batches[name], engine_stats(engine), forwards, parts)
            last = j + 1 == len(groups)
            if last and i + 1 < len(steps) and steps[i + 1][0] == "hf_transformers":
                weights = release_weights(engine)
            else:
                engine.shutdown()
            del engine, backend, forwards
            free_device_memory(device)
    results["total_s"] = time.perf_counter() - START
    runner.save()
    return results


def plan(systems: list[str], hf_latency: bool, as_given: list[str] | None = None) -> list[tuple[str, tuple[str, ...]]]:
    """The run's steps in order of importance, so that a time limit cuts the least important: radixlm
    and its no-cache ablation, HF's throughput (the issue's targets compare radixlm with these three),
    then the fcfs and no-hints ablations, then HF's latency runs (one instance alone: HF's generate
    loop, ~90 ms a step on the 8B shape, makes them the slowest measurements and the least telling).
    `as_given` (--systems) runs the systems in its order instead: to see whether going first costs one."""
    order = [("radixlm", PARTS), ("no_radix_cache", PARTS), ("hf_transformers", ("throughput",)), ("fcfs", PARTS),
             ("dfs_weight", PARTS), ("lpm_always", PARTS), ("no_frontend_hints", PARTS)]
    if as_given:
        order = [(s, ("throughput",) if s == "hf_transformers" else PARTS) for s in dict.fromkeys(as_given)]
    if hf_latency:
        order.append(("hf_transformers", ("latency",)))
    return [(system, parts) for system, parts in order if system in systems]


def log_estimate(estimate: dict[str, Any], elapsed: float, limit: float | None, profile_start: float) -> None:
    steps = ", ".join(f"{step['system']} {'+'.join(step['parts'])} {step['seconds']:.0f} s"
                      for step in estimate["steps"])
    end = elapsed + estimate["total_s"]
    verdict = ""
    if limit is not None:
        verdict = f" against a {limit:.0f} s limit"
        if end > limit:
            verdict += ": the last measurements would be skipped"
    log(f"estimate, in run order: {steps}; engine starts {estimate['engine_starts_s']:.0f} s, warm-up "
        f"{estimate['warm_up_s']:.0f} s; profiling took {time.perf_counter() - profile_start:.1f} s; "
        f"done at ~{end:.0f} s{verdict}")


def release_weights(engine: Any) -> tuple[Any, Any, int, list[int]]:
    """Shuts the engine down and keeps its model: (model, tokenizer, context length, EOS ids)."""
    kept = (engine._runner.model, engine.tokenizer, engine.context_len, engine.eos_token_ids)
    engine.shutdown()
    return kept


def free_device_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_hf(args: argparse.Namespace, runner: Runner, names: list[str], batches: dict[str, list[dict[str, Any]]],
           weights: tuple[Any, Any, int, list[int]], model_dir: str, device: torch.device,
           parts: tuple[str, ...]) -> None:
    from workloads.hf_driver import HFEngine

    model, tokenizer, context_len, eos = weights
    free_device_memory(device)
    t0 = time.perf_counter()
    hf = hf_model_on_shared_weights(model, model_dir, device)
    driver = HFEngine(hf, tokenizer, device, model_path=model_dir, context_len=context_len, eos_token_ids=eos,
                      max_batch=args.hf_max_batch, max_batch_tokens=args.hf_max_batch_tokens,
                      window_s=args.hf_window_ms / 1e3)
    runner.results["engines"].setdefault("hf_transformers", {})["init_s"] = time.perf_counter() - t0
    backend = RecordingEngine(driver)
    first = names[0]
    try:
        WORKLOADS[first].run_one(backend, batches[first][0])
    except Exception as error:
        log(f"warm-up of {first} failed: {error!r}")
    flush(backend)
    for name in names:
        runner.measure("hf_transformers", name, backend, batches[name], driver.get_stats, None, parts)
    driver.shutdown()


def machine(device: torch.device) -> dict[str, Any]:
    info = {"host": platform.node(), "platform": platform.platform(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__, "device": device.type}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    try:
        info["load_average"] = os.getloadavg()
    except OSError:
        pass
    return info


# ---- summaries -------------------------------------------------------------------------------------


def _get(entry: dict[str, Any], *path: str) -> Any:
    for key in path:
        if not isinstance(entry, dict) or key not in entry:
            return None
        entry = entry[key]
    return entry


def summarize(results: dict[str, Any]) -> None:
    """Adds ratios per workload and the bookkeeping overhead of the control run."""
    for w in results["workloads"].values():
        s = w["systems"]
        tput = {name: _get(e, "throughput", "programs_per_s") for name, e in s.items()}
        ours = tput.get("radixlm")
        w["speedup"] = {f"vs_{name}": ours / t for name, t in tput.items() if ours and t and name != "radixlm"}
        lat = {name: _get(e, "latency", "seconds") for name, e in s.items()}
        w["latency_ratio"] = {f"{name}_over_radixlm": t / lat["radixlm"] for name, t in lat.items()
                              if t and lat.get("radixlm") and name != "radixlm"}
    control = _get(results["workloads"], "control", "systems", "radixlm", "throughput")
    if control and "runs" in control:
        seconds, spent = control["runs"][0], control["counters"]["radix_cache_time_s"]
        results["bookkeeping"] = {"control_seconds": seconds, "radix_cache_time_s": spent, "fraction": spent / seconds}


SHORT = {"radixlm": "radixlm", "no_radix_cache": "no cache", "fcfs": "fcfs", "dfs_weight": "dfs-weight",
         "lpm_always": "lpm always", "no_frontend_hints": "no hints",
         "hf_transformers": "HF"}


def markdown(results: dict[str, Any]) -> str:
    systems = results["systems"]
    hf = "hf_transformers" in systems
    lines = ["**Throughput** (program instances/s; every instance in flight at once; HF on the first "
             "\"HF instances\" of them) and cache hit rate (radixlm, achieved / optimal):", "",
             "| workload | instances | " + ("HF instances | " if hf else "") + " | ".join(SHORT[s] for s in systems)
             + " | vs HF | vs no cache | hit rate | optimal |",
             "|---|---|" + ("---|" if hf else "") + "---|" * len(systems) + "---|---|---|---|"]
    for name, w in results["workloads"].items():
        cells = [_cell(w["systems"].get(s, {}).get("throughput"), "programs_per_s") for s in systems]
        vs_hf, vs_nc = w["speedup"].get("vs_hf_transformers"), w["speedup"].get("vs_no_radix_cache")
        cache = _get(w["systems"].get("radixlm", {}), "cache") or {}
        lines.append(f"| {name} | {w['instances']} | " + (f"{w['hf_instances']} | " if hf else "") + " | ".join(cells)
                     + f" | {_x(vs_hf)} | {_x(vs_nc)} | {_pct(cache.get('hit_rate'))} | "
                     f"{_pct(cache.get('optimal_hit_rate'))} |")
    engines = [s for s in systems if s in ENGINE_OPTIONS]
    if engines:
        limits = {s: _get(results, "engines", s, "max_running_requests") for s in engines}
        lines += ["", "**Batch fill** of the throughput runs: requests in flight at the engine's interface (peak / "
                      "time-mean) and rows per decode step in the engine (peak / mean); the engines' decode batch "
                      "limit (max_running_requests): "
                      + ", ".join(f"{SHORT[s]} {limits[s]}" for s in engines if limits[s]) + ".",
                  "", "| workload | " + " | ".join(f"{SHORT[s]}: in flight | {SHORT[s]}: decode batch" for s in engines)
                  + " |", "|---|" + "---|---|" * len(engines)]
        for name, w in results["workloads"].items():
            cells = []
            for s in engines:
                t = w["systems"].get(s, {}).get("throughput", {})
                flight, fwd = t.get("in_flight"), t.get("forwards")
                cells.append(f"{flight['peak']} / {flight['mean']:.0f}" if flight else "-")
                cells.append(f"{fwd['peak_decode_batch']} / {fwd['mean_decode_batch']:.0f}" if fwd else "-")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    policies = [s for s in ("radixlm", "fcfs", "dfs_weight", "lpm_always") if s in systems]
    if len(policies) > 1:
        lines += ["", "**Scheduling policies** (radixlm runs the default, lpm): programs/s, and the radix cache's hit "
                      "rate as the engine counted it against the optimal for the same requests:", "",
                  "| workload | " + " | ".join(f"{SHORT[s]}" for s in policies) + " | radixlm / fcfs | "
                  + " | ".join(f"{SHORT[s]} hit" for s in policies) + " | optimal |",
                  "|---|" + "---|" * (2 * len(policies) + 2)]
        for name, w in results["workloads"].items():
            cells = [_cell(w["systems"].get(s, {}).get("throughput"), "programs_per_s") for s in policies]
            hits = [_pct(_get(w["systems"].get(s, {}), "cache", "hit_rate")) for s in policies]
            optimal = _get(w["systems"].get("radixlm", {}), "cache", "optimal_hit_rate")
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {_x(w['speedup'].get('vs_fcfs'))} | "
                         + " | ".join(hits) + f" | {_pct(optimal)} |")
    lines += ["", "**Latency** (seconds, one instance alone, cache flushed first; median):", "",
              "| workload | " + " | ".join(SHORT[s] for s in systems) + " |", "|---|" + "---|" * len(systems)]
    for name, w in results["workloads"].items():
        cells = [_cell(w["systems"].get(s, {}).get("latency"), "seconds", "{:.3f}") for s in systems]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    b = results.get("bookkeeping")
    if b:
        lines += ["", f"Radix cache bookkeeping in the control run: {b['radix_cache_time_s'] * 1e3:.1f} ms of "
                      f"{b['control_seconds']:.2f} s ({b['fraction'] * 100:.2f}%)."]
    if results.get("estimate", {}).get("total_s") is not None:
        took = results.get("total_s", results.get("elapsed_s"))
        lines += ["", f"Estimated before the run (workloads/estimate.py): {results['estimate']['total_s']:.0f} s of "
                      f"measurements, engine starts and warm-up; the whole run took {took:.0f} s."]
    if results.get("skipped_workloads"):
        lines += ["", "Skipped: " + ", ".join(f"{n} ({why})" for n, why in results["skipped_workloads"].items())]
    return "\n".join(lines)


def _cell(entry: dict[str, Any] | None, key: str, fmt: str = "{:.2f}") -> str:
    if entry and entry.get(key) is not None:
        return fmt.format(entry[key])
    if entry and "skipped" in entry:
        return "skipped"
    return "error" if entry and "error" in entry else "-"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.1f}%"


def plot(results: dict[str, Any], out_dir: str, stem: str) -> list[str]:
    """Bar charts normalized as in the paper: throughput relative to the best system of each workload
    (higher is better), latency relative to the best (lower is better)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["workloads"])
    systems = results["systems"]
    paths = []
    for metric, key, title in (
            ("throughput", "programs_per_s", "throughput relative to the best system (higher is better)"),
            ("latency", "seconds", "latency relative to the best system (lower is better)")):
        fig, ax = plt.subplots(figsize=(max(8.0, 1.1 * len(names)), 3.6))
        width = 0.8 / len(systems)
        for j, system in enumerate(systems):
            heights = []
            for name in names:
                values = {s: _get(results["workloads"][name]["systems"].get(s, {}), metric, key) for s in systems}
                known = [v for v in values.values() if v]
                best = (max if metric == "throughput" else min)(known) if known else None
                v = values[system]
                heights.append(v / best if v and best else 0.0)
            ax.bar([i + (j - (len(systems) - 1) / 2) * width for i in range(len(names))], heights, width, label=system)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(f"normalized {metric}")
        ax.set_title(f"{results['model']}: {title}", fontsize=9)
        ax.legend(fontsize=7, ncol=len(systems), loc="upper center", bbox_to_anchor=(0.5, -0.35))
        fig.tight_layout()
        path = str(Path(out_dir) / f"{stem}_{metric}.png")
        fig.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--size", choices=("tiny", "gpu"), help="workload size preset (default: the model's)")
    p.add_argument("--workloads", nargs="+", help=f"default: all of {list(WORKLOADS)}")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS,
                   help="run in this order (default: all but dfs_weight and lpm_always, radixlm first)")
    p.add_argument("--instances", nargs="+", metavar="NAME=N", help="instances of a workload (default: its preset's)")
    p.add_argument("--hf-instances", nargs="+", metavar="NAME=N",
                   help="instances the HF peer runs, the first of the workload's (default: the preset's)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every default instance count")
    p.add_argument("--repeats", type=int, default=1, help="throughput runs per workload and system (median)")
    p.add_argument("--latency-repeats", type=int, help="single-instance runs per workload and system (median)")
    p.add_argument("--time-limit-s", type=float,
                   help="skip the measurements that would start this many seconds after the script started")
    p.add_argument("--hf-max-batch", type=int, help="HF driver: rows per generate call")
    p.add_argument("--hf-max-batch-tokens", type=int, help="HF driver: padded tokens per generate call")
    p.add_argument("--hf-window-ms", type=float, default=10.0, help="HF driver: how long it collects calls")
    p.add_argument("--hf-latency", action=argparse.BooleanOptionalAction,
                   help="measure HF's latency runs, last of all (default: the preset's; off for the 8B shape)")
    p.add_argument("--mem-fraction-static", type=float, default=0.85)
    p.add_argument("--engine-options", nargs="+", metavar="KEY=VALUE",
                   help="Engine options over the preset's for every radixlm system, e.g. max_running_requests=512 "
                        "cuda_graph_max_bs=512 or cuda_graph_max_extend_tokens=0")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu", action="store_true", help="run on the CPU even when a GPU is present")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--markdown", help="write the tables here")
    p.add_argument("--plot-dir", help="write normalized bar charts (PNG) here")
    args = p.parse_args(argv)
    results = run(args)  # writes --out and --markdown as it goes
    print(markdown(results), flush=True)
    if args.plot_dir:
        stem = "workloads_" + args.model.replace("-", "_")
        for path in plot(results, args.plot_dir, stem):
            log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
