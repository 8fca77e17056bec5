"""The engine's named reads behind /v1/stats and /debug/*: `stats`, `requests`, `request <id>` and
`engine`, each the JSON-ready payload of its route (the shapes of api/ops/protocol_debug.py).

Owns turning the engine's snapshots (EngineStats, RequestTraceSnapshot, EngineDebugSnapshot) into
those payloads. Every snapshot is taken through `run`, which AsyncLLMEngine points at its engine
thread between two steps, so nothing is read while a step changes it (ProcessEngine at its engine
process: the snapshot functions are module-level, so they cross a pipe by name). Knows nothing of HTTP: a Ray
replica answers the ingress with these same payloads, and the ingress merges them
(api/ray/replica_debug.py).

Request ids are the engine's: the id the API returns (chatcmpl-..., cmpl-...), and for a completion
with several prompts `<id>-<i>` for prompt i. The n samples of one prompt share one trace.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from functools import partial
from typing import Any, TypeVar

from vllmlite.core.tracing import RequestTraceSnapshot
from vllmlite.engine.client import INSPECT_READS
from vllmlite.engine.llm_engine import LLMEngine
from vllmlite.engine.metrics import EngineMetrics
from vllmlite.stats import EngineStats, LatencySummary, RequestTotals

T = TypeVar("T")
RunOnEngine = Callable[[Callable[[LLMEngine], T]], Awaitable[T]]


class EngineInspector:
    """The payloads of the named reads (INSPECT_READS) of one engine; `read("request", id)` is None
    for an id it has no trace of, and an unknown read is a ValueError."""

    def __init__(self, run: RunOnEngine, metrics: EngineMetrics | None, model_name: str) -> None:
        self._run = run
        self._metrics = metrics
        self.model_name = model_name
        self._reads = dict(zip(INSPECT_READS, (self.stats, self.requests, self.request, self.engine)))

    async def read(self, read: str, *args: str) -> Any:
        """The payload of `read`; only these reads ever run on the engine thread."""
        if read not in self._reads:
            raise ValueError(f"unknown read {read!r}: one of {', '.join(self._reads)}")
        return await self._reads[read](*args)

    async def stats(self) -> dict[str, Any]:
        engine_stats, latency = await self._run(stats_snapshot)
        return stats_payload(self.model_name, engine_stats, latency, self._totals())

    async def requests(self) -> dict[str, Any]:
        traces = await self._run(trace_snapshots)
        return {"requests": [trace_summary(t) for t in traces]}

    async def request(self, request_id: str) -> dict[str, Any] | None:
        trace = await self._run(partial(trace_snapshot, request_id=request_id))
        return None if trace is None else trace_detail(trace)

    async def engine(self) -> dict[str, Any]:
        snapshot = await self._run(LLMEngine.debug_snapshot)
        payload = stats_payload(self.model_name, snapshot.stats, snapshot.latency, self._totals())
        payload["blocks"] = list(snapshot.block_states)
        payload["recent_steps"] = [{"time": s.time, "duration_ms": s.duration_ms, "num_decode": s.num_decode,
                                    "num_prefill_tokens": s.num_prefill_tokens, "num_requests": s.num_requests}
                                   for s in snapshot.recent_steps]
        payload["chunking"] = asdict(snapshot.stats.scheduler.chunking)
        payload["config"] = {"model": self.model_name, **snapshot.config}
        return payload

    def _totals(self) -> RequestTotals:
        return self._metrics.request_totals() if self._metrics is not None else RequestTotals()


def stats_snapshot(engine: LLMEngine) -> tuple[EngineStats, LatencySummary]:
    return engine.get_stats(), engine.tracer.latency()


def trace_snapshots(engine: LLMEngine) -> list[RequestTraceSnapshot]:
    return engine.tracer.snapshots()


def trace_snapshot(engine: LLMEngine, request_id: str) -> RequestTraceSnapshot | None:
    return engine.tracer.snapshot(request_id)


def stats_payload(model_name: str, stats: EngineStats, latency: LatencySummary, totals: RequestTotals) -> dict:
    """The /v1/stats shape."""
    s, spec = stats.scheduler, stats.scheduler.spec_decode
    queries, hits = s.prefix_cache_queries, s.prefix_cache_hits
    return {
        "model": model_name, "time": time.time(),
        "num_running": s.num_running, "num_waiting": s.num_waiting, "num_swapped": s.num_swapped,
        "kv_blocks": {"total": s.num_kv_blocks, "used": s.num_kv_blocks_used, "cached": s.num_kv_blocks_cached,
                      "free": s.num_kv_blocks_free},
        "kv_cache_usage": s.kv_cache_usage,
        "prefix_cache": {"queries": queries, "hits": hits, "hit_rate": hits / queries if queries else 0.0},
        "num_preemptions": s.num_preemptions,
        "tokens": {"prompt": totals.num_prompt_tokens, "generation": totals.num_generation_tokens},
        "requests": {"finished": totals.num_finished, "aborted": totals.num_aborted},
        "latency": {"ttft_p50": latency.ttft_p50, "ttft_p90": latency.ttft_p90, "tpot_p50": latency.tpot_p50,
                    "tpot_p90": latency.tpot_p90, "window": latency.window},
        "spec_decode": {"num_draft_tokens": spec.num_draft_tokens, "num_accepted_tokens": spec.num_accepted_tokens,
                        "acceptance_rate": spec.acceptance_rate},
    }


def trace_summary(trace: RequestTraceSnapshot) -> dict[str, Any]:
    """One entry of /debug/requests; "prompt" only when prompts are stored."""
    summary = {
        "request_id": trace.request_id, "state": trace.state, "arrival_time": trace.arrival_time,
        "first_token_time": trace.first_token_time, "finish_time": trace.finish_time,
        "ttft": trace.ttft, "e2e": trace.e2e, "num_prompt_tokens": trace.num_prompt_tokens,
        "num_output_tokens": trace.num_output_tokens, "num_cached_tokens": trace.num_cached_tokens,
        "num_preemptions": trace.num_preemptions, "finish_reason": trace.finish_reason,
    }
    if trace.prompt is not None:
        summary["prompt"] = trace.prompt
    return summary


def trace_detail(trace: RequestTraceSnapshot) -> dict[str, Any]:
    """/debug/requests/{id}: the summary, the events in time order, and how many were dropped."""
    events = [{"time": e.time, "event": e.event, **e.fields} for e in trace.events]
    return {**trace_summary(trace), "events": events, "num_dropped_events": trace.num_dropped_events}
