"""Offline benchmark: sequential vs static batching vs the paged engine, then a shared system prompt
with prefix caching on vs off. Every row uses the same weights, sampling and KV budget.

    python bench/bench.py                      # the full run (minutes), JSON in results/
    python bench/bench.py --quick --model random   # a smoke test in seconds
    python -m bench.bench --quick --model random   # the same, as a module of the bench package

See bench/README.md for what each row and metric means.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:
    # The one sys.path edit in bench/, a shim so that `python bench/bench.py` (the documented command)
    # keeps working: run as a file, Python puts bench/ first on sys.path, where `import bench` would
    # find this file instead of the package, so the repository root takes its place. `python -m
    # bench.bench` and every other benchmark (`python -m bench.<name>`) need nothing of the kind.
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import argparse
import gc
import logging
import os
import time
from dataclasses import dataclass

import vllmlite  # noqa: F401  (first: it sets the thread pools' environment before numpy loads)

# isort: split
from bench.measure import CpuMeter, KVTrace, RowSummary, request_record, ttft_tpot_stats
from bench.report import (
    REPO_ROOT,
    check_targets,
    command_line,
    format_table,
    machine_info,
    module_command,
    write_json,
)
from bench.static_batching import run_batches
from bench.workload import BASE, FULL, QUICK, SHARED_PREFIX, BenchRequest, Workload, build_workload
from vllmlite.config import CacheConfig, EngineConfig, SchedulerConfig
from vllmlite.engine.llm_engine import LLMEngine
from vllmlite.models.loader import LoadedModel, load_model

BLOCK_SIZE = 16


@dataclass(frozen=True)
class Row:
    name: str
    workload: str                 # BASE or SHARED_PREFIX
    batch_size: int | None     # static batching group size; None = continuous batching (paged)
    prefix_caching: bool


ROWS = [
    Row("sequential", BASE, 1, False),
    Row("static_4", BASE, 4, False),
    Row("static_8", BASE, 8, False),
    Row("static_16", BASE, 16, False),
    Row("paged", BASE, None, False),
    Row("prefix_off", SHARED_PREFIX, None, False),
    Row("prefix_on", SHARED_PREFIX, None, True),
]
MAX_STATIC_BATCH = max(r.batch_size for r in ROWS if r.batch_size)  # the KV budget is sized for it


def kv_budget_tokens(workload: Workload) -> int:
    """What static batching at its largest B reserves: B * max_model_len."""
    return MAX_STATIC_BATCH * workload.max_model_len


class Progress:
    """A line per row start and finish, and a periodic line while a row runs (on stderr)."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.run_start = time.perf_counter()

    def log(self, message: str) -> None:
        sys.stderr.write(f"[{time.perf_counter() - self.run_start:7.1f}s] {message}\n")
        sys.stderr.flush()

    def observer(self, row: str, total: int):
        start = last = time.perf_counter()

        def on_step(engine: LLMEngine, finished: dict) -> None:
            nonlocal last
            now = time.perf_counter()
            if now - last < self.interval:
                return
            last = now
            stats = engine.get_stats()
            tokens = sum(len(o.outputs[0].token_ids) for o in finished.values())
            self.log(f"  {row}: {now - start:6.1f}s, {stats.num_forward_passes} passes, "
                     f"{len(finished)}/{total} done, {stats.scheduler.num_running} running, "
                     f"{tokens} tokens out of finished requests ({tokens / (now - start):.1f}/s)")
        return on_step


def build_workloads(loaded: LoadedModel, args: argparse.Namespace) -> dict[str, Workload]:
    """The base requests, and the same requests behind the shared system prompt."""
    return {name: build_workload(name, loaded.tokenizer, args.num_requests, args.lengths, args.seed)
            for name in (BASE, SHARED_PREFIX)}


def make_engine(loaded: LoadedModel, row: Row, workload: Workload, args: argparse.Namespace) -> LLMEngine:
    cache = CacheConfig(block_size=BLOCK_SIZE, num_blocks=kv_budget_tokens(workload) // BLOCK_SIZE,
                        enable_prefix_caching=row.prefix_caching)
    scheduler = SchedulerConfig(max_num_seqs=row.batch_size or args.max_num_seqs,
                                max_num_batched_tokens=args.max_num_batched_tokens,
                                max_model_len=workload.max_model_len)
    return LLMEngine(EngineConfig(model=args.model, seed=args.seed, cache=cache, scheduler=scheduler), loaded)


def run_row(loaded: LoadedModel, row: Row, workload: Workload, args: argparse.Namespace,
            progress: Progress) -> dict:
    """Run one row on a fresh engine; return its summary with per-request records."""
    engine = make_engine(loaded, row, workload, args)
    reserved = row.batch_size * workload.max_model_len if row.batch_size else None
    trace = KVTrace(BLOCK_SIZE, engine.get_stats().scheduler.num_kv_blocks, reserved)
    show = progress.observer(row.name, len(workload.requests))

    def on_step(eng: LLMEngine, finished: dict) -> None:
        trace.samples.append(eng.kv_occupancy())
        show(eng, finished)

    meter = CpuMeter()
    start = time.monotonic()
    outputs = run_batches(engine, workload.requests, row.batch_size, start, on_step)
    wall = time.monotonic() - start
    stats = engine.get_stats()
    records = [request_record(outputs[r.request_id], r.max_tokens, start) for r in workload.requests]
    summary = RowSummary(
        name=row.name, workload=row.workload,
        batching=f"static B={row.batch_size}" if row.batch_size else "continuous (paged)",
        prefix_caching=row.prefix_caching, num_requests=len(records),
        prompt_tokens=sum(r["prompt_tokens"] for r in records),
        output_tokens=sum(r["output_tokens"] for r in records), wall_time_s=wall,
        output_tokens_per_s=sum(r["output_tokens"] for r in records) / wall,
        forward_passes=stats.num_forward_passes,
        kv_utilization=trace.utilization(),
        kv_utilization_basis="tokens held / (B * max_model_len) reserved" if reserved
        else "tokens held / slots in used blocks",
        kv_budget_fraction_mean=trace.budget_fraction()[0], kv_budget_fraction_peak=trace.budget_fraction()[1],
        mean_running=sum(s.num_running for s in trace.samples) / max(len(trace.samples), 1),
        prefix_hit_rate=stats.scheduler.prefix_cache_hits / stats.scheduler.prefix_cache_queries
        if row.prefix_caching and stats.scheduler.prefix_cache_queries else None,
        num_preemptions=stats.scheduler.num_preemptions,
        all_complete=all(r["output_tokens"] == r["max_tokens"] for r in records),
        **ttft_tpot_stats(records))
    return dict(summary.to_dict(), kv_budget_tokens=kv_budget_tokens(workload),
                max_model_len=workload.max_model_len, **meter.other_load(wall), requests=records)


def warm_up(loaded: LoadedModel, workloads: dict[str, Workload], args: argparse.Namespace) -> None:
    """Touch every code path once (BLAS threads, first-call costs) before anything is timed."""
    row = Row("warmup", BASE, None, False)
    warm = [BenchRequest(r.request_id, r.prompt_token_ids, 4) for r in workloads[BASE].requests[:2]]
    engine = make_engine(loaded, row, workloads[BASE], args)
    run_batches(engine, warm, None, time.monotonic(), lambda eng, fin: None)


def mark_agreement(results: list[dict]) -> None:
    """Count, per row, requests whose greedy tokens equal those of its workload's first row."""
    reference: dict[str, dict[str, str]] = {}
    for row in results:
        ref = reference.setdefault(row["workload"], {r["request_id"]: r["output_sha1"] for r in row["requests"]})
        same = sum(ref.get(r["request_id"]) == r["output_sha1"] for r in row["requests"])
        row["agreement"] = f"{same}/{len(row['requests'])}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help='"default" (SmolLM2-135M-Instruct), "random", or a path')
    parser.add_argument("--num-requests", type=int, default=None, help="default 48 (12 with --quick)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="12 short requests: a smoke test")
    parser.add_argument("--rows", default="all", help=f"comma-separated subset of {[r.name for r in ROWS]}")
    parser.add_argument("--out", type=Path, default=None,
                        help="default results/bench_offline.json (results/bench_offline_quick.json with --quick)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=SchedulerConfig.max_num_batched_tokens)
    parser.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs,
                        help="the paged rows' concurrency limit")
    parser.add_argument("--progress-interval", type=float, default=15.0, help="seconds between progress lines")
    args = parser.parse_args(argv)
    quick = args.quick
    args.num_requests = args.num_requests or (12 if quick else 48)
    args.lengths = QUICK if quick else FULL
    args.prompt_lens = (args.lengths.prompts.low, args.lengths.prompts.high)
    args.output_lens = (args.lengths.outputs.low, args.lengths.outputs.high)
    args.system_prompt_len = args.lengths.system_prompt_len
    args.out = args.out or REPO_ROOT / "results" / ("bench_offline_quick.json" if quick else "bench_offline.json")
    names = [r.name for r in ROWS]
    args.rows = names if args.rows == "all" else [n.strip() for n in args.rows.split(",")]
    unknown = set(args.rows) - set(names)
    if unknown:
        parser.error(f"unknown rows {sorted(unknown)}; choose from {names}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    progress = Progress(args.progress_interval)
    machine = machine_info()
    loaded = load_model(args.model, "float32", args.seed)
    workloads = build_workloads(loaded, args)
    progress.log(f"model {loaded.source}; {args.num_requests} requests; rows {', '.join(args.rows)}")
    warm_up(loaded, workloads, args)
    results = []
    for row in [r for r in ROWS if r.name in args.rows]:
        progress.log(f"start {row.name}")
        results.append(run_row(loaded, row, workloads[row.workload], args, progress))
        gc.collect()  # drop the previous engine's KV arrays before the next row allocates its own
        r = results[-1]
        other = r["other_cpu_load_cores"]
        progress.log(f"done  {row.name}: {r['wall_time_s']:.1f}s, {r['output_tokens_per_s']:.1f} tok/s, "
                     f"other processes used {other if other is not None else float('nan'):.2f} cores meanwhile")
    mark_agreement(results)
    targets = check_targets({r["name"]: r for r in results})
    machine["loadavg_end"] = list(os.getloadavg())
    report = {
        "benchmark": "offline", "command": command_line(sys.argv) if argv is None and not __package__
        else module_command("bench.bench", argv),
        "total_wall_time_s": time.perf_counter() - progress.run_start, "machine": machine,
        "settings": {"model": loaded.source, "dtype": "float32", "seed": args.seed, "block_size": BLOCK_SIZE,
                     "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                     "sampling": "greedy (temperature 0), ignore_eos, max_tokens = drawn output length",
                     "num_requests": args.num_requests, "prompt_lens": args.prompt_lens,
                     "output_lens": args.output_lens, "system_prompt_len": args.system_prompt_len,
                     "lengths": "lognormal, median = sqrt(low * high), sigma = ln(high / low) / 4, clipped",
                     "workloads": {w.name: {"max_model_len": w.max_model_len, "kv_budget_tokens": kv_budget_tokens(w),
                                            "num_blocks": kv_budget_tokens(w) // BLOCK_SIZE}
                                   for w in workloads.values()}},
        "rows": results, "targets": targets,
    }
    write_json(args.out, report)
    print(f"\n{report['command']}  (total {report['total_wall_time_s']:.0f} s, model {loaded.source})\n")
    print(format_table(results))
    print()
    for t in targets:
        print(f"{'MET   ' if t['met'] else 'MISSED'} {t['name']}: {t['value']:.2f} (target >= {t['threshold']})")
    print(f"\nraw JSON: {args.out}")
    return report


if __name__ == "__main__":
    main()
