"""benchmarks/bench_workloads.py in its CPU mode (--model tiny), the mode CI runs: every paper workload
on every system, the result file's structure, the cache hit rate against the optimal one, the batch
counts (requests in flight, decode batches) against the engine's limits and counters, and the model-free
profile against the requests the engine saw; the time limit and the 8B preset's estimate without a
GPU; plus the optimal-hit-rate replay against a brute-force count."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SYSTEMS = ["radixlm", "no_radix_cache", "fcfs", "no_frontend_hints", "hf_transformers"]
RADIXLM_SYSTEMS = SYSTEMS[:4]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("workloads") / "results.json"
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "bench_workloads.py"), "--model", "tiny", "--cpu", "--repeats", "2",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def _recorder():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from workloads import recorder
    finally:
        sys.path.remove(str(BENCHMARKS))
    return recorder


def test_every_workload_runs_on_every_system(results):
    assert results["model"] == "tiny"
    assert results["systems"] == SYSTEMS
    assert {"date", "command", "machine", "settings", "engines", "total_s"} <= set(results)
    expected = {"mmlu", "hellaswag", "react", "generative_agents", "tree_of_thought", "skeleton_of_thought",
                "llm_judge", "json_decoding", "chat_short", "chat_long", "dspy_rag", "control", "prefix_pressure"}
    assert set(results["workloads"]) == expected and not results["skipped_workloads"]
    for name, w in results["workloads"].items():
        assert set(w["systems"]) == set(SYSTEMS), name
        assert 0 < w["hf_instances"] <= w["instances"], name
        for system, entry in w["systems"].items():
            for part in ("throughput", "latency"):
                assert "error" not in entry[part] and "skipped" not in entry[part], (name, system, entry)
            t = entry["throughput"]
            assert t["instances"] == (w["hf_instances"] if system == "hf_transformers" else w["instances"]) > 0
            assert t["programs_per_s"] == pytest.approx(t["instances"] / t["seconds"])
            assert t["requests"] >= t["instances"] and t["prompt_tokens"] > 0
            assert entry["latency"]["seconds"] > 0
        # Same programs, same work: every system generates the same number of tokens (greedy, lengths
        # fixed by max_tokens or by the regexes), within a little slack for regex fields that end early.
        outputs = [w["systems"][s]["throughput"]["output_tokens"] for s in SYSTEMS]
        assert max(outputs) <= 1.1 * min(outputs), (name, outputs)
        assert set(w["speedup"]) == {f"vs_{s}" for s in SYSTEMS[1:]}


def test_cache_hit_rate_is_near_optimal_on_prefix_heavy_workloads(results):
    for name, w in results["workloads"].items():
        ours = w["systems"]["radixlm"]["cache"]
        if w["prefix_heavy"]:
            assert ours["optimal_hit_rate"] > 0.5, name  # the generators do build shared prefixes
            assert ours["hit_rate"] > 0, name
            # prefix_pressure's documents outnumber its small pool by construction: what stays cached
            # depends on how arrivals interleave with steps, so on the machine's load (0.63-0.70 of an
            # optimal 0.70 seen here, 0.58 with a second benchmark beside the suite on 2 cores; fcfs
            # ~0.01), so its bound is looser, still far above what an order blind to the cache reaches.
            share = 0.7 if name == "prefix_pressure" else 0.95
            assert ours["hit_rate"] >= share * ours["optimal_hit_rate"], (name, ours)
        else:
            assert ours["optimal_hit_rate"] < 0.02, (name, ours)  # the control shares nothing
        assert ours["hit_rate"] <= ours["optimal_hit_rate"] + 0.01, (name, ours)  # arrival order can differ a little
        # the engine's own counters agree with what the recorder saw
        counters = w["systems"]["radixlm"]["throughput"]["counters"]
        assert counters["cached_tokens_total"] == ours["cached_tokens"], name
        assert counters["prompt_tokens_total"] == ours["prompt_tokens"], name
        assert w["systems"]["no_radix_cache"]["cache"]["hit_rate"] == 0, name


def test_batch_counts_agree_with_the_engine(results):
    for name, w in results["workloads"].items():
        for system in SYSTEMS:
            t = w["systems"][system]["throughput"]
            flight = t["in_flight"]
            # every program is in flight at once, and no more requests than the run sent
            assert 1 <= flight["peak"] <= t["requests"], (name, system, flight)
            assert 0 < flight["mean"] <= flight["peak"], (name, system, flight)
            if system == "hf_transformers":
                continue
            f, limit = t["forwards"], results["engines"][system]["max_running_requests"]
            # a request decoding in the engine is inside its generate call: in flight at the interface
            assert f["peak_decode_batch"] <= min(flight["peak"], limit), (name, system, f)
            # every decode row samples one token; extend steps sample the rest
            assert f["decode_rows"] <= t["counters"]["generated_tokens_total"], (name, system, f)
            assert f["prefill_tokens"] == t["counters"]["prefill_tokens_total"], (name, system, f)
            if f["decode_steps"]:
                assert f["mean_decode_batch"] == pytest.approx(f["decode_rows"] / f["decode_steps"])


def test_profile_sees_the_requests_the_engine_saw(results):
    # The model-free profile runs the first min(8, n) instances together: a run of those n instances
    # sends the same requests per instance, plus run_batch's one prefix hint.
    for name, w in results["workloads"].items():
        if name == "dspy_rag":  # DSPy's adapter cannot parse the stand-in's empty replies
            assert name not in results["profiles"]
            continue
        p, t = results["profiles"][name], w["systems"]["radixlm"]["throughput"]
        # The profile's per-instance count holds 1/k of the hint (k = min(8, n) instances profiled).
        hint = max(1.0, t["instances"] / min(8, t["instances"]))
        assert abs(p["requests"] * t["instances"] - t["requests"]) <= hint, (name, p, t["requests"])
        assert p["in_flight"] >= 1, (name, p)
    assert results["profiles"]["hellaswag"]["in_flight"] == 4  # select scores its 4 endings in one call


def test_time_limit_skips_and_estimate_without_a_gpu(tmp_path):
    """The 8B preset on the CPU: the profiles and the estimate are made, then every measurement is past
    the limit, so no engine starts and the results file still says what was skipped."""
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "bench_workloads.py"), "--model", "llama3-8b-shape",
                           "--cpu", "--workloads", "mmlu", "hellaswag", "--time-limit-s", "0", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["engines"] == {}
    for name in ("mmlu", "hellaswag"):
        systems = r["workloads"][name]["systems"]
        assert systems["radixlm"]["throughput"] == {"skipped": "time limit"}
        assert systems["hf_transformers"]["latency"]["skipped"].startswith("not asked")  # off in this preset
        cells = r["estimate"]["cells"][name]
        assert set(cells) == set(SYSTEMS)
        assert all(v > 0 for c in cells.values() for v in c.values())
    # prefix sharing: without the cache the engine computes more
    mmlu = r["estimate"]["cells"]["mmlu"]
    assert mmlu["no_radix_cache"]["throughput"] > mmlu["radixlm"]["throughput"]
    assert r["estimate"]["total_s"] > sum(step["seconds"] for step in r["estimate"]["steps"])
    assert "estimate, in run order: radixlm" in proc.stdout


def test_bookkeeping_time_is_measured(results):
    for name, w in results["workloads"].items():
        for system in RADIXLM_SYSTEMS:
            assert w["systems"][system]["throughput"]["counters"]["radix_cache_time_s"] > 0, (name, system)
    b = results["bookkeeping"]
    assert 0 < b["radix_cache_time_s"] < b["control_seconds"]
    assert b["fraction"] < 0.05  # a loose bound: the tiny CPU run is noisy; docs/benchmarks.md has numbers


def _brute_force_cached(requests) -> int:
    """For each request, the longest prefix it shares with any earlier request's computed tokens."""
    total = 0
    for i, r in enumerate(requests):
        reusable = len(r.input_ids) - 1
        if r.logprob_start_len is not None:
            reusable = min(reusable, max(r.logprob_start_len - 1, 0))
        best = 0
        for earlier in requests[:i]:
            computed = earlier.input_ids + earlier.output_ids[:-1]
            n = 0
            while n < min(reusable, len(computed)) and computed[n] == r.input_ids[n]:
                n += 1
            best = max(best, n)
        total += best
    return total


def test_optimal_replay_matches_brute_force():
    recorder = _recorder()
    rng = random.Random(7)
    for _ in range(200):
        requests = []
        for _ in range(rng.randint(1, 8)):
            base = rng.choice([r.input_ids + r.output_ids for r in requests]) if requests and rng.random() < 0.7 else []
            ids = base[: rng.randint(0, len(base))] + [rng.randrange(4) for _ in range(rng.randint(1, 6))]
            out = [rng.randrange(4) for _ in range(rng.randint(0, 4))]
            start = rng.choice([None, None, rng.randint(0, len(ids))])
            requests.append(recorder.Request(ids, out, start, 0))
        assert recorder.optimal_cached_tokens(requests) == _brute_force_cached(requests)
