"""The router's /metrics in Prometheus' text format (prometheus_client, the app's own registry): per
replica its health, requests in flight and routed, times taken out; for the router the share of requests
routed to a replica believed to hold part of their prompt, failovers and requests with no replica left.
The replicas' own /metrics (cache hit rate, latencies) are scraped from the replicas."""

from __future__ import annotations

from typing import Any, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from radixlm.server.router.proxy import RouterStats
from radixlm.server.router.replicas import ReplicaSet

PREFIX = "radixlm:router_"


class _Collector:
    def __init__(self, replicas: ReplicaSet, policy: Any, stats: RouterStats) -> None:
        self.replicas, self.policy, self.stats = replicas, policy, stats

    def collect(self) -> Iterator[Metric]:
        per_replica = [
            (GaugeMetricFamily, "replica_healthy", "1 while the replica is routed to", lambda r: int(r.healthy)),
            (GaugeMetricFamily, "replica_in_flight", "requests the router has in flight on the replica",
             lambda r: self.policy.loads.get(r.url, 0)),
            (GaugeMetricFamily, "replica_kv_capacity_tokens", "the replica's KV pool, as it reported it",
             lambda r: r.capacity),
            (CounterMetricFamily, "replica_requests", "requests routed to the replica", lambda r: r.requests_total),
            (CounterMetricFamily, "replica_failures", "times the replica was taken out of routing",
             lambda r: r.failures_total),
        ]
        for family, name, doc, value in per_replica:
            metric = family(PREFIX + name, doc, labels=["replica"])
            for replica in self.replicas.replicas.values():
                metric.add_metric([replica.url], value(replica))
            yield metric
        s = self.stats
        counters = [
            ("requests", "routing decisions (a failover makes another)", s.requests_total),
            ("prefix_routed_requests", "of them, sent to a replica believed to hold part of the prompt",
             s.prefix_routed_total),
            ("key_tokens", "prompt tokens routed (UTF-8 bytes where the router has no tokenizer)", s.key_tokens_total),
            ("matched_tokens", "of them, in the chosen replica's prefix as the router's tree holds it",
             s.matched_tokens_total),
            ("failovers", "requests sent again to another replica after theirs failed before answering",
             s.failovers_total),
            ("no_replica", "requests answered 503: no healthy replica left", s.no_replica_total),
            ("broken_streams", "streams cut by a replica lost after their first chunk", s.broken_streams_total),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(PREFIX + name, doc, value=value)
        share = s.prefix_routed_total / s.requests_total if s.requests_total else 0.0
        yield GaugeMetricFamily(PREFIX + "prefix_routed_share", "prefix_routed_requests / requests", value=share)


def router_registry(replicas: ReplicaSet, policy: Any, stats: RouterStats) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(replicas, policy, stats))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
