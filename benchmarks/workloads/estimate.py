"""Before any device time: what each workload will send, and about how long each measurement will take.

`profile_workload` runs a workload's first k/2 and first k instances together (k = min(8, instances)),
then its first alone, on `NullEngine`: an engine-shaped stand-in that answers every call with max_new_tokens placeholder
tokens that decode to no text (as the random 8B model's tokens mostly do with the small tokenizer),
after sleeping one time unit per call plus one per generated token, so that calls overlap as on an
engine and one instance's wall time counts the steps on its critical path. From the recorded
requests: per instance, the requests, prompt tokens, generated tokens, the tokens an ideal cache
still computes, and the peak number of requests in flight.

`estimate_seconds` turns a profile into seconds for n instances on one system with a simple model
of the device (`DeviceCost`): prefill at a fixed cost per computed token; decode steps of
min(in flight, max_running_requests) rows, each costing a fixed part, a part per row, and the KV
reads of the rows' contexts; a host cost per request; the benchmark's own bookkeeping per prompt
token. The HF peer: its prefill rate, and a decode step per step of the critical path for each
wave of at most hf_max_batch rows. It is a sizing aid, printed at the start of a run and kept
beside each measurement, not a measurement.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from .common import TokenizerEncoding, Workload, generate_inputs
from .recorder import RecordingEngine, optimal_cached_tokens

UNIT_S = 0.003  # NullEngine's time unit: one per call and one per generated token


@dataclass(frozen=True)
class DeviceCost:
    prefill_s_per_token: float
    decode_step_s: float  # a decode step's fixed part (weights read, launches, host)
    decode_s_per_row: float
    kv_s_per_token: float  # reading one context token's KV in a decode step
    host_s_per_request: float
    run_s: float  # a throughput run's fixed part (threads, the run_batch prefix hint, the first steps)
    hf_prefill_s_per_token: float
    hf_step_s: float
    hf_kv_s_per_token: float
    record_s_per_token: float  # radixlm's runs: re-tokenizing the prompts and the optimal replay
    unprofiled_s: float  # a measurement of a workload without a profile
    first_engine_start_s: float  # weights, KV pool, CUDA graphs, first kernel compilations
    engine_start_s: float  # each engine after the first
    max_running: int = 256  # the run's max_running_requests and hf_max_batch (bench_workloads sets them)
    hf_max_batch: int = 64


@dataclass(frozen=True)
class Profile:
    requests: float  # per instance
    prompt_tokens: float  # per instance
    output_tokens: float  # per instance
    computed_first: float  # tokens an ideal cache computes for the first instance
    computed_next: float  # ... for each further instance
    in_flight: float  # peak requests in flight, per instance
    depth: float  # steps on one instance's critical path


class NullEngine(TokenizerEncoding):
    """The part of an engine's interface the workloads use, answering without a model."""

    served_model_name = "null"

    def __init__(self, tokenizer: Any, unit_s: float = UNIT_S) -> None:
        self.tokenizer = tokenizer
        self.unit_s = unit_s
        self.filler = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def generate(self, prompt: Any = None, sampling_params: Any = None, input_ids: Any = None,
                 return_logprob: bool = False, logprob_start_len: int | None = None, **kwargs: Any) -> Any:
        single, id_lists, params = generate_inputs(self.tokenizer, prompt, input_ids, sampling_params)
        outs = []
        for ids, p in zip(id_lists, params):
            n = p.get("max_new_tokens", 128)
            meta = {"prompt_tokens": len(ids), "completion_tokens": n, "cached_tokens": 0,
                    "finish_reason": {"type": "length", "matched": None}}
            if return_logprob:
                start = logprob_start_len or 0
                meta["input_token_logprobs"] = ([(None, ids[0], None)] if start == 0 else []) + [
                    (0.0, t, None) for t in ids[max(start, 1):]]
                meta["output_token_logprobs"] = []
            outs.append({"text": "", "output_ids": [self.filler] * n, "meta_info": meta})
        time.sleep(self.unit_s * (1 + max(len(o["output_ids"]) for o in outs)))
        return outs[0] if single else outs

    def flush_cache(self) -> bool:
        return True

    def get_stats(self) -> dict[str, Any]:
        return {}


def profile_workload(workload: Workload, batch: list[dict[str, Any]], tokenizer: Any) -> Profile:
    """The workload's shape: its first k/2 and first k instances together, k = min(8, instances)
    (per-instance averages; the tokens an ideal cache computes for each further instance, past the
    prefixes shared by a few groups such as MMLU's subjects), then its first alone (the critical path,
    the requests in flight)."""
    engine = NullEngine(tokenizer, unit_s=0.0)
    backend = RecordingEngine(engine)
    k = min(8, len(batch))
    runs = {}
    for n in sorted({max(k // 2, 1), k}):
        workload.run_batch(backend, batch[:n])
        runs[n] = backend.take_requests()
    walls = []
    for unit in (0.0, UNIT_S):  # without sleeps first: the interpreter's own time, subtracted
        engine.unit_s = unit
        backend.take_in_flight()
        start = time.perf_counter()
        workload.run_one(backend, batch[0])
        walls.append(time.perf_counter() - start)
    peak = backend.take_in_flight()["peak"]
    backend.take_counts()

    def computed(requests: list[Any]) -> int:
        return sum(len(r.input_ids) for r in requests) - optimal_cached_tokens(requests)

    half, full = min(runs), max(runs)
    per_next = max(computed(runs[full]) - computed(runs[half]), 0) / (full - half) if full > half else 0.0
    return Profile(requests=len(runs[full]) / full, prompt_tokens=sum(len(r.input_ids) for r in runs[full]) / full,
                   output_tokens=sum(len(r.output_ids) for r in runs[full]) / full,
                   computed_first=max(computed(runs[full]) - (full - 1) * per_next, 0), computed_next=per_next,
                   in_flight=peak, depth=max(walls[1] - walls[0], 0) / UNIT_S)


def estimate_seconds(p: Profile, n: int, system: str, cost: DeviceCost) -> dict[str, float]:
    """Throughput-run and latency-run seconds for n instances of the profiled workload on `system`."""
    record = n * p.prompt_tokens * cost.record_s_per_token if system == "radixlm" else 0.0
    if system == "hf_transformers":
        return {"throughput": _hf_seconds(p, n, cost) + record, "latency": _hf_seconds(p, 1, cost)}
    return {"throughput": _engine_seconds(p, n, system, cost) + record, "latency": _engine_seconds(p, 1, system, cost)}


def _engine_seconds(p: Profile, n: int, system: str, cost: DeviceCost) -> float:
    prefill = n * p.prompt_tokens
    if system != "no_radix_cache":
        prefill = min(prefill, p.computed_first + (n - 1) * p.computed_next)
    rows = min(max(n * p.in_flight, 1), cost.max_running)
    context = p.prompt_tokens / max(p.requests, 1)
    steps = max(p.depth, n * p.output_tokens / rows)
    step_s = cost.decode_step_s + rows * (cost.decode_s_per_row + context * cost.kv_s_per_token)
    return (prefill * cost.prefill_s_per_token + steps * step_s + n * p.requests * cost.host_s_per_request
            + (cost.run_s if n > 1 else 0.0))


def _hf_seconds(p: Profile, n: int, cost: DeviceCost) -> float:
    in_flight = max(n * p.in_flight, 1)
    rows = min(in_flight, cost.hf_max_batch)
    context = p.prompt_tokens / max(p.requests, 1)
    steps = p.depth * math.ceil(in_flight / cost.hf_max_batch)
    return (n * p.prompt_tokens * cost.hf_prefill_s_per_token
            + steps * (cost.hf_step_s + rows * context * cost.hf_kv_s_per_token))
