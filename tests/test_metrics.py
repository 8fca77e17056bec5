"""Hand-written Prometheus exposition: strict format, vLLM's names, and what each metric counts."""

from __future__ import annotations

import math

import pytest
from server_util import metric_value, parse_prometheus

from vllmlite.metrics import Counter, EngineMetrics, Histogram, format_labels, format_value
from vllmlite.outputs import CompletionOutput, RequestMetrics, RequestOutput
from vllmlite.stats import EngineStats, SchedulerStats

EXPECTED_TYPES = {
    "vllmlite:num_requests_running": "gauge",
    "vllmlite:num_requests_waiting": "gauge",
    "vllmlite:kv_cache_usage_perc": "gauge",
    "vllmlite:prefix_cache_queries_total": "counter",
    "vllmlite:prefix_cache_hits_total": "counter",
    "vllmlite:num_preemptions_total": "counter",
    "vllmlite:prompt_tokens_total": "counter",
    "vllmlite:generation_tokens_total": "counter",
    "vllmlite:request_success_total": "counter",
    "vllmlite:time_to_first_token_seconds": "histogram",
    "vllmlite:inter_token_latency_seconds": "histogram",
    "vllmlite:e2e_request_latency_seconds": "histogram",
    "vllmlite:spec_decode_num_drafts_total": "counter",
    "vllmlite:spec_decode_num_draft_tokens_total": "counter",
    "vllmlite:spec_decode_num_accepted_tokens_total": "counter",
    "vllmlite:spec_decode_num_accepted_tokens_per_pos_total": "counter",
}


def output(request_id: str, new_tokens: list[int], finish_reason=None, error=None, num_prompt=5) -> RequestOutput:
    completion = CompletionOutput(0, "", list(new_tokens), finish_reason=finish_reason, delta_token_ids=new_tokens)
    return RequestOutput(request_id, None, list(range(num_prompt)), [completion], finish_reason is not None,
                         error=error, metrics=RequestMetrics(arrival_time=100.0))


def test_values_and_labels_are_formatted_as_prometheus_writes_them():
    assert format_value(2) == "2.0" and format_value(math.inf) == "+Inf" and format_value(math.nan) == "NaN"
    assert format_labels(()) == ""
    assert format_labels((("a", 'x"y\\z\n'),)) == '{a="x\\"y\\\\z\\n"}'


def test_counter_refuses_to_decrease_and_needs_the_total_suffix():
    counter = Counter("things_total", "Things.")
    counter.inc((), 2)
    counter.set_total((), 1)  # a mirrored total never moves a counter backwards
    assert counter.value(()) == 2
    with pytest.raises(ValueError):
        counter.inc((), -1)
    with pytest.raises(ValueError):
        Counter("things", "Things.")


def test_histogram_buckets_are_cumulative_and_end_in_inf():
    histogram = Histogram("latency_seconds", "Latency.", (0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 5.0):
        histogram.observe((), value)
    lines = histogram.lines()
    assert lines[:3] == ['vllmlite:latency_seconds_bucket{le="0.1"} 2.0',
                         'vllmlite:latency_seconds_bucket{le="1.0"} 3.0',
                         'vllmlite:latency_seconds_bucket{le="+Inf"} 4.0']
    assert lines[3] == "vllmlite:latency_seconds_sum 5.65" and lines[4] == "vllmlite:latency_seconds_count 4.0"
    with pytest.raises(ValueError):
        Histogram("bad_seconds", "Bad.", (1.0, 0.5))


def test_fresh_registry_has_every_vllm_metric_and_parses():
    types, _ = parse_prometheus(EngineMetrics("m").render())
    assert types == EXPECTED_TYPES


def test_outputs_become_token_counts_and_latencies():
    metrics = EngineMetrics("m")
    metrics.record_outputs([output("a", [1])], now=100.5)          # first token: TTFT 0.5
    metrics.record_outputs([output("a", [2])], now=100.7)          # inter-token 0.2
    metrics.record_outputs([output("a", [3], "stop")], now=101.0)  # finished: e2e 1.0
    metrics.record_outputs([output("b", [], "error", error="x")], now=100.1)
    metrics.record_abort("c")
    text = metrics.render()
    assert metric_value(text, "vllmlite:prompt_tokens_total") == 5
    assert metric_value(text, "vllmlite:generation_tokens_total") == 3
    assert metric_value(text, "vllmlite:time_to_first_token_seconds_count") == 1
    assert metric_value(text, "vllmlite:time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert metric_value(text, "vllmlite:inter_token_latency_seconds_count") == 2
    assert metric_value(text, "vllmlite:e2e_request_latency_seconds_count") == 2
    assert metric_value(text, "vllmlite:e2e_request_latency_seconds_sum") == pytest.approx(1.1)
    for reason in ("stop", "error", "abort"):
        assert metric_value(text, "vllmlite:request_success_total", finished_reason=reason) == 1


def test_engine_stats_set_gauges_and_mirror_cumulative_counts():
    metrics = EngineMetrics("m")
    metrics.record_stats(EngineStats(SchedulerStats(num_running=3, num_waiting=1, num_swapped=1, num_kv_blocks=8,
                                                    num_kv_blocks_used=2, num_kv_blocks_free=6,
                                                    prefix_cache_queries=64, prefix_cache_hits=32,
                                                    num_preemptions=1)))
    text = metrics.render()
    assert metric_value(text, "vllmlite:num_requests_running", model_name="m") == 3
    assert metric_value(text, "vllmlite:num_requests_waiting") == 2
    assert metric_value(text, "vllmlite:kv_cache_usage_perc") == 0.25
    assert metric_value(text, "vllmlite:prefix_cache_hits_total") == 32
    assert metric_value(text, "vllmlite:num_preemptions_total") == 1


@pytest.mark.parametrize("bad", [
    "vllmlite:x 1\n",                                        # a sample of an undeclared metric
    "# TYPE a gauge\na{l=\"v} 1\n",                          # broken label
    "# TYPE a gauge\na 1",                                   # no final newline
    "# TYPE h histogram\nh_bucket{le=\"1.0\"} 2.0\nh_bucket{le=\"+Inf\"} 1.0\nh_count 1.0\n",  # not monotone
    "# TYPE h histogram\nh_bucket{le=\"1.0\"} 1.0\nh_bucket{le=\"+Inf\"} 1.0\nh_count 2.0\n",  # +Inf != count
])
def test_the_strict_parser_rejects_malformed_exposition(bad):
    with pytest.raises(AssertionError):
        parse_prometheus(bad)
