"""The serving benchmark's arrival processes and per-run summary (in the manner of `vllm bench serve`).

Owns when requests are released and how a run's request results become one summary; sends nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from bench.measure import percentile
from bench.serve.client import RequestResult

BURST, POISSON, CONCURRENCY = "burst", "poisson", "concurrency"
STAT_QUANTILES = (50, 90, 99)


@dataclass(frozen=True)
class Arrival:
    """How requests arrive: all at t = 0 (burst), a Poisson process at `rate` req/s, or all at
    t = 0 but at most `concurrency` in flight."""

    kind: str
    rate: float | None = None
    concurrency: int | None = None

    @classmethod
    def parse(cls, text: str) -> Arrival:
        """'burst', 'poisson:4' (4 req/s) or 'concurrency:8'."""
        kind, _, value = text.strip().partition(":")
        if kind == BURST and not value:
            return cls(BURST)
        if kind == POISSON and value and float(value) > 0:
            return cls(POISSON, rate=float(value))
        if kind == CONCURRENCY and value and int(value) > 0:
            return cls(CONCURRENCY, concurrency=int(value))
        raise ValueError(f"bad arrival {text!r}: use burst, poisson:RATE or concurrency:N")

    @property
    def label(self) -> str:
        if self.kind == POISSON:
            return f"poisson:{self.rate:g}"
        if self.kind == CONCURRENCY:
            return f"concurrency:{self.concurrency}"
        return BURST

    def schedule(self, num_requests: int, seed: int) -> list[float]:
        """Release times in seconds from the run's start; the same seed gives every target the same.

        Poisson: exponential gaps with mean 1 / rate, the first request at 0.
        """
        if self.kind != POISSON:
            return [0.0] * num_requests
        gaps = np.random.default_rng(seed).exponential(1.0 / self.rate, size=num_requests)  # [num_requests]
        gaps[0] = 0.0
        return np.cumsum(gaps).tolist()


def distribution(values: list[float], unit_scale: float = 1.0) -> dict[str, float]:
    """mean, p50, p90, p99 of finite values (times `unit_scale`); NaN when there are none."""
    finite = [v * unit_scale for v in values if not math.isnan(v)]
    stats = {"mean": float(np.mean(finite)) if finite else math.nan}
    stats.update({f"p{q}": percentile(finite, q) for q in STAT_QUANTILES})
    return stats


def summarize(results: list[RequestResult]) -> dict:
    """One run: counts, throughput over the run's duration (first send to last finish), latency stats
    in milliseconds, and whether every request received exactly its max_tokens tokens."""
    ok = [r for r in results if r.error is None]
    start = min((r.sent_s for r in results if not math.isnan(r.sent_s)), default=math.nan)
    end = max((r.sent_s + r.e2e_s for r in results if not math.isnan(r.e2e_s)), default=math.nan)
    duration = end - start
    output_tokens = sum(r.output_tokens or 0 for r in ok)
    input_tokens = sum(r.prompt_tokens for r in ok)
    return {
        "num_requests": len(results), "completed": len(ok), "errors": len(results) - len(ok),
        "num_exact_max_tokens": sum(r.is_exact for r in results),
        "all_exact_max_tokens": all(r.is_exact for r in results),
        "duration_s": duration, "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else math.nan,
        "output_throughput": output_tokens / duration if duration > 0 else math.nan,
        "total_token_throughput": (input_tokens + output_tokens) / duration if duration > 0 else math.nan,
        "ttft_ms": distribution([r.ttft_s for r in ok], 1000.0),
        "tpot_ms": distribution([r.tpot_s for r in ok], 1000.0),
        "itl_ms": distribution([gap for r in ok for gap in r.itl_s], 1000.0),
        "e2e_ms": distribution([r.e2e_s for r in ok], 1000.0),
        "cached_tokens": sum(r.cached_tokens or 0 for r in ok),
        "mean_tokens_per_chunk": output_tokens / max(sum(r.num_chunks for r in ok), 1),
    }
