"""/metrics parsed by prometheus_client's own parser, the access log, the --log-requests summary and the
interval load line, against the real app."""

from __future__ import annotations

import logging
import time

import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from radixlm.server.app import create_app
from radixlm.server.args import ServerArgs
from server_harness import shared_server, wait_idle

# Every series the issue asks for, by family name (prometheus_client drops a counter's _total suffix).
SERIES = {
    "radixlm:prompt_tokens": "counter", "radixlm:generation_tokens": "counter", "radixlm:cached_tokens": "counter",
    "radixlm:num_requests": "counter", "radixlm:num_aborted_requests": "counter",
    "radixlm:request_success": "counter", "radixlm:http_requests": "counter",
    "radixlm:num_retracted_requests": "counter", "radixlm:cache_aware_admissions": "counter",
    "radixlm:time_to_first_token_seconds": "histogram", "radixlm:inter_token_latency_seconds": "histogram",
    "radixlm:time_per_output_token_seconds": "histogram", "radixlm:e2e_request_latency_seconds": "histogram",
    "radixlm:queue_time_seconds": "histogram", "radixlm:prompt_tokens_histogram": "histogram",
    "radixlm:generation_tokens_histogram": "histogram",
    "radixlm:num_running_reqs": "gauge", "radixlm:num_queue_reqs": "gauge", "radixlm:num_used_tokens": "gauge",
    "radixlm:token_usage": "gauge", "radixlm:max_total_num_tokens": "gauge", "radixlm:cache_hit_rate": "gauge",
    "radixlm:gen_throughput": "gauge", "radixlm:num_cached_tokens": "gauge",
    "radixlm:gc_collections": "counter", "radixlm:gc_pause_seconds": "counter",
}


@pytest.fixture(scope="module")
def live(llama_ckpt):
    return shared_server(llama_ckpt)


def scrape(url: str) -> dict[str, dict]:
    """{family name: {"type": ..., "samples": {(sample name, sorted labels): value}}}."""
    import httpx

    r = httpx.get(url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {f.name: {"type": f.type, "samples": {(s.name, tuple(sorted(s.labels.items()))): s.value
                                                 for s in f.samples}}
            for f in text_string_to_metric_families(r.text)}


def value(families: dict, sample: str, **labels: str) -> float:
    family = families[max((name for name in families if sample.startswith(name)), key=len)]
    return family["samples"].get((sample, tuple(sorted(labels.items()))), 0.0)


def test_metrics_series_and_values(live):
    model = {"model_name": live.model}
    before = scrape(live.url)
    client = OpenAI(base_url=live.url + "/v1", api_key="x")
    client.completions.create(model=live.model, prompt="count me", max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})  # not streamed: TTFT recorded all the same
    chunks = list(client.chat.completions.create(model=live.model, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=6, temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True}))
    assert chunks
    wait_idle(live)
    after = scrape(live.url)
    for name, kind in SERIES.items():
        assert after.get(name, {}).get("type") == kind, name
        assert all(dict(labels).get("model_name") == live.model for _, labels in after[name]["samples"]), name

    def delta(sample: str, **labels: str) -> float:
        return value(after, sample, **model, **labels) - value(before, sample, **model, **labels)

    assert delta("radixlm:num_requests_total") == 2
    assert delta("radixlm:generation_tokens_total") == 11
    assert delta("radixlm:request_success_total", finished_reason="length") == 2
    assert delta("radixlm:time_to_first_token_seconds_count") == 2  # both, the non-streamed one included
    assert delta("radixlm:e2e_request_latency_seconds_count") == 2
    assert delta("radixlm:queue_time_seconds_count") == 2
    assert delta("radixlm:time_per_output_token_seconds_count") == 2
    assert delta("radixlm:generation_tokens_histogram_sum") == 11
    # One observation per streamed chunk with tokens after the stream's first; a consumer that fell behind
    # takes the chunks queued meanwhile as one (frontend._stream_async), so count the chunks the client got.
    with_text = sum(1 for c in chunks if c.choices and c.choices[0].delta.content)
    assert delta("radixlm:inter_token_latency_seconds_count") >= with_text - 1
    assert delta("radixlm:http_requests_total", endpoint="/v1/completions", status="200") == 1
    ttft_sum = delta("radixlm:time_to_first_token_seconds_sum")
    e2e_sum = delta("radixlm:e2e_request_latency_seconds_sum")
    assert 0 < ttft_sum <= e2e_sum
    stats = live.engine.get_stats()
    assert value(after, "radixlm:max_total_num_tokens", **model) == stats["kv_slots_total"]
    assert value(after, "radixlm:num_running_reqs", **model) == 0
    assert value(after, "radixlm:cache_hit_rate", **model) == pytest.approx(stats["cache_hit_rate"])
    assert value(after, "radixlm:cache_aware_admissions_total", **model) == stats["cache_aware_admissions_total"]
    # The engine's start collected before freezing its heap: one full collection at least, with its seconds.
    assert value(after, "radixlm:gc_collections_total", **model, generation="2") >= 1
    assert value(after, "radixlm:gc_pause_seconds_total", **model, generation="2") > 0


def test_access_request_and_load_logs(live, caplog):
    app = create_app(live.engine, ServerArgs(log_requests=True, log_interval=0.05))
    caplog.set_level(logging.INFO, logger="radixlm.server")
    with TestClient(app) as client:
        r = client.post("/generate", json={"text": "log me", "sampling_params": {
            "max_new_tokens": 64, "temperature": 0, "ignore_eos": True}})
        assert r.status_code == 200
        rid = r.json()["meta_info"]["id"]
        deadline = time.monotonic() + 5
        while not any(m.startswith("load:") for m in caplog.messages) and time.monotonic() < deadline:
            time.sleep(0.05)
    messages = caplog.messages
    assert any('"POST /generate" 200' in m for m in messages), messages
    summary = next(m for m in messages if m.startswith(f"request {rid}:"))
    assert "completion 64 tokens" in summary and "finish length" in summary and "ttft 0." in summary
    load = next(m for m in messages if m.startswith("load:"))
    for part in ("#running-req", "#queue-req", "#token", "cache hit rate", "gen throughput"):
        assert part in load
