"""Prometheus metrics written by hand: counters, gauges and histograms in the text exposition format.

Owns the metric names (vLLM's, under `vllmlite:`), their buckets and the per-request latency
bookkeeping that turns engine outputs into TTFT, inter-token and end-to-end observations.
Knows nothing of HTTP or of the engine's classes: it is fed EngineStats snapshots and RequestOutputs.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from vllmlite.outputs import EmbeddingRequestOutput
from vllmlite.stats import EngineStats

PREFIX = "vllmlite:"

# vLLM's buckets (seconds), with a few finer ones at the bottom for small CPU models.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
               40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

Labels = tuple[tuple[str, str], ...]  # (("model_name", "x"), ("finished_reason", "stop"))


def format_value(value: float) -> str:
    """A sample value as Prometheus writes it.

    >>> format_value(3), format_value(0.25), format_value(float("inf"))
    ('3.0', '0.25', '+Inf')
    """
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


def format_labels(labels: Labels) -> str:
    """`{a="x",b="y"}` with `\\`, `"` and newlines escaped; "" for no labels.

    >>> format_labels((("model_name", 'a"b'),))
    '{model_name="a\\\\"b"}'
    """
    if not labels:
        return ""
    escaped = (value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for _, value in labels)
    return "{" + ",".join(f'{name}="{value}"' for (name, _), value in zip(labels, escaped)) + "}"


class _Metric:
    kind = "untyped"

    def __init__(self, name: str, documentation: str) -> None:
        self.name = PREFIX + name
        self.documentation = documentation

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.documentation}", f"# TYPE {self.name} {self.kind}"]

    def lines(self) -> list[str]:
        raise NotImplementedError


class _Scalar(_Metric):
    """One float per label set."""

    def __init__(self, name: str, documentation: str) -> None:
        super().__init__(name, documentation)
        self._values: dict[Labels, float] = {}

    def value(self, labels: Labels) -> float:
        return self._values.get(labels, 0.0)

    def lines(self) -> list[str]:
        return [f"{self.name}{format_labels(k)} {format_value(v)}" for k, v in self._values.items()]


class Counter(_Scalar):
    """A monotone total per label set. `name` must end in `_total`, as prometheus_client writes it."""

    kind = "counter"

    def __init__(self, name: str, documentation: str) -> None:
        if not name.endswith("_total"):
            raise ValueError(f"counter {name!r} must end in _total")
        super().__init__(name, documentation)

    def inc(self, labels: Labels, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError(f"counter {self.name} cannot decrease (inc by {amount})")
        self._values[labels] = self._values.get(labels, 0.0) + amount

    def set_total(self, labels: Labels, total: float) -> None:
        """Mirror a cumulative count kept elsewhere (e.g. the block manager's prefix queries)."""
        self._values[labels] = max(float(total), self._values.get(labels, 0.0))


class Gauge(_Scalar):
    kind = "gauge"

    def set(self, labels: Labels, value: float) -> None:
        self._values[labels] = float(value)


class Histogram(_Metric):
    """Cumulative buckets (`le`), ending in +Inf, plus `_sum` and `_count` per label set."""

    kind = "histogram"

    def __init__(self, name: str, documentation: str, buckets: Sequence[float]) -> None:
        if list(buckets) != sorted(set(buckets)):
            raise ValueError(f"histogram {name!r} buckets must be strictly increasing")
        super().__init__(name, documentation)
        self.buckets = (*buckets, math.inf)
        self._counts: dict[Labels, list[int]] = {}  # per bucket, not cumulative
        self._sums: dict[Labels, float] = {}

    def observe(self, labels: Labels, value: float) -> None:
        counts = self._counts.setdefault(labels, [0] * len(self.buckets))
        index = next(i for i, bound in enumerate(self.buckets) if value <= bound)
        counts[index] += 1
        self._sums[labels] = self._sums.get(labels, 0.0) + value

    def count(self, labels: Labels) -> int:
        return sum(self._counts.get(labels, ()))

    def quantile(self, labels: Labels, q: float) -> float | None:
        """The q-quantile estimated from the buckets, interpolated linearly inside the bucket that holds
        it (Prometheus's histogram_quantile); None with no observation. Beyond the last finite bound,
        that bound.

        >>> h = Histogram("x_seconds", "", (1.0, 2.0)); h.observe((), 0.5); h.observe((), 1.5)
        >>> h.quantile((), 0.5), h.quantile((), 0.75), h.quantile(("a",), 0.5)
        (1.0, 1.5, None)
        """
        counts = self._counts.get(labels)
        if not counts or not sum(counts):
            return None
        rank = q * sum(counts)
        below, lower = 0, 0.0
        for bound, count in zip(self.buckets, counts):
            if count and below + count >= rank:
                if math.isinf(bound):
                    return lower
                return lower + (bound - lower) * (rank - below) / count
            below += count
            lower = bound
        return lower

    def lines(self) -> list[str]:
        out = []
        for labels, counts in self._counts.items():
            cumulative = 0
            for bound, count in zip(self.buckets, counts):
                cumulative += count
                bucket_labels = (*labels, ("le", format_value(bound)))
                out.append(f"{self.name}_bucket{format_labels(bucket_labels)} {format_value(cumulative)}")
            out.append(f"{self.name}_sum{format_labels(labels)} {format_value(self._sums[labels])}")
            out.append(f"{self.name}_count{format_labels(labels)} {format_value(cumulative)}")
        return out


@dataclass
class MetricTotals:
    """Cumulative counts, and latency quantiles estimated from the histograms over every request so far
    (None before the first)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # finish reason ("abort" included) -> requests
    num_latency_requests: int = 0                            # requests the TTFT quantiles are over
    ttft_p50: float | None = None
    ttft_p90: float | None = None
    tpot_p50: float | None = None                            # inter-token latency, seconds
    tpot_p90: float | None = None


@dataclass
class _RequestTimes:
    arrival_time: float
    last_token_time: float | None = None


class EngineMetrics:
    """vLLM's serving metrics for one model. Thread-safe: the engine thread records, HTTP renders."""

    def __init__(self, model_name: str) -> None:
        self.labels: Labels = (("model_name", model_name),)
        self._lock = threading.Lock()
        self._requests: dict[str, _RequestTimes] = {}
        self.num_running = Gauge("num_requests_running", "Number of requests in model execution batches.")
        self.num_waiting = Gauge("num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_cache_usage = Gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = Counter("prefix_cache_queries_total",
                                      "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = Counter("prefix_cache_hits_total",
                                   "Prefix cache hits, in terms of number of cached tokens.")
        self.preemptions = Counter("num_preemptions_total", "Cumulative number of preemptions.")
        self.prompt_tokens = Counter("prompt_tokens_total", "Number of prefill tokens processed.")
        self.generation_tokens = Counter("generation_tokens_total", "Number of generation tokens processed.")
        self.request_success = Counter("request_success_total", "Count of finished requests by finish reason.")
        self.ttft = Histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = Histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.e2e = Histogram("e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
                             E2E_BUCKETS)
        self.spec_drafts = Counter("spec_decode_num_drafts_total", "Speculative rounds that scored a guess.")
        self.spec_draft_tokens = Counter("spec_decode_num_draft_tokens_total", "Speculative guesses scored.")
        self.spec_accepted = Counter("spec_decode_num_accepted_tokens_total", "Speculative guesses accepted.")
        self.spec_accepted_per_pos = Counter("spec_decode_num_accepted_tokens_per_pos_total",
                                             "Speculative guesses accepted, by position in the round.")
        self._metrics = (self.num_running, self.num_waiting, self.kv_cache_usage, self.prefix_queries,
                         self.prefix_hits, self.preemptions, self.prompt_tokens, self.generation_tokens,
                         self.request_success, self.ttft, self.itl, self.e2e, self.spec_drafts,
                         self.spec_draft_tokens, self.spec_accepted, self.spec_accepted_per_pos)
        self.record_stats(EngineStats())
        for counter in (self.prompt_tokens, self.generation_tokens):
            counter.inc(self.labels, 0.0)

    def record_stats(self, stats: EngineStats) -> None:
        s, spec = stats.scheduler, stats.scheduler.spec_decode
        with self._lock:
            self.num_running.set(self.labels, s.num_running)
            self.num_waiting.set(self.labels, s.num_not_running)
            self.kv_cache_usage.set(self.labels, s.kv_cache_usage)
            self.prefix_queries.set_total(self.labels, s.prefix_cache_queries)
            self.prefix_hits.set_total(self.labels, s.prefix_cache_hits)
            self.preemptions.set_total(self.labels, s.num_preemptions)
            self.spec_drafts.set_total(self.labels, spec.num_drafts)
            self.spec_draft_tokens.set_total(self.labels, spec.num_draft_tokens)
            self.spec_accepted.set_total(self.labels, spec.num_accepted_tokens)
            for position, count in enumerate(spec.accepted_per_position):
                self.spec_accepted_per_pos.set_total((*self.labels, ("position", str(position))), count)

    def record_outputs(self, outputs: Iterable, now: float) -> None:
        """Token counts and latencies from one step's RequestOutputs (taken at time `now`)."""
        with self._lock:
            for output in outputs:
                self._record_output(output, now)

    def _record_output(self, output, now: float) -> None:
        times = self._requests.get(output.request_id)
        if times is None:
            arrival = output.metrics.arrival_time if output.metrics is not None else now
            times = self._requests[output.request_id] = _RequestTimes(arrival)
        if isinstance(output, EmbeddingRequestOutput):
            # One output, when finished: its prompt tokens count, it has no first or later tokens.
            num_new = 0
            if output.error is None:
                self.prompt_tokens.inc(self.labels, len(output.prompt_token_ids))
        else:
            num_new = sum(len(c.delta_token_ids) for c in output.outputs)
        if num_new:
            self.generation_tokens.inc(self.labels, num_new)
            if times.last_token_time is None:
                self.prompt_tokens.inc(self.labels, len(output.prompt_token_ids))
                self.ttft.observe(self.labels, now - times.arrival_time)
            else:
                self.itl.observe(self.labels, now - times.last_token_time)
            times.last_token_time = now
        if output.finished:
            del self._requests[output.request_id]
            self.e2e.observe(self.labels, now - times.arrival_time)
            reasons = ["stop"] if isinstance(output, EmbeddingRequestOutput) else \
                [c.finish_reason for c in output.outputs if c.finish_reason]
            reason = "error" if output.error else (reasons[0] if reasons else "abort")
            self.request_success.inc((*self.labels, ("finished_reason", reason)))

    def record_abort(self, request_id: str) -> None:
        """A request the engine dropped without an output (client gone, shutdown)."""
        with self._lock:
            self._requests.pop(request_id, None)
            self.request_success.inc((*self.labels, ("finished_reason", "abort")))

    def totals(self) -> MetricTotals:
        """The cumulative counts and latency quantiles, for /v1/stats."""
        with self._lock:
            finished = {dict(labels)["finished_reason"]: int(value)
                        for labels, value in self.request_success._values.items()}
            return MetricTotals(
                prompt_tokens=int(self.prompt_tokens.value(self.labels)),
                generation_tokens=int(self.generation_tokens.value(self.labels)), finished=finished,
                num_latency_requests=self.ttft.count(self.labels),
                ttft_p50=self.ttft.quantile(self.labels, 0.5), ttft_p90=self.ttft.quantile(self.labels, 0.9),
                tpot_p50=self.itl.quantile(self.labels, 0.5), tpot_p90=self.itl.quantile(self.labels, 0.9))

    def render(self) -> str:
        """The whole registry in Prometheus text format 0.0.4, ending with a newline."""
        with self._lock:
            lines = [line for metric in self._metrics for line in (*metric.header(), *metric.lines())]
        return "\n".join(lines) + "\n"
