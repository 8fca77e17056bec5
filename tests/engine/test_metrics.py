"""The Prometheus exposition (prometheus-client): vLLM's names, labels and buckets, what each metric
counts, the `vllm` prefix for vLLM's Grafana dashboard, and the periodic stats line."""

from __future__ import annotations

import pytest
from server_util import metric_value, parse_prometheus

from vllmlite.engine.metrics import EngineMetrics, token_buckets
from vllmlite.outputs import CompletionOutput, OutputProgress, RequestMetrics, RequestOutput
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
    "vllmlite:num_requests_swapped": "gauge",
    "vllmlite:gpu_cache_usage_perc": "gauge",
    "vllmlite:time_per_output_token_seconds": "histogram",
    "vllmlite:request_time_per_output_token_seconds": "histogram",
    "vllmlite:request_queue_time_seconds": "histogram",
    "vllmlite:request_prefill_time_seconds": "histogram",
    "vllmlite:request_decode_time_seconds": "histogram",
    "vllmlite:request_inference_time_seconds": "histogram",
    "vllmlite:request_prompt_tokens": "histogram",
    "vllmlite:request_generation_tokens": "histogram",
    "vllmlite:request_max_num_generation_tokens": "histogram",
}
# What vLLM's own Grafana dashboard (examples/online_serving/prometheus_grafana/grafana.json) queries.
GRAFANA_SERIES = ["e2e_request_latency_seconds_bucket", "prompt_tokens_total", "generation_tokens_total",
                  "time_per_output_token_seconds_bucket", "num_requests_running", "num_requests_waiting",
                  "time_to_first_token_seconds_bucket", "gpu_cache_usage_perc", "request_prompt_tokens_bucket",
                  "request_generation_tokens_bucket", "request_success_total", "request_queue_time_seconds_sum",
                  "request_prefill_time_seconds_sum", "request_decode_time_seconds_sum",
                  "request_max_num_generation_tokens_sum"]


def output(request_id: str, new_tokens: list[int], finish_reason=None, error=None, num_prompt=5,
           num_tokens: int | None = None) -> RequestOutput:
    token_ids = list(range(num_tokens)) if num_tokens is not None else list(new_tokens)
    completion = CompletionOutput(0, "", token_ids, finish_reason=finish_reason, delta_token_ids=new_tokens)
    return RequestOutput(request_id, None, list(range(num_prompt)), [completion], finish_reason is not None,
                         error=error, metrics=RequestMetrics(arrival_time=100.0, first_scheduled_time=100.2))


def test_token_buckets_are_vllms_1_2_5_series():
    assert token_buckets(1000) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
    assert token_buckets(8192)[-1] == 5000


def test_fresh_registry_has_every_vllm_metric_and_parses():
    types, _ = parse_prometheus(EngineMetrics("m").render())
    assert types == EXPECTED_TYPES


def test_outputs_become_token_counts_and_latencies():
    metrics = EngineMetrics("m")
    metrics.record_outputs([output("a", [1])], now=100.5)          # first token: TTFT 0.5
    metrics.record_outputs([output("a", [2])], now=100.7)          # inter-token 0.2
    metrics.record_outputs([output("a", [3], "stop", num_tokens=3)], now=101.0)  # finished: e2e 1.0
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
    # a: queued 0.2 s (arrival 100.0, first scheduled 100.2), prefill to the first token 0.3 s,
    # decode 0.5 s over 2 more tokens; b failed before any token
    assert metric_value(text, "vllmlite:request_queue_time_seconds_sum") == pytest.approx(0.2 + 0.2)
    assert metric_value(text, "vllmlite:request_prefill_time_seconds_sum") == pytest.approx(0.3)
    assert metric_value(text, "vllmlite:request_decode_time_seconds_sum") == pytest.approx(0.5)
    assert metric_value(text, "vllmlite:request_time_per_output_token_seconds_sum") == pytest.approx(0.25)
    assert metric_value(text, "vllmlite:time_per_output_token_seconds_count") == 2
    assert metric_value(text, "vllmlite:request_generation_tokens_sum") == 3
    assert metric_value(text, "vllmlite:request_prompt_tokens_count") == 2


def test_an_output_sent_as_its_progress_counts_as_the_output_would():
    """An engine process sends an unread output (a response not streamed) as its OutputProgress: the
    page must read the same as when the outputs themselves are recorded."""
    steps = [([output("a", [1], num_prompt=7)], 100.5), ([output("a", [2, 3], num_prompt=7)], 100.7),
             ([output("a", [4], "stop", num_prompt=7, num_tokens=4)], 101.0)]
    whole, progress = EngineMetrics("m"), EngineMetrics("m")
    for outputs, now in steps:
        whole.record_outputs(outputs, now)
        progress.record_outputs([o if o.finished else OutputProgress.of(o) for o in outputs], now)
    assert OutputProgress.of(steps[1][0][0]) == OutputProgress("a", 100.0, 7, 2)
    assert progress.render() == whole.render()
    assert metric_value(progress.render(), "vllmlite:inter_token_latency_seconds_count") == 2


def test_samples_of_one_token_each_give_no_time_per_output_token():
    metrics = EngineMetrics("m")
    first = RequestOutput("n2", None, [1, 2], [CompletionOutput(i, "", [7], delta_token_ids=[7]) for i in (0, 1)],
                          False, metrics=RequestMetrics(arrival_time=100.0))
    done = RequestOutput("n2", None, [1, 2], [CompletionOutput(i, "", [7], finish_reason="length") for i in (0, 1)],
                         True, metrics=RequestMetrics(arrival_time=100.0))
    metrics.record_outputs([first], now=100.5)
    metrics.record_outputs([done], now=100.6)  # two samples, one token each: nothing to divide
    text = metrics.render()
    assert metric_value(text, "vllmlite:request_time_per_output_token_seconds_count") == 0
    assert metric_value(text, "vllmlite:request_generation_tokens_sum") == 2


def test_vllm_prefix_serves_every_series_vllms_grafana_dashboard_reads():
    metrics = EngineMetrics("m", prefix="vllm")
    metrics.record_outputs([output("a", [1])], now=100.5)
    metrics.record_outputs([output("a", [2], "length", num_tokens=2)], now=100.9)
    _, samples = parse_prometheus(metrics.render())
    names = {s.name for s in samples}
    assert all(name.startswith("vllm:") for name in names)
    missing = [series for series in GRAFANA_SERIES if "vllm:" + series not in names]
    assert not missing
    assert {s.labels.get("model_name") for s in samples} == {"m"}


def test_stats_line_reports_throughput_since_the_last_line():
    metrics = EngineMetrics("m")
    assert metrics.log_line(10.0)[1] is False  # idle
    metrics.record_outputs([output("a", [1, 2], num_prompt=40)], now=11.0)
    metrics.record_stats(EngineStats(SchedulerStats(num_running=1, num_kv_blocks=4, num_kv_blocks_used=1,
                                                    prefix_cache_queries=40, prefix_cache_hits=10)))
    line, is_busy = metrics.log_line(12.0)
    assert is_busy and line == ("Avg prompt throughput: 20.0 tokens/s, Avg generation throughput: 1.0 tokens/s, "
                                "Running: 1 reqs, Waiting: 0 reqs, KV cache usage: 25.0%, "
                                "Prefix cache hit rate: 25.0%")


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
    with pytest.raises((AssertionError, ValueError)):
        parse_prometheus(bad)
