"""Counters a user can read: cache hit rate, tokens, latencies, radix cache bookkeeping time."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from radixlm.core.runtime.memory.radix_cache import RadixCache
    from radixlm.core.runtime.request import Req


@dataclass
class EngineStats:
    requests_total: int = 0
    finished_total: int = 0
    aborted_total: int = 0
    prompt_tokens_total: int = 0  # prompt tokens of requests when first scheduled
    cached_tokens_total: int = 0  # of those, tokens served from the radix cache
    prefill_tokens_total: int = 0  # tokens actually computed by prefill steps (incl. recomputation)
    generated_tokens_total: int = 0
    retractions_total: int = 0
    cache_aware_admissions_total: int = 0  # admission steps that lpm/dfs-weight ordered (past the pressure gate)
    # Speculative decoding: verify steps run, request drafts they checked, draft tokens and accepted ones.
    spec_verify_steps_total: int = 0
    spec_verifies_total: int = 0
    spec_draft_tokens_total: int = 0
    spec_accepted_tokens_total: int = 0
    radix_cache_time_s: float = 0.0  # scheduler time in radix cache match/insert/evict/lock calls
    e2e_latency_sum: float = 0.0
    ttft_sum: float = 0.0
    started: float = field(default_factory=time.monotonic)

    def record_finish(self, req: "Req") -> None:
        self.finished_total += 1
        if req.finish_type == "abort":
            self.aborted_total += 1
        now = time.monotonic()
        self.e2e_latency_sum += now - req.created
        if req.first_token_time is not None:
            self.ttft_sum += req.first_token_time - req.created

    def record_verify(self, drafted: int, accepted: int) -> None:
        self.spec_verifies_total += 1
        self.spec_draft_tokens_total += drafted
        self.spec_accepted_tokens_total += accepted

    def snapshot(self, **gauges: Any) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "started"}
        # Tokens a request gains per verified draft: the accepted draft tokens plus the target's own.
        out["spec_accept_length"] = (1.0 + self.spec_accepted_tokens_total / self.spec_verifies_total
                                     if self.spec_verifies_total else 0.0)
        out["cache_hit_rate"] = self.cached_tokens_total / self.prompt_tokens_total if self.prompt_tokens_total else 0.0
        out["uptime_s"] = time.monotonic() - self.started
        out.update(gauges)
        return out


class TimedRadixCache:
    """The scheduler's view of a RadixCache: its bookkeeping calls (match, insert, evict, lock and
    unlock, caching a request's tokens) add their wall time to `stats.radix_cache_time_s`; everything
    else passes through. Calls the tree makes to itself are not counted twice."""

    _TIMED = ("match_prefix", "insert", "evict", "inc_lock_ref", "dec_lock_ref", "cache_finished",
              "cache_unfinished", "load_prefix")

    def __init__(self, tree: "RadixCache", stats: EngineStats) -> None:
        self._tree = tree
        self._stats = stats
        for name in self._TIMED:  # bound once here: a timed call costs two clock reads, no lookup
            setattr(self, name, self._timed(getattr(tree, name)))

    def _timed(self, method: Callable[..., Any]) -> Callable[..., Any]:
        stats, clock = self._stats, time.perf_counter

        def call(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return method(*args, **kwargs)
            finally:
                stats.radix_cache_time_s += clock() - start

        return call

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tree, name)
