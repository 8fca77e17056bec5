"""GET /v1/stats: the engine's numbers as one JSON object, in the shape of the debug API contract
(/work/shared-notes/debug_api_contract.md), built only from `AsyncLLMEngine.get_stats()` and the
metrics' totals. A minimal version for the web page's dashboard; the tracing work's fuller one
(a latency window over recent requests) replaces `add_stats_route` whole.

Owns the JSON shape; knows nothing of the page that reads it.
"""

from __future__ import annotations

import time

from fastapi import FastAPI

from vllmlite.api.openapi import route_doc
from vllmlite.async_engine import AsyncLLMEngine
from vllmlite.metrics import MetricTotals

STATS_SCHEMA = {"type": "object", "required": ["model", "time", "num_running", "num_waiting", "num_swapped",
                                               "kv_blocks", "prefix_cache", "tokens", "requests", "latency"]}


def stats_body(engine: AsyncLLMEngine, model_name: str) -> dict:
    """The contract's /v1/stats object. Latency quantiles are estimated from the metrics' histograms
    over every request so far (`window` is that count), None before the first."""
    stats = engine.get_stats()
    s, spec = stats.scheduler, stats.scheduler.spec_decode
    totals = engine.metrics.totals() if engine.metrics is not None else MetricTotals()
    return {
        "model": model_name,
        "time": time.time(),
        "num_running": s.num_running, "num_waiting": s.num_waiting, "num_swapped": s.num_swapped,
        "kv_blocks": {"total": s.num_kv_blocks, "used": s.num_kv_blocks_used, "cached": s.num_kv_blocks_cached,
                      "free": s.num_kv_blocks_free},
        "kv_cache_usage": s.kv_cache_usage,
        "prefix_cache": {"queries": s.prefix_cache_queries, "hits": s.prefix_cache_hits,
                         "hit_rate": s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0},
        "num_preemptions": s.num_preemptions,
        "tokens": {"prompt": totals.prompt_tokens, "generation": totals.generation_tokens},
        "requests": {"finished": sum(n for reason, n in totals.finished.items() if reason != "abort"),
                     "aborted": totals.finished.get("abort", 0)},
        "latency": {"ttft_p50": totals.ttft_p50, "ttft_p90": totals.ttft_p90, "tpot_p50": totals.tpot_p50,
                    "tpot_p90": totals.tpot_p90, "window": totals.num_latency_requests},
        "spec_decode": {"num_draft_tokens": spec.num_draft_tokens, "num_accepted_tokens": spec.num_accepted_tokens,
                        "acceptance_rate": spec.acceptance_rate},
    }


def add_stats_route(app: FastAPI, engine: AsyncLLMEngine, model_name: str) -> None:
    @app.get("/v1/stats", **route_doc(STATS_SCHEMA))
    async def v1_stats() -> dict:
        return stats_body(engine, model_name)
