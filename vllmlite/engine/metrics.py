"""Prometheus metrics with prometheus-client: vLLM's names, labels and buckets under our prefix.

Owns the metric names (`vllmlite:` by default, `vllm:` with `--metrics-prefix vllm` so vLLM's own
Grafana dashboard reads them unchanged), their buckets, and the per-request latency bookkeeping that
turns engine outputs into TTFT, inter-token, queue/prefill/decode and end-to-end observations.
Knows nothing of HTTP or of the engine's classes: it is fed EngineStats snapshots and RequestOutputs.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric

from vllmlite.outputs import EmbeddingRequestOutput, OutputProgress, RequestOutput
from vllmlite.stats import EngineStats, RequestTotals

DEFAULT_PREFIX = "vllmlite"
CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST

# No `_created` series: vLLM's dashboards do not read them and they double the exposition.
prometheus_client.disable_created_metrics()

# vLLM's buckets (seconds), with a few finer ones at the bottom for small CPU models.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
               40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
PHASE_BUCKETS = (0.001, 0.01, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def token_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's 1-2-5 buckets up to the context length.

    >>> token_buckets(60)
    (1, 2, 5, 10, 20, 50)
    """
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


@dataclass
class _RequestTimes:
    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None


class _MirroredCounter:
    """A counter that follows a cumulative total kept elsewhere (the scheduler's prefix queries):
    it is increased by what the total grew since the last snapshot, never decreased."""

    def __init__(self, child) -> None:
        self._child = child
        self._last = 0.0

    def follow(self, total: float) -> None:
        if total > self._last:
            self._child.inc(total - self._last)
            self._last = float(total)


class _Alias:
    """A collector that serves the metric `source` (a Gauge, Histogram...) under a second name,
    copied at scrape time, so each observation is made once."""

    def __init__(self, source, name: str, documentation: str) -> None:
        self._source, self._name, self._documentation = source, name, documentation

    def collect(self):
        for family in self._source.collect():
            alias = Metric(self._name, self._documentation, family.type)
            for sample in family.samples:
                alias.add_sample(self._name + sample.name[len(family.name):], sample.labels, sample.value)
            yield alias


class EngineMetrics:
    """vLLM's serving metrics for one model, in a registry of its own. Thread-safe: the engine
    thread records, HTTP renders."""

    def __init__(self, model_name: str, prefix: str = DEFAULT_PREFIX, max_model_len: int = 8192) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._prefix = prefix
        self._lock = threading.Lock()
        self._requests: dict[str, _RequestTimes] = {}
        self._parents: dict[str, Gauge | Histogram] = {}  # by name: the metrics _Alias re-serves
        gauge, counter, histogram = self._gauge, self._counter, self._histogram
        self.num_running = gauge("num_requests_running", "Number of requests in model execution batches.")
        self.num_waiting = gauge("num_requests_waiting", "Number of requests waiting to be processed.")
        self.num_swapped = gauge("num_requests_swapped", "Number of requests swapped out to the host arena.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = _MirroredCounter(counter(
            "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."))
        self.prefix_hits = _MirroredCounter(counter(
            "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."))
        self.preemptions = _MirroredCounter(counter("num_preemptions", "Cumulative number of preemptions."))
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self._request_success = Counter(self._name("request_success"), "Count of finished requests by finish "
                                        "reason.", ["model_name", "finished_reason"], registry=self.registry)
        self.ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.request_tpot = histogram("request_time_per_output_token_seconds",
                                      "Histogram of each request's mean time per output token.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
                             E2E_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Histogram of time spent waiting to be "
                                    "scheduled first.", PHASE_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "Histogram of time from first scheduled "
                                      "to first token.", PHASE_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "Histogram of time from first token to "
                                     "the last.", PHASE_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds", "Histogram of time from first "
                                        "scheduled to finished.", PHASE_BUCKETS)
        tokens = token_buckets(max_model_len)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Number of prefill tokens per request.",
                                               tokens)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Number of generation tokens per request.", tokens)
        self.request_max_generation_tokens = histogram("request_max_num_generation_tokens", "Most generation "
                                                       "tokens of any sample of a request.", tokens)
        self.spec_drafts = _MirroredCounter(counter("spec_decode_num_drafts", "Speculative rounds that scored "
                                                                              "a guess."))
        self.spec_draft_tokens = _MirroredCounter(counter("spec_decode_num_draft_tokens",
                                                          "Speculative guesses scored."))
        self.spec_accepted = _MirroredCounter(counter("spec_decode_num_accepted_tokens",
                                                      "Speculative guesses accepted."))
        self._spec_per_pos = Counter(self._name("spec_decode_num_accepted_tokens_per_pos"),
                                     "Speculative guesses accepted, by position in the round.",
                                     ["model_name", "position"], registry=self.registry)
        self._spec_per_pos_mirrors: dict[int, _MirroredCounter] = {}
        self.totals = Totals()  # what the periodic log line reads
        # vLLM's older names, which its Grafana dashboard reads: the same series, copied when scraped.
        self.registry.register(_Alias(self._parents["kv_cache_usage_perc"], self._name("gpu_cache_usage_perc"),
                                      "KV-cache usage (vLLM's older name). 1 means 100 percent usage."))
        self.registry.register(_Alias(self._parents["inter_token_latency_seconds"],
                                      self._name("time_per_output_token_seconds"),
                                      "Histogram of time per output token in seconds (vLLM's older name of the "
                                      "inter-token latency)."))

    def _name(self, name: str) -> str:
        return f"{self._prefix}:{name}"

    def _gauge(self, name: str, documentation: str):
        parent = self._parents[name] = Gauge(self._name(name), documentation, ["model_name"], registry=self.registry)
        return parent.labels(self.model_name)

    def _counter(self, name: str, documentation: str):
        return Counter(self._name(name), documentation, ["model_name"], registry=self.registry).labels(self.model_name)

    def _histogram(self, name: str, documentation: str, buckets):
        parent = self._parents[name] = Histogram(self._name(name), documentation, ["model_name"], buckets=buckets,
                                                 registry=self.registry)
        return parent.labels(self.model_name)

    def record_stats(self, stats: EngineStats) -> None:
        s, spec = stats.scheduler, stats.scheduler.spec_decode
        with self._lock:
            self.totals.last_stats = stats
            self.num_running.set(s.num_running)
            self.num_waiting.set(s.num_not_running)
            self.num_swapped.set(s.num_swapped)
            self.kv_cache_usage.set(s.kv_cache_usage)
            self.prefix_queries.follow(s.prefix_cache_queries)
            self.prefix_hits.follow(s.prefix_cache_hits)
            self.preemptions.follow(s.num_preemptions)
            self.spec_drafts.follow(spec.num_drafts)
            self.spec_draft_tokens.follow(spec.num_draft_tokens)
            self.spec_accepted.follow(spec.num_accepted_tokens)
            for position, count in enumerate(spec.accepted_per_position):
                mirror = self._spec_per_pos_mirrors.get(position)
                if mirror is None:
                    child = self._spec_per_pos.labels(self.model_name, str(position))
                    mirror = self._spec_per_pos_mirrors[position] = _MirroredCounter(child)
                mirror.follow(count)

    def record_outputs(self, outputs: Iterable[RequestOutput | EmbeddingRequestOutput | OutputProgress],
                       now: float) -> None:
        """Token counts and latencies from one step's RequestOutputs (taken at time `now`); an output
        nobody was sent may come as its OutputProgress."""
        with self._lock:
            num_generated = sum([self._record_output(output, now) for output in outputs])
            if num_generated:  # the step's tokens counted once: the counter reads the same after the call
                self.generation_tokens.inc(num_generated)
                self.totals.generation_tokens += num_generated

    def _record_output(self, output: RequestOutput | EmbeddingRequestOutput | OutputProgress, now: float) -> int:
        """Record one output's latencies; return its new tokens (the caller counts them)."""
        progress = output if isinstance(output, OutputProgress) else OutputProgress.of(output)
        times = self._requests.get(progress.request_id)
        if times is None:
            arrival = progress.arrival_time if progress.arrival_time is not None else now
            times = self._requests[progress.request_id] = _RequestTimes(arrival)
        if isinstance(output, EmbeddingRequestOutput) and output.error is None:
            # One output, when finished: its prompt tokens count, it has no first or later tokens.
            self._count_prompt(progress.num_prompt_tokens)
        if progress.num_new_tokens:
            if times.last_token_time is None:
                self._count_prompt(progress.num_prompt_tokens)
                self.ttft.observe(now - times.arrival_time)
                times.first_token_time = now
            else:
                self.itl.observe(now - times.last_token_time)
            times.last_token_time = now
        if not isinstance(output, OutputProgress) and output.finished:
            del self._requests[output.request_id]
            self._record_finished(output, times, now)
        return progress.num_new_tokens

    def _count_prompt(self, num_tokens: int) -> None:
        self.prompt_tokens.inc(num_tokens)
        self.totals.prompt_tokens += num_tokens

    def _record_finished(self, output, times: _RequestTimes, now: float) -> None:
        self.e2e.observe(now - times.arrival_time)
        self.request_prompt_tokens.observe(len(output.prompt_token_ids))
        is_embedding = isinstance(output, EmbeddingRequestOutput)
        lengths = [] if is_embedding else [len(c.token_ids) for c in output.outputs]
        self.request_generation_tokens.observe(sum(lengths))
        self.request_max_generation_tokens.observe(max(lengths, default=0))
        scheduled = getattr(output.metrics, "first_scheduled_time", None)
        if scheduled is not None:
            self.queue_time.observe(scheduled - times.arrival_time)
            self.inference_time.observe(now - scheduled)
            if times.first_token_time is not None:
                self.prefill_time.observe(times.first_token_time - scheduled)
        if times.first_token_time is not None:
            self.decode_time.observe(now - times.first_token_time)
            longest = max(lengths, default=0)  # samples decode side by side: the longest sets the pace
            if longest > 1:
                self.request_tpot.observe((now - times.first_token_time) / (longest - 1))
        reasons = ["stop"] if is_embedding else [c.finish_reason for c in output.outputs if c.finish_reason]
        reason = "error" if output.error else (reasons[0] if reasons else "abort")
        self._request_success.labels(self.model_name, reason).inc()
        if reason == "abort":
            self.totals.num_aborted += 1
        else:
            self.totals.num_finished += 1

    def record_abort(self, request_id: str) -> None:
        """A request the engine dropped without an output (client gone, shutdown)."""
        with self._lock:
            self._requests.pop(request_id, None)
            self._request_success.labels(self.model_name, "abort").inc()
            self.totals.num_aborted += 1

    def request_totals(self) -> RequestTotals:
        """The cumulative token and request counts, as /metrics counts them (for /v1/stats)."""
        with self._lock:
            t = self.totals
            return RequestTotals(t.prompt_tokens, t.generation_tokens, t.num_finished, t.num_aborted)

    def render(self) -> str:
        """The whole registry in Prometheus text format 0.0.4, ending with a newline."""
        with self._lock:
            return prometheus_client.generate_latest(self.registry).decode()

    def log_line(self, now: float) -> tuple[str, bool]:
        """vLLM's periodic stats line over the time since the last call, and whether anything
        happened in it (prompt or generation tokens, or requests running or waiting):

        Avg prompt throughput: 812.3 tokens/s, Avg generation throughput: 95.1 tokens/s, Running: 4 reqs,
        Waiting: 0 reqs, KV cache usage: 12.5%, Prefix cache hit rate: 40.0%
        """
        with self._lock:
            t = self.totals
            elapsed = max(now - t.logged_at, 1e-9) if t.logged_at is not None else None
            prompt, generation = t.prompt_tokens - t.logged_prompt, t.generation_tokens - t.logged_generation
            t.logged_at, t.logged_prompt, t.logged_generation = now, t.prompt_tokens, t.generation_tokens
            s = t.last_stats.scheduler
        prompt_rate = prompt / elapsed if elapsed else 0.0
        generation_rate = generation / elapsed if elapsed else 0.0
        hit_rate = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        line = (f"Avg prompt throughput: {prompt_rate:.1f} tokens/s, Avg generation throughput: "
                f"{generation_rate:.1f} tokens/s, Running: {s.num_running} reqs, Waiting: {s.num_not_running} reqs, "
                f"KV cache usage: {100 * s.kv_cache_usage:.1f}%, Prefix cache hit rate: {100 * hit_rate:.1f}%")
        return line, bool(prompt or generation or s.num_running or s.num_not_running)


@dataclass
class Totals:
    """Plain running totals beside the Prometheus series (which are not meant to be read back)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_finished: int = 0   # requests ended for any reason but an abort
    num_aborted: int = 0
    last_stats: EngineStats = field(default_factory=EngineStats)
    logged_at: float | None = None
    logged_prompt: int = 0
    logged_generation: int = 0
