"""Prometheus text-format metrics: request and token counters, latency histograms, and the engine's
gauges (cache hit rate, queue lengths, KV slots) read fresh at scrape time."""

from __future__ import annotations

import bisect
import math
import threading
from collections import defaultdict
from typing import Any

_PREFIX = "radixlm_"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

# Engine stats exported as gauges: stats key -> (metric name, help).
_ENGINE_GAUGES = {
    "cache_hit_rate": ("cache_hit_rate", "Fraction of prompt tokens served from the radix cache."),
    "running": ("num_running_reqs", "Requests in the running batch."),
    "waiting": ("num_queue_reqs", "Requests waiting in the scheduler queue."),
    "kv_slots_total": ("kv_slots_total", "KV cache slots in the pool."),
    "kv_slots_free": ("kv_slots_free", "KV cache slots that are free."),
    "kv_slots_cached": ("kv_slots_cached", "KV cache slots held by the radix cache."),
}


# Engine counters exported as counters: stats key -> (metric name, help). The engine counts every abort
# (a disconnect aborts the request the client left), which the HTTP side alone cannot see.
_ENGINE_COUNTERS = {
    "aborted_total": ("aborted_requests_total",
                      "Requests that finished by abort (disconnects, abort_request, shutdown, failures)."),
    "retractions_total": ("retractions_total", "Running requests retracted to free KV memory (resumed later)."),
}


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = _LATENCY_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.counts):
            self.counts[i] += 1
        self.total += 1
        self.sum += value

    def lines(self, name: str) -> list[str]:
        out, cumulative = [], 0
        for bound, count in zip(self.buckets, self.counts):
            cumulative += count
            out.append(f'{name}_bucket{{le="{bound}"}} {cumulative}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.total}')
        out.append(f"{name}_sum {self.sum}")
        out.append(f"{name}_count {self.total}")
        return out


class Metrics:
    """Counters updated by the request handlers; rendered with the engine's gauges on scrape."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = defaultdict(int)  # (endpoint, status) -> count
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.cached_tokens = 0
        self.e2e_latency = Histogram()
        self.time_to_first_token = Histogram()

    def count_request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, status)] += 1

    def record_output(self, meta_info: dict[str, Any], count_prompt: bool = True) -> None:
        """Token counts of one finished output (its prompt counted once, even for n branches)."""
        with self._lock:
            if count_prompt:
                self.prompt_tokens += meta_info.get("prompt_tokens", 0)
                self.cached_tokens += meta_info.get("cached_tokens", 0)
            self.generation_tokens += meta_info.get("completion_tokens", 0)

    def observe_latency(self, e2e: float, ttft: float | None) -> None:
        with self._lock:
            self.e2e_latency.observe(e2e)
            if ttft is not None:
                self.time_to_first_token.observe(ttft)

    def render(self, engine_stats: dict[str, Any], inflight: int) -> str:
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[str]) -> None:
            lines.append(f"# HELP {_PREFIX}{name} {help_text}")
            lines.append(f"# TYPE {_PREFIX}{name} {kind}")
            lines.extend(f"{_PREFIX}{s}" for s in samples)

        with self._lock:
            metric("requests_total", "counter", "Generation requests by endpoint and HTTP status.",
                   [f'requests_total{{endpoint="{e}",status="{s}"}} {n}'
                    for (e, s), n in sorted(self.requests.items())])
            metric("prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
                   [f"prompt_tokens_total {self.prompt_tokens}"])
            metric("generation_tokens_total", "counter", "Generated tokens of finished requests.",
                   [f"generation_tokens_total {self.generation_tokens}"])
            metric("cached_tokens_total", "counter", "Prompt tokens served from the radix cache.",
                   [f"cached_tokens_total {self.cached_tokens}"])
            metric("e2e_request_latency_seconds", "histogram", "Time from arrival to the last token.",
                   self.e2e_latency.lines("e2e_request_latency_seconds"))
            metric("time_to_first_token_seconds", "histogram", "Time from arrival to the first streamed token.",
                   self.time_to_first_token.lines("time_to_first_token_seconds"))
        for key, (name, help_text) in _ENGINE_COUNTERS.items():
            value = engine_stats.get(key)
            if isinstance(value, int):
                metric(name, "counter", help_text, [f"{name} {value}"])
        metric("inflight_requests", "gauge", "HTTP generation requests admitted and not finished.",
               [f"inflight_requests {inflight}"])
        for key, (name, help_text) in _ENGINE_GAUGES.items():
            value = engine_stats.get(key)
            if isinstance(value, (int, float)) and not math.isnan(value):
                metric(name, "gauge", help_text, [f"{name} {value}"])
        return "\n".join(lines) + "\n"
