"""GET /v1/stats (always served) and the /debug/* routes (only with --enable-debug-endpoints).

Owns the routes and their errors: each answers with the engine's named read of the same name
(`EngineClient.inspect`: engine/inspection.py builds the payloads of a local engine, and behind the
Ray ingress the replicas' payloads are merged, api/ray/replica_debug.py), in the shapes of
protocol_debug.py. An engine that cannot answer is a 503; an id without a trace a 404. The API key
guards these routes as any other (middleware.py). Knows nothing of which engine answers.
"""

from __future__ import annotations

from typing import Any

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
from vllmlite.engine.client import EngineClient
from vllmlite.engine.exceptions import EngineDeadError

READ_ERRORS = (*GUARDED, 503)


def add_stats_and_debug_routes(app: FastAPI, engine: EngineClient, enable_debug: bool,
                               replicated: bool = False) -> None:
    """/v1/stats always; /debug/* only when `enable_debug` (otherwise they are unknown routes: 404).
    `replicated`: the engine is the Ray ingress, whose /debug/engine lists its replicas' (the
    documented shape differs; the routes are the same)."""
    @app.get("/v1/stats", **route_doc(StatsResponse, errors=READ_ERRORS))
    async def stats() -> dict:
        return await read_payload(engine, "stats")

    if not enable_debug:
        return

    @app.get("/debug/requests", **route_doc(RequestList, errors=READ_ERRORS))
    async def debug_requests() -> dict:
        return await read_payload(engine, "requests")

    @app.get("/debug/requests/{request_id}", **route_doc(RequestDetail, errors=(*READ_ERRORS, 404)))
    async def debug_request(request_id: str) -> dict:
        detail = await read_payload(engine, "request", request_id)
        if detail is None:
            raise no_trace(request_id)
        return detail

    engine_doc = ReplicasDebugEngineResponse if replicated else DebugEngineResponse

    @app.get("/debug/engine", **route_doc(engine_doc, errors=READ_ERRORS))
    async def debug_engine() -> dict:
        return await read_payload(engine, "engine")


async def read_payload(engine: EngineClient, read: str, *args: str) -> Any:
    """`engine.inspect(read, *args)`; an engine that cannot answer is a 503."""
    try:
        return await engine.inspect(read, *args)
    except EngineDeadError as error:
        raise unavailable(str(error)) from error


def no_trace(request_id: str, unanswered: str = "") -> APIError:
    """The 404 for an id without a trace; `unanswered` names the replicas that could not be asked."""
    note = f" (replicas that did not answer: {unanswered})" if unanswered else ""
    return APIError(404, f"no trace of request {request_id!r}: unknown, or older than the trace ring{note}",
                    param="request_id")
