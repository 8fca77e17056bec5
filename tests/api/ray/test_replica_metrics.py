"""The ingress's /metrics over replicas: each replica's real EngineMetrics page, labelled `replica`,
parsed by the strict checker the server's own /metrics passes."""

import prometheus_client
from server_util import metric_value, parse_prometheus

from vllmlite.api.ray.replica_metrics import merge_replica_metrics
from vllmlite.engine.metrics import EngineMetrics


def test_merged_pages_parse_strictly_and_keep_each_replicas_counts():
    pages = [EngineMetrics("m").render() for _ in range(2)]
    registry = prometheus_client.CollectorRegistry()
    counter = prometheus_client.Counter("vllmlite:extra", "An extra counter.", ["model_name"], registry=registry)
    counter.labels("m").inc(3)
    histogram = prometheus_client.Histogram("vllmlite:lat_seconds", "Latency.", registry=registry, buckets=(1, 2))
    histogram.observe(1.5)
    extra_page = prometheus_client.generate_latest(registry).decode()
    pages[1] += extra_page
    merged = merge_replica_metrics([pages[0], None, pages[1]])
    types, samples = parse_prometheus(merged)  # asserts TYPE lines, histogram shape, the final newline
    assert {s.labels["replica"] for s in samples} == {"0", "2"}
    assert metric_value(merged, "vllmlite:extra_total", replica="2") == 3
    assert metric_value(merged, "vllmlite:lat_seconds_count", replica="2") == 1
    assert types["vllmlite:extra_total"] == "counter"
    # Every sample of both pages, none lost or doubled.
    assert len(samples) == 2 * len(parse_prometheus(pages[0])[1]) + len(parse_prometheus(extra_page)[1])


def test_no_pages_is_an_empty_page():
    assert merge_replica_metrics([None, None]) == ""
