"""The JSON shapes of /v1/stats and the /debug/* routes (the contract a dashboard reads).

Pydantic models used for the OpenAPI document and by the tests to check answers; the routes in
debug.py build plain dicts of exactly these shapes. Times are unix seconds, durations seconds unless
the key ends in _ms. Knows nothing of the engine.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

RequestState = Literal["waiting", "running", "swapped", "finished", "aborted"]
EventName = Literal["arrived", "queued", "scheduled", "prefix_hit", "prefill_chunk", "first_token", "preempted",
                    "swapped_in", "resumed", "speculative", "finished", "aborted"]


class _Shape(BaseModel):
    model_config = ConfigDict(extra="forbid")


class KVBlockCounts(_Shape):
    total: int
    used: int    # referenced by some request
    cached: int  # published in the prefix cache, used or not
    free: int    # referenced by none (evictable cached blocks included)


class PrefixCacheCounts(_Shape):
    queries: int     # tokens, cumulative
    hits: int        # tokens, cumulative
    hit_rate: float


class TokenCounts(_Shape):
    prompt: int
    generation: int


class RequestCounts(_Shape):
    finished: int
    aborted: int


class LatencyPercentiles(_Shape):
    ttft_p50: float | None
    ttft_p90: float | None
    tpot_p50: float | None
    tpot_p90: float | None
    window: int  # finished requests the percentiles were taken over (at most 100)


class SpecDecodeCounts(_Shape):
    num_draft_tokens: int
    num_accepted_tokens: int
    acceptance_rate: float


class EngineStatsShape(_Shape):
    """One engine's queues, KV blocks, cumulative counts and recent latency."""

    model: str
    time: float
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_blocks: KVBlockCounts
    kv_cache_usage: float
    prefix_cache: PrefixCacheCounts
    num_preemptions: int
    tokens: TokenCounts
    requests: RequestCounts
    latency: LatencyPercentiles
    spec_decode: SpecDecodeCounts


class ReplicaError(_Shape):
    """A replica left out of an answer behind the Ray ingress, and why (down, failed, no answer in time)."""

    replica: int
    error: str


class ReplicaStats(EngineStatsShape):
    """One replica's own /v1/stats."""

    replica: int


class StatsResponse(EngineStatsShape):
    """GET /v1/stats: queues, KV blocks, cumulative counts and recent latency. Behind the Ray ingress
    (--num-replicas) the counts are summed over the replicas that answered, rates recomputed from the
    sums, and each latency percentile is the largest replica's; `replicas` and `missing_replicas`
    are present only there."""

    replicas: list[ReplicaStats] | None = None
    missing_replicas: list[ReplicaError] | None = None


class StepShape(_Shape):
    time: float
    duration_ms: float
    num_decode: int
    num_prefill_tokens: int
    num_requests: int


class StepTimeFitShape(_Shape):
    """The fitted step-time model (vllmlite/core/chunking.py): ms ~= intercept + per row * decode rows +
    per token * prefill tokens + per kpair * thousands of attention (query, key) pairs + per
    ktoken * thousands of tokens before the prefill chunks + per prefill step, if it has any."""

    intercept_ms: float
    per_decode_row_ms: float
    per_prefill_token_ms: float
    per_attention_kpair_ms: float
    per_context_ktoken_ms: float
    per_prefill_step_ms: float
    rms_error_ms: float
    num_observations: int


class ChunkingShape(_Shape):
    """The chunked-prefill policy's last decision (`prefill_chunking`: fixed or adaptive)."""

    policy: Literal["fixed", "adaptive"]
    target_tpot_ms: float | None
    prefill_budget: int            # prompt tokens the last step allowed
    per_request_budget: int        # of which one prompt could take at most this
    budget_by_time: int | None     # adaptive: the largest share meeting the target
    budget_by_memory: int | None   # adaptive: the share the free blocks allow
    predicted_step_ms: float | None
    last_step_ms: float | None
    step_time_model: StepTimeFitShape


class DebugEngineResponse(EngineStatsShape):
    """GET /debug/engine: /v1/stats plus each block's state, recent steps, the chunked-prefill
    policy's last decision and the effective config."""

    blocks: list[Literal[0, 1, 2, 3]]  # per block id: 0 free, 1 used, 2 cached and free, 3 cached and used
    recent_steps: list[StepShape]      # oldest first, at most 256
    chunking: ChunkingShape
    config: dict[str, Any]


class ReplicaDebugEngine(DebugEngineResponse):
    """One replica's own /debug/engine."""

    replica: int


class ReplicasDebugEngineResponse(_Shape):
    """GET /debug/engine behind the Ray ingress: each replica's /debug/engine, by replica index."""

    model: str
    time: float
    replicas: list[ReplicaDebugEngine]
    missing_replicas: list[ReplicaError]


class TraceEventShape(_Shape):
    """One event; besides time and name, only the fields its kind has."""

    time: float
    event: EventName
    num_waiting: int | None = None       # queued
    num_tokens: int | None = None        # prefix_hit, prefill_chunk
    start: int | None = None             # prefill_chunk
    mode: Literal["recompute", "swap"] | None = None  # preempted
    num_draft_tokens: int | None = None  # speculative (summed over the request's rounds)
    num_accepted: int | None = None      # speculative
    reason: str | None = None            # finished
    why: str | None = None               # aborted
    sample: int | None = None            # an extra sample (n > 1) this event is about


class RequestSummary(_Shape):
    request_id: str
    state: RequestState
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    ttft: float | None
    e2e: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    finish_reason: str | None
    prompt: str | None = None  # present only when the server stores prompts (--debug-store-prompts)
    replica: int | None = None  # present only behind the Ray ingress: the replica that served it


class RequestList(_Shape):
    """GET /debug/requests: live requests first (oldest first), then recently finished ones, newest
    first. Behind the Ray ingress: every replica's, in that order, each with its `replica`."""

    requests: list[RequestSummary]
    missing_replicas: list[ReplicaError] | None = None  # present only behind the Ray ingress


class RequestDetail(RequestSummary):
    """GET /debug/requests/{request_id}: the summary and its events in time order."""

    events: list[TraceEventShape]
    num_dropped_events: int  # events past the per-request cap, counted but not kept
