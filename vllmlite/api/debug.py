"""GET /v1/stats (always served) and the /debug/* routes (only with --enable-debug-endpoints).

Owns turning the engine's snapshots (EngineStats, RequestTraceSnapshot, EngineDebugSnapshot) into the
JSON shapes of protocol_debug.py. Every snapshot is taken on the engine thread between steps
(`AsyncLLMEngine.inspect`), so it is consistent and nothing is read while a step changes it. The
API key guards these routes as any other (middleware.py). Knows nothing of the engine's parts.

Request ids are the engine's: the id the API returns (chatcmpl-..., cmpl-...), and for a completion
with several prompts `<id>-<i>` for prompt i. The n samples of one prompt share one trace.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import FastAPI

from vllmlite.api.errors import APIError, unavailable
from vllmlite.api.openapi import GUARDED, route_doc
from vllmlite.api.protocol_debug import DebugEngineResponse, RequestDetail, RequestList, StatsResponse
from vllmlite.async_engine import AsyncLLMEngine, EngineDeadError
from vllmlite.engine import LLMEngine
from vllmlite.stats import EngineStats, LatencySummary, RequestTotals
from vllmlite.tracing import RequestTraceSnapshot

T = TypeVar("T")
READ_ERRORS = (*GUARDED, 503)


def add_stats_and_debug_routes(app: FastAPI, engine: AsyncLLMEngine, model_name: str, enable_debug: bool) -> None:
    """/v1/stats always; /debug/* only when `enable_debug` (otherwise they are unknown routes: 404).
    None of them over an engine that is not a local AsyncLLMEngine (Ray replicas): nothing to inspect."""
    if not isinstance(engine, AsyncLLMEngine):
        return

    @app.get("/v1/stats", **route_doc(StatsResponse, errors=READ_ERRORS))
    async def stats() -> dict:
        engine_stats, latency = await _read(engine, lambda e: (e.get_stats(), e.tracer.latency()))
        return stats_payload(model_name, engine_stats, latency, _totals(engine))

    if not enable_debug:
        return

    @app.get("/debug/requests", **route_doc(RequestList, errors=READ_ERRORS))
    async def debug_requests() -> dict:
        traces = await _read(engine, lambda e: e.tracer.snapshots())
        return {"requests": [trace_summary(t) for t in traces]}

    @app.get("/debug/requests/{request_id}", **route_doc(RequestDetail, errors=(*READ_ERRORS, 404)))
    async def debug_request(request_id: str) -> dict:
        trace = await _read(engine, lambda e: e.tracer.snapshot(request_id))
        if trace is None:
            raise APIError(404, f"no trace of request {request_id!r}: unknown, or older than the trace ring",
                           param="request_id")
        return trace_detail(trace)

    @app.get("/debug/engine", **route_doc(DebugEngineResponse, errors=READ_ERRORS))
    async def debug_engine() -> dict:
        snapshot = await _read(engine, LLMEngine.debug_snapshot)
        payload = stats_payload(model_name, snapshot.stats, snapshot.latency, _totals(engine))
        payload["blocks"] = list(snapshot.block_states)
        payload["recent_steps"] = [{"time": s.time, "duration_ms": s.duration_ms, "num_decode": s.num_decode,
                                    "num_prefill_tokens": s.num_prefill_tokens, "num_requests": s.num_requests}
                                   for s in snapshot.recent_steps]
        payload["config"] = {"model": model_name, **snapshot.config}
        return payload


async def _read(engine: AsyncLLMEngine, read: Callable[[LLMEngine], T]) -> T:
    try:
        return await engine.inspect(read)
    except EngineDeadError as error:
        raise unavailable(str(error)) from error


def _totals(engine: AsyncLLMEngine) -> RequestTotals:
    return engine.metrics.request_totals() if engine.metrics is not None else RequestTotals()


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
