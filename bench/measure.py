"""What the benchmarks measure: the time of a call (`timed`, shared by every bench), KV occupancy after
every step (`LLMEngine.kv_occupancy()`), per-request latency records, and one summary per row. Reads
engine stats and outputs; never changes them.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from vllmlite.outputs import RequestOutput
from vllmlite.stats import KVOccupancy


@dataclass(frozen=True)
class Timing:
    """Each timed call of a function: wall and process-CPU seconds, and what the last call returned."""

    wall_s: list[float]
    cpu_s: list[float]
    result: Any = None

    @property
    def median_s(self) -> float:
        return float(np.median(self.wall_s))

    @property
    def mean_s(self) -> float:
        return float(np.mean(self.wall_s))


def timed(fn: Callable[[], Any], *, reps: int = 1, min_seconds: float = 0.0, warm_up: bool = False) -> Timing:
    """Time fn(): `reps` calls at least, and more until `min_seconds` have passed; with `warm_up`,
    one untimed call first (compiling, first touches of memory)."""
    if warm_up:
        fn()
    wall_s, cpu_s, result = [], [], None
    start = time.perf_counter()
    while len(wall_s) < reps or time.perf_counter() - start < min_seconds:
        wall, cpu = time.perf_counter(), time.process_time()
        result = fn()
        wall_s.append(time.perf_counter() - wall)
        cpu_s.append(time.process_time() - cpu)
    return Timing(wall_s, cpu_s, result)


def interleaved(fns: dict[str, Callable[[], Any]], *, rounds: int = 3, min_seconds: float = 0.0) -> dict[str, list[float]]:
    """Wall seconds of each fn, called in turn round after round (`rounds` at least, more until
    `min_seconds` have passed), after one untimed call of each. A ratio of two of them then compares
    times taken under the same conditions: timed one after the other in blocks, a machine that
    slows down between the blocks moves the ratio (rows of bench.step_bench's 32 x 512 int8 decode
    step swung 1.33-1.94 so on a 2-core EPYC)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    start, done = time.perf_counter(), 0
    while done < rounds or time.perf_counter() - start < min_seconds:
        done += 1
        for name, fn in fns.items():
            wall = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - wall)
    return times


@dataclass
class KVTrace:
    """KV samples of one row. `reserved_tokens` is set for static batching (B * max_model_len)."""

    block_size: int
    num_blocks: int
    reserved_tokens: int | None = None
    samples: list[KVOccupancy] = field(default_factory=list)

    def utilization(self) -> float:
        """Mean over steps of tokens held / slots reserved (static) or / slots in used blocks (paged)."""
        ratios = [s.held_tokens / self._capacity(s) for s in self.samples if self._capacity(s) > 0]
        return float(np.mean(ratios)) if ratios else math.nan

    def _capacity(self, sample: KVOccupancy) -> int:
        if self.reserved_tokens is not None:
            return self.reserved_tokens
        return sample.used_blocks * self.block_size

    def budget_fraction(self) -> tuple[float, float]:
        """(mean, peak) fraction of the KV budget in use: reserved slots (static) or used blocks (paged)."""
        budget = self.num_blocks * self.block_size
        if self.reserved_tokens is not None:
            fraction = self.reserved_tokens / budget
            return fraction, fraction
        used = [s.used_blocks / self.num_blocks for s in self.samples] or [math.nan]
        return float(np.mean(used)), float(np.max(used))


def request_record(output: RequestOutput, max_tokens: int, start: float) -> dict:
    """One finished request: lengths, latencies from the run's start (seconds), a hash of its tokens."""
    token_ids = output.outputs[0].token_ids
    num_output = len(token_ids)
    first = output.metrics.first_token_time  # None only if the request failed before any token
    ttft = first - start if first is not None else math.nan
    e2e = output.metrics.finished_time - start
    tpot = (e2e - ttft) / (num_output - 1) if num_output > 1 else math.nan
    digest = hashlib.sha1(np.asarray(token_ids, dtype=np.int64).tobytes()).hexdigest()[:12]
    return {"request_id": output.request_id, "prompt_tokens": len(output.prompt_token_ids),
            "max_tokens": max_tokens, "output_tokens": num_output, "cached_tokens": output.num_cached_tokens,
            "ttft_s": ttft, "e2e_s": e2e, "tpot_s": tpot, "num_preemptions": output.metrics.num_preemptions,
            "finish_reason": output.outputs[0].finish_reason, "output_sha1": digest}


@dataclass
class RowSummary:
    name: str
    workload: str
    batching: str
    prefix_caching: bool
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    wall_time_s: float
    output_tokens_per_s: float
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_mean_s: float
    e2e_mean_s: float
    forward_passes: int
    kv_utilization: float
    kv_utilization_basis: str
    kv_budget_fraction_mean: float
    kv_budget_fraction_peak: float
    mean_running: float
    prefix_hit_rate: float | None
    num_preemptions: int
    all_complete: bool  # every request produced exactly max_tokens tokens

    def to_dict(self) -> dict:
        return asdict(self)


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


def ttft_tpot_stats(records: list[dict]) -> dict[str, float]:
    ttft = [r["ttft_s"] for r in records]
    tpot = [r["tpot_s"] for r in records if not math.isnan(r["tpot_s"])]
    return {"ttft_mean_s": float(np.mean(ttft)), "ttft_p50_s": percentile(ttft, 50),
            "ttft_p99_s": percentile(ttft, 99), "tpot_mean_s": float(np.mean(tpot)) if tpot else math.nan,
            "e2e_mean_s": float(np.mean([r["e2e_s"] for r in records]))}


class CpuMeter:
    """CPU the rest of the machine used while a row ran, in cores: (machine busy - this process) / wall.

    The benchmark shares its cores with whatever else runs; a row with a high value was slowed by it.
    Reads /proc/stat (Linux); elsewhere reports None.
    """

    def __init__(self) -> None:
        self._start = self._read()

    @staticmethod
    def _read() -> tuple[float, float, float] | None:
        try:
            fields = [int(x) for x in open("/proc/stat").readline().split()[1:9]]
        except (OSError, ValueError):
            return None
        tick = os.sysconf("SC_CLK_TCK")
        user, nice, system, _idle, _iowait, irq, softirq, steal = fields
        own = os.times()
        return ((user + nice + system + irq + softirq) / tick, steal / tick, own.user + own.system)

    def other_load(self, wall: float) -> dict[str, float | None]:
        end = self._read()
        if self._start is None or end is None or wall <= 0:
            return {"other_cpu_load_cores": None, "steal_cores": None}
        busy, steal, own = (e - s for e, s in zip(end, self._start))
        return {"other_cpu_load_cores": max(busy - own, 0.0) / wall, "steal_cores": steal / wall}
