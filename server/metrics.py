"""Prometheus metrics through `prometheus_client`, named as SGLang's (`sglang:X` is `radixlm:X`) where
SGLang has the series and as vLLM's otherwise; every series carries a `model_name` label.

Per-request series (token counts, latencies, finishes) are recorded from each finished output's
meta_info by the server; engine series (queue lengths, KV usage, cache hit rate, aborts, retractions,
throughput) are read from the engine's stats at scrape time. Everything lives in the server process,
in the app's own registry (so that several apps in one process do not collide); when the scheduler
moves to its own process its stats still arrive through get_stats, so no multiprocess mode is needed.
"""

from __future__ import annotations

import time
from typing import Any, Iterator

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

PREFIX = "radixlm:"
CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST
# Each counter's *_created series doubles the output for nothing a dashboard uses.
prometheus_client.disable_created_metrics()

# Bucket bounds as SGLang's defaults, so dashboards and quantiles line up.
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
_E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400)
_ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06, 0.08, 0.1,
                0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8)
_QUEUE_BUCKETS = (0.0, 0.01, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


class Throughput:
    """Generated tokens per second between two readings of the engine's counter."""

    def __init__(self) -> None:
        self._last: tuple[float, int] | None = None

    def update(self, generated_tokens_total: int) -> float:
        now = time.monotonic()
        last, self._last = self._last, (now, generated_tokens_total)
        if last is None or now <= last[0]:
            return 0.0
        return (generated_tokens_total - last[1]) / (now - last[0])


def kv_tokens_used(stats: dict[str, Any]) -> int:
    """KV slots held by running requests (and the cached prefixes they lock)."""
    return stats["kv_slots_total"] - stats["kv_slots_free"] - stats.get("kv_slots_cached_evictable", 0)


class _EngineCollector:
    """The engine's stats snapshot taken at scrape time, as gauges and counters."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: dict[str, Any] = {}
        self.gen_throughput = 0.0

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        if not s:
            return

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            g.add_metric([self.model_name], value)
            return g

        used, total = kv_tokens_used(s), s["kv_slots_total"]
        yield gauge("num_running_reqs", "The number of running requests.", s["running"])
        yield gauge("num_queue_reqs", "The number of requests in the waiting queue.", s["waiting"])
        yield gauge("num_used_tokens", "KV cache tokens held by running requests.", used)
        yield gauge("max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.", total)
        yield gauge("token_usage", "Fraction of the KV cache pool held by running requests.",
                    used / total if total else 0.0)
        yield gauge("num_cached_tokens", "KV cache tokens held by the radix cache.", s["kv_slots_cached"])
        yield gauge("cache_hit_rate", "The prefix cache hit rate (cached / prompt tokens, since start).",
                    s["cache_hit_rate"])
        yield gauge("gen_throughput", "The generation throughput (token/s) since the previous scrape.",
                    self.gen_throughput)
        # Counted by the engine: it sees every abort, disconnects included, which the HTTP side cannot.
        for name, doc, key in (("num_retracted_requests", "Total number of retracted requests.", "retractions_total"),
                               ("num_aborted_requests", "Number of requests aborted (disconnects, abort_request, "
                                                        "shutdown).", "aborted_total"),
                               ("cache_aware_admissions", "Admission steps ordered by the cache-aware policy (lpm or "
                                "dfs-weight, past the memory-pressure gate).", "cache_aware_admissions_total")):
            counter = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            counter.add_metric([self.model_name], s[key])
            yield counter
        if s.get("hicache_slots_total"):
            yield from self._host_tier(s, gauge)
        if s.get("spec_algorithm"):
            yield from self._speculative(s)
        if "gc" in s:
            yield from self._gc(s["gc"])

    def _gc(self, gc: dict[str, Any]) -> Iterator[Metric]:
        """The scheduler process's garbage collections (core/runtime/gc_heap.py)."""
        m = self.model_name
        count = CounterMetricFamily(PREFIX + "gc_collections", "Garbage collections of the scheduler's process, by "
                                    "generation (2: full).", labels=["model_name", "generation"])
        pause = CounterMetricFamily(PREFIX + "gc_pause_seconds", "Seconds the scheduler's process stood still in "
                                    "garbage collections, by generation.", labels=["model_name", "generation"])
        for generation, (n, seconds) in enumerate(zip(gc["collections_total"], gc["pause_seconds_total"])):
            count.add_metric([m, str(generation)], n)
            pause.add_metric([m, str(generation)], seconds)
        yield count
        yield pause

    def _speculative(self, s: dict[str, Any]) -> Iterator[Metric]:
        """Speculative decoding's counters, labelled by proposer (speculative_algorithm), when it is on."""
        labels, values = ["model_name", "algorithm"], [self.model_name, s["spec_algorithm"]]
        for name, doc, key in (
                ("spec_verify_steps", "Verify steps run (each checks the drafts of a batch in one forward).",
                 "spec_verify_steps_total"),
                ("spec_verify", "Request drafts checked by verify steps.", "spec_verifies_total"),
                ("spec_draft_tokens", "Draft tokens proposed.", "spec_draft_tokens_total"),
                ("spec_accepted_tokens", "Draft tokens accepted.", "spec_accepted_tokens_total")):
            counter = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            counter.add_metric(values, s[key])
            yield counter
        length = GaugeMetricFamily(PREFIX + "spec_accept_length", "Tokens a request gains per verified draft on "
                                   "average (accepted draft tokens plus the target's own), since start.", labels=labels)
        length.add_metric(values, s["spec_accept_length"])
        yield length

    def _host_tier(self, s: dict[str, Any], gauge: Any) -> Iterator[Metric]:
        """The radix cache's host tier (hicache_size_gb), when it is on."""
        m = self.model_name
        hits = CounterMetricFamily(PREFIX + "cache_hit_tokens", "Prompt tokens served from the radix cache, by "
                                   "the tier they were in (host: loaded back from host memory).",
                                   labels=["model_name", "tier"])
        hits.add_metric([m, "device"], s["hicache_device_hit_tokens_total"])
        hits.add_metric([m, "host"], s["hicache_host_hit_tokens_total"])
        yield hits
        moved = CounterMetricFamily(PREFIX + "hicache_transfer_bytes", "KV bytes copied between the device pool "
                                    "and the host tier.", labels=["model_name", "direction"])
        moved.add_metric([m, "to_host"], s["hicache_bytes_to_host_total"])
        moved.add_metric([m, "to_device"], s["hicache_bytes_to_device_total"])
        yield moved
        wait = CounterMetricFamily(PREFIX + "hicache_load_wait_seconds", "Seconds from issuing each load from "
                                   "host memory until the scheduler saw it land, summed.", labels=["model_name"])
        wait.add_metric([m], s["hicache_load_wait_s"])
        yield wait
        total = s["hicache_slots_total"]
        yield gauge("hicache_max_total_num_tokens", "Token slots of the host tier.", total)
        yield gauge("hicache_num_used_tokens", "Host tier slots holding KV.", total - s["hicache_slots_free"])


class Metrics:
    """The server's registry: request series recorded as outputs finish, engine series read on scrape."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels + list(extra), registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.http_requests = counter("http_requests", "HTTP generation requests by endpoint and status.",
                                     ("endpoint", "status"))
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.").labels(model_name)
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.").labels(
            model_name)
        self.cached_tokens = counter("cached_tokens", "Number of cached prompt tokens.").labels(model_name)
        self.num_requests = counter("num_requests", "Number of requests processed.").labels(model_name)
        self.finished = counter("request_success", "Finished requests by finish reason (vLLM's name).",
                                ("finished_reason",))
        self.ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds (streamed requests, one per chunk).",
                             _ITL_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds",
                              "Histogram of a request's mean time per output token after the first, in seconds.",
                              _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Histogram of end-to-end request latency in seconds.",
                             _E2E_BUCKETS)
        self.queue_time = histogram("queue_time_seconds", "Histogram of queueing time in seconds.", _QUEUE_BUCKETS)
        self.prompt_len = histogram("prompt_tokens_histogram", "Histogram of prompt token length.", _TOKEN_BUCKETS)
        self.generation_len = histogram("generation_tokens_histogram", "Histogram of generation token length.",
                                        _TOKEN_BUCKETS)
        self.engine = _EngineCollector(model_name)
        r.register(self.engine)
        self._throughput = Throughput()

    def count_request(self, endpoint: str, status: int) -> None:
        self.http_requests.labels(self.model_name, endpoint, str(status)).inc()

    def record_output(self, meta: dict[str, Any], count_prompt: bool = True) -> None:
        """One finished engine request (its prompt counted once, even for the n branches of one prompt)."""
        completion = meta.get("completion_tokens", 0)
        if count_prompt:
            self.prompt_tokens.inc(meta.get("prompt_tokens", 0))
            self.cached_tokens.inc(meta.get("cached_tokens", 0))
            self.prompt_len.observe(meta.get("prompt_tokens", 0))
        self.generation_tokens.inc(completion)
        self.generation_len.observe(completion)
        self.num_requests.inc()
        reason = (meta.get("finish_reason") or {}).get("type", "unknown")
        self.finished.labels(self.model_name, reason).inc()
        if "queue_time" in meta:
            self.queue_time.observe(meta["queue_time"])
        ttft, e2e = meta.get("ttft"), meta.get("e2e_latency")
        if ttft is not None:
            self.ttft.observe(ttft)
        if e2e is not None:
            self.e2e.observe(e2e)
        if ttft is not None and e2e is not None and completion > 1:
            self.tpot.observe((e2e - ttft) / (completion - 1))

    def observe_stream_chunk(self, interval: float, new_tokens: int) -> None:
        """A streamed chunk `interval` seconds after the previous one of its request: its tokens' mean gap."""
        if new_tokens > 0:
            self.itl.observe(interval / new_tokens)

    def render(self, engine_stats: dict[str, Any]) -> bytes:
        self.engine.stats = engine_stats
        self.engine.gen_throughput = self._throughput.update(engine_stats["generated_tokens_total"])
        return prometheus_client.generate_latest(self.registry)
