"""The SGLang paper's workloads (benchmarks/workloads/) on radixlm, its ablations, and HF transformers.

    python benchmarks/bench_workloads.py --model tiny --out results.json          # CPU, seconds each (CI)
    python benchmarks/bench_workloads.py --model llama3-8b-shape --out results.json \\
        --markdown results.md --plot-dir .                                         # one H200, ~6 minutes

Systems, each running the very same programs:
- radixlm: everything on (radix cache, lpm scheduling, frontend prefix hints);
- no_radix_cache: Engine(disable_radix_cache=True);
- fcfs: Engine(schedule_policy="fcfs") instead of lpm;
- no_frontend_hints: the program model's fork and run_batch prefix pre-caching turned off
  (global_config.enable_fork_precache / enable_precache_with_tracing);
- hf_transformers: HF `generate` through an engine-shaped driver (workloads/hf_driver.py) on the same
  weights, after radixlm's engines are gone.

Per workload and system: throughput (program instances per second, every instance of the workload
in flight at once through run_batch) and latency (one instance alone, cache flushed first; median
of --latency-repeats). For radixlm systems also the cache hit rate the engine reports against the
optimal one (workloads/recorder.py replays the same token sequences through its own trie) and the
time the scheduler spent in radix cache bookkeeping (EngineStats.radix_cache_time_s); the control
workload's fraction is the paper's overhead number.

Models (the helpers of bench_engine.py): `tiny` is the 2-layer test checkpoint, sizes scaled down
to seconds on a CPU; `llama3-8b-shape` is Llama-3-8B's shape with random bf16 weights made on the
GPU, with the small local tokenizer (token ids the tokenizer does not have decode to nothing, so a
random model's generated text mostly vanishes from later prompts there; see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
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

import torch

from bench_engine import hf_model_on_shared_weights, make_model_dir  # also makes radixlm importable

import radixlm  # noqa: E402
from radixlm.core.program.config import global_config  # noqa: E402
from workloads import WORKLOADS  # noqa: E402
from workloads.recorder import RecordingEngine, hit_rates  # noqa: E402

SYSTEMS = ("radixlm", "no_radix_cache", "fcfs", "no_frontend_hints", "hf_transformers")
# Engine options per radixlm system; systems with the same options share one engine.
ENGINE_OPTIONS = {"radixlm": {}, "no_frontend_hints": {}, "no_radix_cache": {"disable_radix_cache": True},
                  "fcfs": {"schedule_policy": "fcfs"}}
PRESETS = {
    "tiny": {"size": "tiny", "engine": {}, "hf_max_batch": 32, "hf_max_batch_tokens": 1 << 16,
             "latency_repeats": 1, "time_limit_s": None},
    # CUDA graphs up to 128 decoding requests (the gpu sizes decode at most ~120 at once; larger batches
    # decode eagerly): fewer captures for each of the three engines.
    "llama3-8b-shape": {"size": "gpu", "engine": {"chunked_prefill_size": 16384, "cuda_graph_max_bs": 128},
                        "hf_max_batch": 64, "hf_max_batch_tokens": 1 << 17, "latency_repeats": 1,
                        "time_limit_s": 320},
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def set_frontend_hints(on: bool) -> None:
    global_config.enable_fork_precache = on
    global_config.enable_precache_with_tracing = on


def instance_counts(args: argparse.Namespace, size: str) -> dict[str, int]:
    counts = {name: max(1, round(w.instances[size] * args.scale)) for name, w in WORKLOADS.items()}
    for item in args.instances or []:
        name, _, n = item.partition("=")
        if name not in WORKLOADS or not n.isdigit():
            raise SystemExit(f"--instances takes NAME=N with NAME one of {list(WORKLOADS)}; got {item!r}")
        counts[name] = int(n)
    return counts


class Runner:
    """Measures workloads on one engine-shaped backend, within the run's time limit."""

    def __init__(self, args: argparse.Namespace, batches: dict[str, list[dict[str, Any]]], deadline: float | None):
        self.args = args
        self.batches = batches
        self.deadline = deadline

    def measure(self, system: str, name: str, backend: RecordingEngine, engine_stats: Any) -> dict[str, Any]:
        """Throughput, then latency, of one workload on one system. `engine_stats()` reads the counters
        of the engine behind the backend."""
        if self.deadline is not None and time.perf_counter() > self.deadline:
            return {"skipped": "time limit"}
        workload, batch = WORKLOADS[name], self.batches[name]
        set_frontend_hints(system != "no_frontend_hints")
        try:
            walls = []
            for i in range(self.args.repeats):  # counters and requests are those of the first run
                flush(backend)
                counters = engine_stats()
                start = time.perf_counter()
                workload.run_batch(backend, batch)
                walls.append(time.perf_counter() - start)
                if i == 0:
                    before, after, requests = counters, engine_stats(), backend.take_requests()
            backend.take_requests()
            wall = statistics.median(walls)
            out: dict[str, Any] = {"throughput": {
                "instances": len(batch), "seconds": wall, "runs": walls, "programs_per_s": len(batch) / wall,
                "requests": len(requests), "prompt_tokens": sum(len(r.input_ids) for r in requests),
                "output_tokens": sum(len(r.output_ids) for r in requests),
                "counters": {k: after[k] - before[k] for k in after}}}  # the engine's (or driver's), first run
            if system != "hf_transformers":
                out["cache"] = hit_rates(requests)
                out["radix_cache_time_fraction"] = out["throughput"]["counters"]["radix_cache_time_s"] / walls[0]
            times = []
            for i in range(self.args.latency_repeats):
                flush(backend)
                start = time.perf_counter()
                workload.run_one(backend, batch[i % len(batch)])
                times.append(time.perf_counter() - start)
            backend.take_requests()
            out["latency"] = {"seconds": statistics.median(times), "runs": times}
        except Exception as error:  # one broken workload must not cost the whole run
            log(f"{name} on {system} failed: {error!r}")
            out = {"error": repr(error)}
        finally:
            set_frontend_hints(True)
        if "throughput" in out and "latency" in out:
            log(f"{name:20s} {system:18s} {out['throughput']['programs_per_s']:9.2f} programs/s  "
                f"latency {out['latency']['seconds']:.3f} s"
                + (f"  hit {out['cache']['hit_rate']:.3f} (optimal {out['cache']['optimal_hit_rate']:.3f})"
                   if "cache" in out else ""))
        return out

    def warm_up(self, backend: Any, names: list[str]) -> None:
        """Runs one instance of each workload unmeasured (kernel compilation, index building)."""
        for name in names:
            try:
                WORKLOADS[name].run_one(backend, self.batches[name][0])
            except Exception as error:
                log(f"warm-up of {name} failed: {error!r}")
        flush(backend)


def flush(backend: Any) -> None:
    if not backend.flush_cache():
        raise RuntimeError("the cache could not be flushed: requests still in flight")
    backend.take_requests()


def engine_stats(engine: Any) -> Any:
    keys = ("prompt_tokens_total", "cached_tokens_total", "prefill_tokens_total", "generated_tokens_total",
            "radix_cache_time_s", "retractions_total")

    def read() -> dict[str, Any]:
        stats = engine.get_stats()
        return {k: stats[k] for k in keys}

    return read


def run(args: argparse.Namespace) -> dict[str, Any]:
    preset = PRESETS[args.model]
    size = args.size or preset["size"]
    for key in ("hf_max_batch", "hf_max_batch_tokens", "latency_repeats", "time_limit_s"):
        if getattr(args, key) is None:
            setattr(args, key, preset[key])
    systems = [s for s in SYSTEMS if s in (args.systems or SYSTEMS)]
    names = list(args.workloads or WORKLOADS)
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise SystemExit(f"unknown workload(s) {unknown}; known: {list(WORKLOADS)}")
    missing = {n: [m for m in WORKLOADS[n].requires if importlib.util.find_spec(m) is None] for n in names}
    names = [n for n in names if not missing[n]]
    counts = instance_counts(args, size)
    batches = {n: WORKLOADS[n].make_args(counts[n], WORKLOADS[n].sizes[size], random.Random(f"{n}:{args.seed}"))
               for n in names}
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    results: dict[str, Any] = {
        "model": args.model, "command": "python " + " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": machine(device), "systems": systems,
        "settings": {"size": size, **{k: getattr(args, k) for k in (
            "hf_max_batch", "hf_max_batch_tokens", "hf_window_ms", "repeats", "latency_repeats", "time_limit_s",
            "seed", "scale")}},
        "skipped_workloads": {n: f"needs {m}" for n, m in missing.items() if m},
        "workloads": {n: {"description": WORKLOADS[n].description, "prefix_heavy": WORKLOADS[n].prefix_heavy,
                          "instances": counts[n], "sizes": WORKLOADS[n].sizes[size], "systems": {}}
                      for n in names},
        "engines": {},
    }
    start = time.perf_counter()
    runner = Runner(args, batches, None if args.time_limit_s is None else start + args.time_limit_s)
    model_dir, extra = make_model_dir(args.model, tempfile.mkdtemp(prefix="radixlm-workloads-"))
    groups: dict[str, list[str]] = {}
    for system in systems:
        if system in ENGINE_OPTIONS:
            groups.setdefault(json.dumps(ENGINE_OPTIONS[system], sort_keys=True), []).append(system)
    # The peer runs on the weights of the second engine (no_radix_cache) once that engine is gone: the
    # targets compare radixlm with both, so they come before the fcfs ablation should time run out.
    hf_pending = "hf_transformers" in systems
    hf_after = min(1, len(groups) - 1)
    for i, (options, members) in enumerate(groups.items()):
        t0 = time.perf_counter()
        engine = radixlm.Engine(model_dir, device=device.type, log_level="error",
                                mem_fraction_static=args.mem_fraction_static, **preset["engine"], **extra,
                                **json.loads(options))
        results["engines"][",".join(members)] = {"init_s": time.perf_counter() - t0, "options": json.loads(options),
                                                 "kv_pool_tokens": engine.kv_pool_size}
        log(f"engine for {members} up in {time.perf_counter() - t0:.1f} s, KV pool {engine.kv_pool_size} tokens")
        backend = RecordingEngine(engine)
        if i == 0:
            runner.warm_up(backend, names)
        for name in names:
            for system in members:
                entry = runner.measure(system, name, backend, engine_stats(engine))
                results["workloads"][name]["systems"][system] = entry
        weights = release_weights(engine)
        del engine, backend
        if hf_pending and i == hf_after:
            hf_pending = False
            run_hf(args, runner, results, names, weights, model_dir, device)
        del weights
        free_device_memory(device)
    if hf_pending:  # only the peer was asked for: an engine with a small KV pool just to make the weights
        engine = radixlm.Engine(model_dir, device=device.type, log_level="error", max_total_tokens=1024,
                                disable_cuda_graph=True, **extra)
        weights = release_weights(engine)
        del engine
        run_hf(args, runner, results, names, weights, model_dir, device)
    results["total_s"] = time.perf_counter() - start
    summarize(results)
    return results


def release_weights(engine: Any) -> tuple[Any, Any, int, list[int]]:
    """Shuts the engine down and keeps its model: (model, tokenizer, context length, EOS ids)."""
    kept = (engine._runner.model, engine.tokenizer, engine.context_len, engine.eos_token_ids)
    engine.shutdown()
    return kept


def free_device_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_hf(args: argparse.Namespace, runner: Runner, results: dict[str, Any], names: list[str],
           weights: tuple[Any, Any, int, list[int]], model_dir: str, device: torch.device) -> None:
    from workloads.hf_driver import HFEngine

    model, tokenizer, context_len, eos = weights
    free_device_memory(device)
    t0 = time.perf_counter()
    hf = hf_model_on_shared_weights(model, model_dir, device)
    driver = HFEngine(hf, tokenizer, device, model_path=model_dir, context_len=context_len, eos_token_ids=eos,
                      max_batch=args.hf_max_batch, max_batch_tokens=args.hf_max_batch_tokens,
                      window_s=args.hf_window_ms / 1e3)
    results["engines"]["hf_transformers"] = {"init_s": time.perf_counter() - t0}
    backend = RecordingEngine(driver)
    runner.warm_up(backend, names[:1])
    for name in names:
        results["workloads"][name]["systems"]["hf_transformers"] = runner.measure(
            "hf_transformers", name, backend, driver.get_stats)
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
    if control:
        seconds, spent = control["runs"][0], control["counters"]["radix_cache_time_s"]
        results["bookkeeping"] = {"control_seconds": seconds, "radix_cache_time_s": spent, "fraction": spent / seconds}


def markdown(results: dict[str, Any]) -> str:
    systems = [s for s in results["systems"]]
    short = {"radixlm": "radixlm", "no_radix_cache": "no cache", "fcfs": "fcfs", "no_frontend_hints": "no hints",
             "hf_transformers": "HF"}
    lines = ["**Throughput** (program instances/s; every instance in flight at once) and cache hit rate "
             "(radixlm, achieved / optimal):", "",
             "| workload | instances | " + " | ".join(short[s] for s in systems)
             + " | vs HF | vs no cache | hit rate | optimal |",
             "|---|---|" + "---|" * len(systems) + "---|---|---|---|"]
    for name, w in results["workloads"].items():
        cells = [_cell(_get(w["systems"].get(s, {}), "throughput", "programs_per_s"), w["systems"].get(s))
                 for s in systems]
        vs_hf, vs_nc = w["speedup"].get("vs_hf_transformers"), w["speedup"].get("vs_no_radix_cache")
        cache = _get(w["systems"].get("radixlm", {}), "cache") or {}
        lines.append(f"| {name} | {w['instances']} | " + " | ".join(cells)
                     + f" | {_x(vs_hf)} | {_x(vs_nc)} | {_pct(cache.get('hit_rate'))} | "
                     f"{_pct(cache.get('optimal_hit_rate'))} |")
    lines += ["", "**Latency** (seconds, one instance alone, cache flushed first; median):", "",
              "| workload | " + " | ".join(short[s] for s in systems) + " |", "|---|" + "---|" * len(systems)]
    for name, w in results["workloads"].items():
        cells = [_cell(_get(w["systems"].get(s, {}), "latency", "seconds"), w["systems"].get(s), "{:.3f}")
                 for s in systems]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    b = results.get("bookkeeping")
    if b:
        lines += ["", f"Radix cache bookkeeping in the control run: {b['radix_cache_time_s'] * 1e3:.1f} ms of "
                      f"{b['control_seconds']:.2f} s ({b['fraction'] * 100:.2f}%)."]
    if results.get("skipped_workloads"):
        lines += ["", "Skipped: " + ", ".join(f"{n} ({why})" for n, why in results["skipped_workloads"].items())]
    return "\n".join(lines)


def _cell(value: float | None, entry: dict[str, Any] | None, fmt: str = "{:.2f}") -> str:
    if value is not None:
        return fmt.format(value)
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
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, help="default: all")
    p.add_argument("--instances", nargs="+", metavar="NAME=N", help="instances of a workload (default: its preset's)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every default instance count")
    p.add_argument("--repeats", type=int, default=1, help="throughput runs per workload and system (median)")
    p.add_argument("--latency-repeats", type=int, help="single-instance runs per workload and system (median)")
    p.add_argument("--time-limit-s", type=float, help="skip the measurements that would start after this many seconds")
    p.add_argument("--hf-max-batch", type=int, help="HF driver: rows per generate call")
    p.add_argument("--hf-max-batch-tokens", type=int, help="HF driver: padded tokens per generate call")
    p.add_argument("--hf-window-ms", type=float, default=10.0, help="HF driver: how long it collects calls")
    p.add_argument("--mem-fraction-static", type=float, default=0.85)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu", action="store_true", help="run on the CPU even when a GPU is present")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--markdown", help="write the tables here")
    p.add_argument("--plot-dir", help="write normalized bar charts (PNG) here")
    args = p.parse_args(argv)
    results = run(args)
    table = markdown(results)
    print(table, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    if args.plot_dir:
        stem = "workloads_" + args.model.replace("-", "_")
        for path in plot(results, args.plot_dir, stem):
            log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
