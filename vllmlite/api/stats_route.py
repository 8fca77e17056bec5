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

STATS_SCHEMA = {"type": "object", "required": ["model", "time", "num_running", "num_waiting", "num_swapped",
                                               "kv_blocks", "prefix_cache", "tokens", "requests", "latency"]}


def stats_body(engine: AsyncLLMEngine, model_name: str) -> dict:
    """The contract's /v1/stats object. Latency quantiles are estimated from the metrics' histograms
    over every request so far (`window` is that count), None before the first."""
    stats = engine.get_stats()
    s, spec = stats.scheduler, stats.scheduler.spec_decode
    totals = engine.metrics.totals() if engine.metrics is not None else {}
    finished = totals.get("finished", {})
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
        "tokens": {"prompt": totals.get("prompt_tokens", 0), "generation": totals.get("generation_tokens", 0)},
        "requests": {"finished": sum(n for reason, n in finished.items() if reason != "abort"),
                     "aborted": finished.get("abort", 0)},
        "latency": {"ttft_p50": totals.get("ttft_p50"), "ttft_p90": totals.get("ttft_p90"),
                    "tpot_p50": totals.get("tpot_p50"), "tpot_p90": totals.get("tpot_p90"),
                    "window": totals.get("num_latency_requests", 0)},
        "spec_decode": {"num_draft_tokens": spec.num_draft_tokens, "num_accepted_tokens": spec.num_accepted_tokens,
                        "acceptance_rate": spec.acceptance_rate},
    }


def add_stats_route(app: FastAPI, engine: AsyncLLMEngine, model_name: str) -> None:
    @app.get("/v1/stats", **route_doc(STATS_SCHEMA))
    async def v1_stats() -> dict:
        return stats_body(engine, model_name)
