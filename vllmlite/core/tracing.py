"""Request lifecycle tracing: a bounded ring of recent requests, each with a timestamped event list.

Owns the per-request records (arrived, queued, scheduled, prefix hit, prefill chunks, preempted,
swapped in, resumed, finished or aborted), the ring of recent steps, and immutable snapshots of
both. Fed by the scheduler and the engine at the points where those things happen; knows nothing
of blocks, tensors, threads or HTTP. Engine thread only: readers on other threads get snapshots
made on the engine thread (AsyncLLMEngine.inspect).

`Tracer` is tracing switched off: every hook is a no-op. `RequestTracer` records. Memory is bounded:
at most `ring_size` finished records, at most `max_events` events each (plus the final one); the
live records are the engine's unfinished requests. Decode steps are not events; the first token is
read from the request (`Request.first_token_time`) and speculative counts are summed per request.
"""

from __future__ import annotations

import bisect
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllmlite.config import TraceConfig
from vllmlite.core.batch import SchedulerOutput
from vllmlite.core.request import FinishReason, Request
from vllmlite.stats import LatencySummary, StepRecord

NUM_RECENT_STEPS = 256  # steps kept for /debug/engine
LATENCY_WINDOW = 100    # finished requests the latency percentiles are taken over


@dataclass(frozen=True, slots=True)
class TraceEvent:
    """One event: when (unix seconds), what, and its fields ({"num_tokens": 32})."""

    time: float
    event: str
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RequestTraceSnapshot:
    """One request's trace as of the snapshot. Times are unix seconds; an n > 1 request is one trace
    (its samples' counts summed, its first sample's finish reason)."""

    request_id: str
    state: str                          # waiting, running, swapped, finished, aborted
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    finish_reason: str | None
    prompt: str | None                  # only with debug_store_prompts
    events: tuple[TraceEvent, ...]
    num_dropped_events: int             # events past max_events, not kept

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


class _Record:
    """A traced request while the engine holds it (the samples) and after (only counts and events)."""

    __slots__ = ("request_id", "arrival_time", "num_prompt_tokens", "prompt", "samples", "state", "events",
                 "num_dropped_events", "num_preemptions", "first_token_time", "finish_time", "finish_reason",
                 "num_output_tokens", "num_cached_tokens")

    def __init__(self, request_id: str, samples: list[Request], prompt: str | list[int] | None) -> None:
        first = samples[0]
        self.request_id = request_id
        self.arrival_time = first.arrival_time
        self.num_prompt_tokens = first.num_prompt_tokens
        self.prompt = prompt
        self.samples: list[Request] = samples
        self.state = "waiting"
        self.events: list[tuple[float, str, dict[str, Any]]] = [(first.arrival_time, "arrived", {})]
        self.num_dropped_events = 0
        self.num_preemptions = 0
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.finish_reason: str | None = None
        self.num_output_tokens = 0
        self.num_cached_tokens = 0


class Tracer:
    """Tracing switched off: every hook does nothing and nothing is kept. The interface readers use:
    `snapshots`, `snapshot`, `recent_steps`, `latency` (call them on the engine thread)."""

    def arrived(self, request_id: str, samples: list[Request], prompt: str | None) -> None:
        """A request (all its samples) was accepted by the engine."""

    def queued(self, request: Request, num_waiting: int) -> None:
        """The request joined the waiting queue (`num_waiting` requests are waiting now)."""

    def admitted(self, request: Request, num_hit_tokens: int) -> None:
        """The request left the waiting queue for the running list, `num_hit_tokens` from the prefix cache."""

    def scheduled(self, request: Request, start: int, num_tokens: int) -> None:
        """The request computes tokens [start, start + num_tokens) this step."""

    def preempted(self, request: Request, mode: str) -> None:
        """The request was taken off the machine ("recompute" or "swap")."""

    def swapped_in(self, request: Request) -> None:
        """A swapped request's KV came back and it runs again."""

    def finished(self, request: Request) -> None:
        """The request (one sample) finished; its trace closes at the end of the step."""

    def aborted(self, request_id: str, why: str) -> None:
        """The request was aborted (`why`: "client disconnected", "timeout", ...)."""

    def step_done(self, started: float, scheduled: SchedulerOutput) -> None:
        """The step that began at `started` (time.perf_counter) has run: close finished traces."""

    def snapshots(self, with_events: bool = False) -> list[RequestTraceSnapshot]:
        return []

    def snapshot(self, request_id: str) -> RequestTraceSnapshot | None:
        return None

    def recent_steps(self) -> list[StepRecord]:
        return []

    def latency(self, window: int = LATENCY_WINDOW) -> LatencySummary:
        return LatencySummary()


def make_tracer(config: TraceConfig, decode: Callable[[list[int]], str]) -> Tracer:
    """A recording tracer, or the no-op one when `trace_ring_size` is 0."""
    if config.trace_ring_size == 0:
        return Tracer()
    return RequestTracer(config.trace_ring_size, config.trace_max_events, config.debug_store_prompts, decode)


class RequestTracer(Tracer):
    """Records every request's lifecycle; keeps the live ones and the last `ring_size` finished."""

    def __init__(self, ring_size: int, max_events: int, store_prompts: bool = False,
                 decode: Callable[[list[int]], str] | None = None) -> None:
        self.ring_size = ring_size
        self.max_events = max_events
        self.store_prompts = store_prompts
        self._decode = decode
        self._live: OrderedDict[str, _Record] = OrderedDict()   # arrival order
        self._done: deque[_Record] = deque(maxlen=ring_size)    # oldest first
        self._finishing: list[Request] = []                     # finished this step
        self._steps: deque[StepRecord] = deque(maxlen=NUM_RECENT_STEPS)
        self._unix_offset = time.time() - time.monotonic()      # monotonic + offset = unix seconds
        self._perf_offset = time.time() - time.perf_counter()

    # --- hooks ----------------------------------------------------------------------------------

    def arrived(self, request_id: str, samples: list[Request], prompt: str | None) -> None:
        if self.store_prompts:
            prompt = prompt if prompt is not None else samples[0].prompt_token_ids
        else:
            prompt = None
        self._live[request_id] = _Record(request_id, samples, prompt)

    def queued(self, request: Request, num_waiting: int) -> None:
        self._add(request, "queued", {"num_waiting": num_waiting})

    def admitted(self, request: Request, num_hit_tokens: int) -> None:
        record = self._record(request)
        if record is None:
            return
        record.state = "running"
        self._add(request, "resumed" if request.num_preemptions else "scheduled")
        if num_hit_tokens:
            self._add(request, "prefix_hit", {"num_tokens": num_hit_tokens})

    def scheduled(self, request: Request, start: int, num_tokens: int) -> None:
        # A decode computes one token past the prompt; anything else is a prompt chunk or a re-prefill.
        if num_tokens > 1 or start < len(request.prompt_token_ids):
            self._add(request, "prefill_chunk", {"start": start, "num_tokens": num_tokens})

    def preempted(self, request: Request, mode: str) -> None:
        record = self._record(request)
        if record is not None:
            record.num_preemptions += 1
            record.state = "swapped" if mode == "swap" else "waiting"
            self._add(request, "preempted", {"mode": mode})

    def swapped_in(self, request: Request) -> None:
        record = self._record(request)
        if record is not None:
            record.state = "running"
            self._add(request, "swapped_in")
            self._add(request, "resumed")

    def finished(self, request: Request) -> None:
        self._finishing.append(request)

    def aborted(self, request_id: str, why: str) -> None:
        record = self._live.get(request_id)
        if record is not None:
            self._close(record, "aborted", FinishReason.ABORT.value, ("aborted", {"why": why}))

    def step_done(self, started: float, scheduled: SchedulerOutput) -> None:
        ended = time.perf_counter()
        if scheduled.scheduled:
            self._steps.append(_step_record(ended + self._perf_offset, ended - started, scheduled.scheduled))
        if self._finishing:
            for record in {id(r): r for r in map(self._record, self._finishing) if r is not None}.values():
                if all(s.is_finished for s in record.samples):
                    reason = record.samples[0].finish_reason
                    value = reason.value if reason is not None else None
                    self._close(record, "finished", value, ("finished", {"reason": value}))
            self._finishing.clear()

    # --- recording ------------------------------------------------------------------------------

    def _record(self, request: Request) -> _Record | None:
        return self._live.get(request.parent_id or request.request_id)

    def _add(self, request: Request, event: str, fields: dict[str, Any] | None = None) -> None:
        record = self._live.get(request.parent_id or request.request_id)
        if record is None:
            return
        if len(record.events) >= self.max_events:
            record.num_dropped_events += 1
            return
        fields = fields or {}
        if request.sample_index:
            fields["sample"] = request.sample_index  # an extra sample of an n > 1 request
        record.events.append((time.monotonic(), event, fields))

    def _close(self, record: _Record, state: str, reason: str | None, last: tuple[str, dict]) -> None:
        """Move `record` from live to done with its final counts; it lets go of the requests."""
        now = time.monotonic()
        self._take_counts(record)
        drafts = sum(s.num_draft_tokens for s in record.samples)
        if drafts:  # aggregated over the request's rounds, not one event per decode step
            accepted = sum(s.num_accepted_tokens for s in record.samples)
            record.events.append((now, "speculative", {"num_draft_tokens": drafts, "num_accepted": accepted}))
        record.events.append((now, *last))  # the final event is kept even past max_events
        record.state, record.finish_reason, record.finish_time = state, reason, now
        record.samples = []
        if isinstance(record.prompt, list):
            record.prompt = self._decode(record.prompt) if self._decode is not None else None
        del self._live[record.request_id]
        self._done.append(record)

    @staticmethod
    def _take_counts(record: _Record) -> None:
        """The samples' counts as of now (a finished record keeps the last ones taken)."""
        if not record.samples:
            return
        firsts = [s.first_token_time for s in record.samples if s.first_token_time is not None]
        record.first_token_time = min(firsts) if firsts else None
        record.num_output_tokens = sum(s.num_output_tokens for s in record.samples)
        record.num_cached_tokens = record.samples[0].num_cached_tokens

    # --- snapshots (engine thread) --------------------------------------------------------------

    def snapshots(self, with_events: bool = False) -> list[RequestTraceSnapshot]:
        """Live requests (oldest first), then finished ones newest first; at most `ring_size`. Without
        `with_events` their `events` are empty (a list of summaries is the cheap, common read)."""
        records = [*self._live.values(), *reversed(self._done)][:self.ring_size]
        return [self._snapshot(r, with_events) for r in records]

    def snapshot(self, request_id: str) -> RequestTraceSnapshot | None:
        record = self._live.get(request_id)
        if record is None:
            record = next((r for r in reversed(self._done) if r.request_id == request_id), None)
        return None if record is None else self._snapshot(record, with_events=True)

    def recent_steps(self) -> list[StepRecord]:
        return list(self._steps)

    def latency(self, window: int = LATENCY_WINDOW) -> LatencySummary:
        """Percentiles over the last `window` finished (not aborted) requests."""
        recent = [r for r in reversed(self._done) if r.state == "finished"][:window]
        ttfts = [r.first_token_time - r.arrival_time for r in recent if r.first_token_time is not None]
        tpots = [(r.finish_time - r.first_token_time) / (r.num_output_tokens - 1) for r in recent
                 if r.first_token_time is not None and r.num_output_tokens > 1]
        ttft_p50, ttft_p90 = _percentiles(ttfts)
        tpot_p50, tpot_p90 = _percentiles(tpots)
        return LatencySummary(ttft_p50, ttft_p90, tpot_p50, tpot_p90, len(recent))

    @property
    def num_records(self) -> int:
        return len(self._live) + len(self._done)

    def num_events(self) -> int:
        """Events held in all records (for memory checks)."""
        return sum(len(r.events) for r in (*self._live.values(), *self._done))

    def _snapshot(self, record: _Record, with_events: bool) -> RequestTraceSnapshot:
        self._take_counts(record)
        unix = self._unix_offset
        events = [TraceEvent(t + unix, name, dict(fields)) for t, name, fields in record.events] if with_events else []
        if with_events and record.first_token_time is not None:  # read from the request, in time order
            first = TraceEvent(record.first_token_time + unix, "first_token")
            events.insert(bisect.bisect_right([e.time for e in events], first.time), first)
        prompt = record.prompt
        if isinstance(prompt, list):
            prompt = self._decode(prompt) if self._decode is not None else None
        return RequestTraceSnapshot(
            request_id=record.request_id, state=record.state, arrival_time=record.arrival_time + unix,
            first_token_time=None if record.first_token_time is None else record.first_token_time + unix,
            finish_time=None if record.finish_time is None else record.finish_time + unix,
            num_prompt_tokens=record.num_prompt_tokens, num_output_tokens=record.num_output_tokens,
            num_cached_tokens=record.num_cached_tokens, num_preemptions=record.num_preemptions,
            finish_reason=record.finish_reason, prompt=prompt, events=tuple(events),
            num_dropped_events=record.num_dropped_events)


def _step_record(time_: float, seconds: float, scheduled: Sequence) -> StepRecord:
    # A decode is one token past the prompt (compared with the prompt: the request has already grown).
    num_decode = sum(len(seq.token_ids) == 1 and seq.start_position >= len(seq.request.prompt_token_ids)
                     for seq in scheduled)
    num_tokens = sum(len(seq.token_ids) for seq in scheduled)
    return StepRecord(time_, seconds * 1e3, num_decode, num_tokens - num_decode, len(scheduled))


def _percentiles(values: Iterable[float]) -> tuple[float | None, float | None]:
    values = list(values)
    if not values:
        return None, None
    p50, p90 = np.percentile(values, [50, 90])
    return float(p50), float(p90)
