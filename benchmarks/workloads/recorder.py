"""Records what a run sends to an engine, and the cache hit rate the run could have had at best.

`RecordingEngine` wraps an Engine (or an engine-shaped peer) and keeps every generate call with its
outputs, in arrival order, and counts the requests in flight (inside a generate call: a call with a
list of prompts counts one per prompt): the peak, and the time-weighted mean.

`optimal_hit_rate` replays the recorded requests through a plain trie, written here independently
of the radix cache: with unlimited memory and every shared prefix computed exactly once, a request
can reuse the longest prefix of its prompt that an earlier request computed (its prompt and all but
its last generated token, whose KV is never computed). As in the engine, the last
prompt token is always computed (its logits give the first output token), and so is every prompt
position whose logprob was asked for (select scores choices from them).
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass
from typing import Any


@dataclass
class Request:
    input_ids: list[int]
    output_ids: list[int]
    logprob_start_len: int | None  # first prompt position whose logprob was returned, if any
    cached_tokens: int  # what the engine reported


class RecordingEngine:
    """An engine-shaped wrapper that records generate calls; everything else goes to the engine."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._order = itertools.count()
        self._lock = threading.Lock()
        self._calls: list[tuple[int, dict[str, Any], Any]] = []
        self._in_flight = 0
        self._peak = 0
        self._area = 0.0  # integral of the in-flight count over time, since the last take
        self._since = self._changed = time.perf_counter()

    def generate(self, prompt: Any = None, sampling_params: Any = None, input_ids: Any = None,
                 return_logprob: bool = False, logprob_start_len: int | None = None, **kwargs: Any) -> Any:
        order = next(self._order)  # arrival order (itertools.count is atomic under the GIL)
        if prompt is not None:
            count = len(prompt) if isinstance(prompt, list) else 1
        else:
            count = len(input_ids) if input_ids and isinstance(input_ids[0], list) else 1
        self._add_in_flight(count)
        try:
            out = self._engine.generate(prompt=prompt, sampling_params=sampling_params, input_ids=input_ids,
                                        return_logprob=return_logprob, logprob_start_len=logprob_start_len, **kwargs)
        finally:
            self._add_in_flight(-count)
        call = {"prompt": prompt, "input_ids": input_ids,
                "logprob_start_len": (logprob_start_len or 0) if return_logprob else None}
        with self._lock:
            self._calls.append((order, call, out))
        return out

    def _add_in_flight(self, delta: int) -> None:
        with self._lock:
            now = time.perf_counter()
            self._area += self._in_flight * (now - self._changed)
            self._changed = now
            self._in_flight += delta
            self._peak = max(self._peak, self._in_flight)

    def take_in_flight(self) -> dict[str, float]:
        """Requests in flight since the last take: the peak, and the mean over the time since then."""
        with self._lock:
            now = time.perf_counter()
            area = self._area + self._in_flight * (now - self._changed)
            out = {"peak": self._peak, "mean": area / (now - self._since) if now > self._since else 0.0}
            self._peak, self._area, self._since, self._changed = self._in_flight, 0.0, now, now
        return out

    def take_requests(self) -> list[Request]:
        """The requests recorded since the last take, in arrival order (tokenized here, after the run,
        exactly as the engine tokenizes a text prompt)."""
        with self._lock:
            calls, self._calls = sorted(self._calls, key=lambda c: c[0]), []
        requests = []
        for _, call, out in calls:
            if call["prompt"] is not None:
                prompts = [call["prompt"]] if isinstance(call["prompt"], str) else call["prompt"]
                id_lists = [self._engine.tokenizer(p)["input_ids"] for p in prompts]
            else:
                ids = call["input_ids"]
                id_lists = [ids] if ids and isinstance(ids[0], int) else ids
            outs = out if isinstance(out, list) else [out]
            assert len(outs) == len(id_lists), "n > 1 is not recorded"
            for ids, o in zip(id_lists, outs):
                requests.append(Request(list(ids), list(o["output_ids"]), call["logprob_start_len"],
                                        o["meta_info"]["cached_tokens"]))
        return requests

    def take_counts(self) -> dict[str, int]:
        """What take_requests would count (requests, prompt, output and cached tokens), from the replies
        alone: no token ids, so nothing to tokenize again."""
        with self._lock:
            calls, self._calls = self._calls, []
        outs = [o for _, _, out in calls for o in (out if isinstance(out, list) else [out])]
        return {"requests": len(outs), "prompt_tokens": sum(o["meta_info"]["prompt_tokens"] for o in outs),
                "output_tokens": sum(len(o["output_ids"]) for o in outs),
                "cached_tokens": sum(o["meta_info"]["cached_tokens"] for o in outs)}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def optimal_cached_tokens(requests: list[Request]) -> int:
    """Prompt tokens that an ideal cache would serve, replaying the requests in arrival order."""
    root: dict[int, dict] = {}
    total = 0
    for r in requests:
        reusable = len(r.input_ids) - 1
        if r.logprob_start_len is not None:
            reusable = min(reusable, max(r.logprob_start_len - 1, 0))
        node, matched = root, 0
        for token in r.input_ids[:reusable]:
            node = node.get(token)
            if node is None:
                break
            matched += 1
        total += matched
        node = root
        for token in r.input_ids + r.output_ids[:-1]:
            node = node.setdefault(token, {})
    return total


def hit_rates(requests: list[Request]) -> dict[str, Any]:
    """Achieved (what the engine reported) and optimal cache hit rates over the recorded requests."""
    prompt = sum(len(r.input_ids) for r in requests)
    achieved = sum(r.cached_tokens for r in requests)
    optimal = optimal_cached_tokens(requests)
    return {"requests": len(requests), "prompt_tokens": prompt, "cached_tokens": achieved,
            "optimal_cached_tokens": optimal,
            "hit_rate": achieved / prompt if prompt else 0.0,
            "optimal_hit_rate": optimal / prompt if prompt else 0.0,
            "of_optimal": achieved / optimal if optimal else None}
