"""GET /v1/stats (always served) and the /debug/* routes (only with --enable-debug-endpoints).

Owns turning the engine's snapshots (EngineStats, RequestTraceSnapshot, EngineDebugSnapshot) into the
JSON shapes of protocol_debug.py. Every snapshot is taken on the engine thread between steps
(`AsyncLLMEngine.inspect`), so it is consistent and nothing is read while a step changes it. The
API key guards these routes as any other (middleware.py). Knows nothing of the engine's parts.
Behind the Ray ingress (--num-replicas) each replica builds these payloads from its own engine and
the ingress merges them (replica_debug.py); the routes are the same.

Request ids are the engine's: the id the API returns (chatcmpl-..., cmpl-...), and for a completion
with several prompts `<id>-<i>` for prompt i. The n samples of one prompt share one trace.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import FastAPI

from vllmlite.api.errors import APIError, unavailable
from vllmlite.api.openapi import GUARDED, route_doc
from vllmlite.api.ops.protocol_debug import (
    DebugEngineResponse,
    ReplicasDebugEngineResponse,
    RequestDetail,
    RequestList,
    StatsResponse,
)
from vllmlite.api.ray.replica_debug import (
    ReplicaAnswers,
    engines_payload,
    find_request,
    merge_request_lists,
    merge_stats,
)
from vllmlite.engine.async_engine import AsyncLLMEngine, EngineDeadError
from vllmlite.engine.llm_engine import LLMEngine
from vllmlite.stats import EngineStats, LatencySummary, RequestTotals
from vllmlite.core.tracing import RequestTraceSnapshot

if TYPE_CHECKING:  # only for its type: the Ray module is imported by the server for --num-replicas alone
    from vllmlite.api.ray.serving import RemoteEngine

T = TypeVar("T")
READ_ERRORS = (*GUARDED, 503)


def add_stats_and_debug_routes(app: FastAPI, engine: AsyncLLMEngine | RemoteEngine, model_name: str,
                               enable_debug: bool) -> None:
    """/v1/stats always; /debug/* only when `enable_debug` (otherwise they are unknown routes: 404).
    Over a local engine, or over the Ray replicas behind the ingress (RemoteEngine): the same routes."""
    if isinstance(engine, AsyncLLMEngine):
        source: LocalDebug | ReplicaDebug = LocalDebug(engine, model_name)
        engine_doc: type = DebugEngineResponse
    else:
        source, engine_doc = ReplicaDebug(engine, model_name), ReplicasDebugEngineResponse

    @app.get("/v1/stats", **route_doc(StatsResponse, errors=READ_ERRORS))
    async def stats() -> dict:
        return await source.stats()

    if not enable_debug:
        return

    @app.get("/debug/requests", **route_doc(RequestList, errors=READ_ERRORS))
    async def debug_requests() -> dict:
        return await source.requests()

    @app.get("/debug/requests/{request_id}", **route_doc(RequestDetail, errors=(*READ_ERRORS, 404)))
    async def debug_request(request_id: str) -> dict:
        detail = await source.request(request_id)
        if detail is None:
            raise no_trace(request_id)
        return detail

    @app.get("/debug/engine", **route_doc(engine_doc, errors=READ_ERRORS))
    async def debug_engine() -> dict:
        return await source.engine()


def no_trace(request_id: str, unanswered: str = "") -> APIError:
    """The 404 for an id without a trace; `unanswered` names the replicas that could not be asked."""
    note = f" (replicas that did not answer: {unanswered})" if unanswered else ""
    return APIError(404, f"no trace of request {request_id!r}: unknown, or older than the trace ring{note}",
                    param="request_id")


class LocalDebug:
    """The routes' payloads from one local engine; also what each Ray replica answers the ingress
    with (EngineReplica.inspect). `request` is None for an id it has no trace of."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self._engine = engine
        self.model_name = model_name

    async def stats(self) -> dict[str, Any]:
        engine_stats, latency = await self._read(lambda e: (e.get_stats(), e.tracer.latency()))
        return stats_payload(self.model_name, engine_stats, latency, self._totals())

    async def requests(self) -> dict[str, Any]:
        traces = await self._read(lambda e: e.tracer.snapshots())
        return {"requests": [trace_summary(t) for t in traces]}

    async def request(self, request_id: str) -> dict[str, Any] | None:
        trace = await self._read(lambda e: e.tracer.snapshot(request_id))
        return None if trace is None else trace_detail(trace)

    async def engine(self) -> dict[str, Any]:
        snapshot = await self._read(LLMEngine.debug_snapshot)
        payload = stats_payload(self.model_name, snapshot.stats, snapshot.latency, self._totals())
        payload["blocks"] = list(snapshot.block_states)
        payload["recent_steps"] = [{"time": s.time, "duration_ms": s.duration_ms, "num_decode": s.num_decode,
                                    "num_prefill_tokens": s.num_prefill_tokens, "num_requests": s.num_requests}
                                   for s in snapshot.recent_steps]
        payload["chunking"] = asdict(snapshot.stats.scheduler.chunking)
        payload["config"] = {"model": self.model_name, **snapshot.config}
        return payload

    async def _read(self, read: Callable[[LLMEngine], T]) -> T:
        try:
            return await self._engine.inspect(read)
        except EngineDeadError as error:
            raise unavailable(str(error)) from error

    def _totals(self) -> RequestTotals:
        metrics = self._engine.metrics
        return metrics.request_totals() if metrics is not None else RequestTotals()


class ReplicaDebug:
    """The routes' payloads behind the Ray ingress: each healthy replica's LocalDebug payload, asked
    concurrently (RemoteEngine.inspect_replicas), merged by replica_debug.py. A replica that is down
    or does not answer in time is left out and named in `missing_replicas`; none answering is a 503."""

    def __init__(self, engine: RemoteEngine, model_name: str) -> None:
        self._engine = engine
        self.model_name = model_name

    async def stats(self) -> dict[str, Any]:
        return merge_stats(self.model_name, await self._ask("stats"), time.time())

    async def requests(self) -> dict[str, Any]:
        return merge_request_lists(await self._ask("requests"))

    async def request(self, request_id: str) -> dict[str, Any] | None:
        replies = await self._ask("request", request_id)
        detail = find_request(replies)
        if detail is None and replies.missing:  # it may be on a replica that did not answer
            raise no_trace(request_id, replies.describe_missing())
        return detail

    async def engine(self) -> dict[str, Any]:
        return engines_payload(self.model_name, await self._ask("engine"), time.time())

    async def _ask(self, read: str, *args: str) -> ReplicaAnswers:
        replies = await self._engine.inspect_replicas(read, *args)
        if not replies.answers:
            raise unavailable(f"no replica answered: {replies.describe_missing()}")
        return replies


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
