"""The engine's numbers as plain snapshots: what the async engine, the metrics and the API may read.

Data only, no logic beyond derived properties. `Scheduler.make_stats()` fills `SchedulerStats`,
`LLMEngine.get_stats()` wraps it in `EngineStats`. Counts marked cumulative never decrease.
A snapshot is new each call and never changed after it is made, so it may cross threads (not frozen:
a frozen dataclass costs several times more to build, and one is built every step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class SpecDecodeStats:
    """Speculative decoding, cumulative: rounds, guesses scored, guesses kept."""

    num_drafts: int = 0                  # rounds that scored at least one guess
    num_draft_tokens: int = 0            # guesses scored
    num_accepted_tokens: int = 0         # of those, kept
    accepted_per_position: tuple[int, ...] = ()  # [k]: rounds whose guess i was kept

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


@dataclass(slots=True)
class StepTimeFit:
    """The fitted step-time model: step ms ~= intercept + per row * decode rows + per token * prefill
    tokens + per kpair * thousands of attention (query, key) pairs + per ktoken * thousands of
    tokens before the prefill chunks + per prefill step, if the step has any (vllmlite/core/chunking.py)."""

    intercept_ms: float = 0.0
    per_decode_row_ms: float = 0.0
    per_prefill_token_ms: float = 0.0
    per_attention_kpair_ms: float = 0.0
    per_context_ktoken_ms: float = 0.0
    per_prefill_step_ms: float = 0.0
    rms_error_ms: float = 0.0            # of the fit over the steps it was fitted to
    num_observations: int = 0            # steps measured, cumulative


@dataclass(slots=True)
class ChunkingStats:
    """The chunked-prefill policy's last decision: prompt tokens the last step allowed (in all and
    per prompt), the limits the adaptive policy took it from, and the step time it predicted."""

    policy: str = ""                     # "fixed" or "adaptive" (the prefill_chunking knob)
    target_tpot_ms: float | None = None  # adaptive: the last step's target (None under fixed)
    prefill_budget: int = 0              # prompt tokens the last step allowed
    per_request_budget: int = 0          # of which one prompt could take at most this
    budget_by_time: int | None = None    # adaptive: the largest share meeting the target
    budget_by_memory: int | None = None  # adaptive: the share the free blocks allow
    predicted_step_ms: float | None = None
    last_step_ms: float | None = None    # the last step measured (schedule to outputs)
    step_time_model: StepTimeFit = field(default_factory=StepTimeFit)


@dataclass(slots=True)
class SchedulerStats:
    """Requests by state and the device KV blocks, right after a step.

    Blocks: used + free == total; cached blocks (published in the prefix cache) may be used or free.
    Prefix queries and hits are in tokens, counted once per admitted request (vLLM's metrics).
    """

    num_running: int = 0
    num_waiting: int = 0                 # queued, or preempted by recompute
    num_swapped: int = 0                 # preempted by swap: KV in the host arena
    num_kv_blocks: int = 0
    num_kv_blocks_used: int = 0          # referenced by some request
    num_kv_blocks_cached: int = 0        # published in the prefix cache, referenced or not
    num_kv_blocks_free: int = 0          # referenced by none (evictable cached blocks included)
    prefix_cache_queries: int = 0        # tokens, cumulative
    prefix_cache_hits: int = 0           # tokens, cumulative
    num_preemptions: int = 0             # cumulative
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    chunking: ChunkingStats = field(default_factory=ChunkingStats)

    @property
    def num_not_running(self) -> int:
        """Requests admitted to the engine but not running: the queue bound and `num_requests_waiting`."""
        return self.num_waiting + self.num_swapped

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of device blocks in use, in [0, 1]."""
        return self.num_kv_blocks_used / self.num_kv_blocks if self.num_kv_blocks else 0.0


@dataclass(slots=True)
class EngineStats:
    """The scheduler's snapshot plus what the engine itself counts."""

    scheduler: SchedulerStats = field(default_factory=SchedulerStats)
    num_unfinished_requests: int = 0     # user requests (an n > 1 group counts once)
    num_forward_passes: int = 0          # target model, cumulative
    num_draft_forward_passes: int = 0    # draft model (speculative decoding), cumulative


@dataclass(slots=True)
class KVOccupancy:
    """How full the device KV blocks are, right after a step (`LLMEngine.kv_occupancy()`, for
    benchmarks: it walks every running request's block table, so it is not part of a step's stats)."""

    held_tokens: int   # tokens whose K/V running requests hold, counted once per block even when shared
    used_blocks: int   # blocks referenced by some request
    num_running: int


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One engine step: when it ended (unix seconds), how long it took, and its batch's shape."""

    time: float
    duration_ms: float
    num_decode: int          # sequences computing one new token (a speculative round counts as one)
    num_prefill_tokens: int  # tokens of the other sequences (prompt chunks, re-prefill after preemption)
    num_requests: int


@dataclass(frozen=True, slots=True)
class LatencySummary:
    """TTFT and time per output token (seconds) over the last `window` finished requests; None when
    no request in the window has the tokens to measure it."""

    ttft_p50: float | None = None
    ttft_p90: float | None = None
    tpot_p50: float | None = None
    tpot_p90: float | None = None
    window: int = 0


@dataclass(frozen=True, slots=True)
class EngineDebugSnapshot:
    """What /debug/engine shows, taken on the engine thread between steps (`LLMEngine.debug_snapshot()`)."""

    stats: EngineStats
    block_states: bytes                  # per device block id: 0 free, 1 used, 2 cached and free, 3 cached and used
    recent_steps: tuple[StepRecord, ...]  # oldest first; empty when tracing is off
    latency: LatencySummary
    config: dict[str, Any]               # the effective engine config as plain JSON values


@dataclass(frozen=True, slots=True)
class RequestTotals:
    """Cumulative serving counts, as the metrics counted them (`EngineMetrics.totals()`)."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_finished: int = 0   # ended for any reason but an abort (stop, length, error)
    num_aborted: int = 0
