"""Tracing overhead: engine step time with request tracing on (the default ring) and off.

    python -m bench.trace_overhead                  # tiny random model (the worst case: shortest steps)
    python -m bench.trace_overhead --model default  # SmolLM2-135M: longer steps, so a smaller share
    python -m bench.trace_overhead --quick          # smoke test

The same workload (chunked prompts, a shared prefix that hits the prefix cache, more sequences than
fit at once, so some are preempted) runs to completion on two engines over one loaded model, tracing
off (trace_ring_size=0) and on, stepped in turn: both run the same schedule, so step i of one is
step i of the other and the machine's other load falls on both alike. Reported, over `--reps` rounds
with fresh engines: the median of each round's ratio on/off of total step time (wall, and the
process's CPU time, which a busy machine disturbs less; and the median per-step wall ratio); an
off-vs-off control of the same method; the hooks' own cost per decode step (a microbenchmark); and
what reading costs (a snapshot of every trace in a full ring; `debug_snapshot()`), which is paid
only when someone asks. Raw results: results/bench_trace_overhead.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import vllmlite  # noqa: F401  (first: it sets the thread pools' environment before numpy loads)

# isort: split
import numpy as np

from bench.report import REPO_ROOT, machine_info, module_command, write_json
from vllmlite.core.batch import ScheduledSequence, SchedulerOutput
from vllmlite.core.request import FinishReason, Request
from vllmlite.core.tracing import RequestTracer, Tracer
from vllmlite.engine.llm_engine import LLMEngine
from vllmlite.engine_args import EngineArgs
from vllmlite.models.loader import LoadedModel, load_model
from vllmlite.sampling_params import SamplingParams
from vllmlite.worker.sampling import make_generator

SHARED_PREFIX = 64  # tokens every other prompt starts with


def workload(num_requests: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompts of 16-200 tokens; every other one starts with the same 64 tokens."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(1, vocab, SHARED_PREFIX).tolist()
    prompts = []
    for i in range(num_requests):
        own = rng.integers(1, vocab, int(rng.integers(16, 200))).tolist()
        prompts.append(shared + own[:136] if i % 2 else own)
    return prompts


def make_engine(args: argparse.Namespace, loaded: LoadedModel, trace_ring_size: int) -> LLMEngine:
    config = EngineArgs(model=args.model, dtype="float32", num_blocks=args.num_blocks, max_num_seqs=32,
                        max_num_batched_tokens=256, trace_ring_size=trace_ring_size).create_engine_config()
    return LLMEngine(config, loaded)


def lockstep(engines: dict[str, LLMEngine], prompts: list[list[int]], max_tokens: int) -> dict:
    """Every prompt to completion on each engine, all queued at once, stepping the engines in turn
    (which one goes first alternates): both run the same schedule, step i on one is step i on the
    other, so a burst of load from other processes lands on both alike. Per engine: step times, wall
    and CPU (the process's CPU seconds: time spent waiting for a core, on a busy machine, is not in it)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for engine in engines.values():
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
    times: dict[str, list[float]] = {label: [] for label in engines}
    cpu: dict[str, list[float]] = {label: [] for label in engines}
    labels = list(engines)
    while any(e.has_unfinished_requests() for e in engines.values()):
        labels.reverse()
        for label in labels:
            engine = engines[label]
            if engine.has_unfinished_requests():
                started, started_cpu = time.perf_counter(), time.process_time()
                engine.step()
                times[label].append(time.perf_counter() - started)
                cpu[label].append(time.process_time() - started_cpu)
    return times, cpu


def summarize(times: list[float], engine: LLMEngine) -> dict:
    stats = engine.get_stats().scheduler
    return {"num_steps": len(times), "seconds": sum(times), "mean_step_ms": 1e3 * sum(times) / len(times),
            "median_step_ms": 1e3 * float(np.median(times)), "num_preemptions": stats.num_preemptions,
            "prefix_cache_hits": stats.prefix_cache_hits}


def median_ms(fn, reps: int = 5) -> float:
    """Median milliseconds of `reps` calls of fn()."""
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return 1e3 * float(np.median(times))


def read_costs(engine: LLMEngine) -> dict:
    """Milliseconds to snapshot every trace in the ring and to take `debug_snapshot()` (median)."""
    return {"num_traces": len(engine.tracer.snapshots()), "snapshots_ms": median_ms(engine.tracer.snapshots),
            "snapshots_with_events_ms": median_ms(lambda: engine.tracer.snapshots(with_events=True)),
            "debug_snapshot_ms": median_ms(engine.debug_snapshot)}


def hook_cost_us(tracer: Tracer, batch_size: int = 32, reps: int = 2000) -> float:
    """Microseconds the hooks of one decode step cost: `scheduled` for each of `batch_size` decoding
    sequences, then `step_done` (what every decode step calls; nothing else runs per decode)."""
    requests = [Request(str(i), list(range(20)), SamplingParams(), max_tokens=100, generator=make_generator(0))
                for i in range(batch_size)]
    for request in requests:
        tracer.arrived(request.request_id, [request], None)
        request.append_token(1)
    out = SchedulerOutput(scheduled=[ScheduledSequence(r, r.token_ids[-1:], r.num_tokens - 1, [0]) for r in requests])
    started = time.perf_counter()
    for _ in range(reps):
        step_started = time.perf_counter()
        for seq in out.scheduled:
            tracer.scheduled(seq.request, seq.start_position, 1)
        tracer.step_done(step_started, out)
    return 1e6 * (time.perf_counter() - started) / reps


def full_ring_read_ms(ring_size: int = 1000) -> dict:
    """Milliseconds to read a full ring (`ring_size` finished requests of 8 events each): the summaries
    (/debug/requests) and the same with every event."""
    tracer = RequestTracer(ring_size, 64)
    for i in range(ring_size):
        request = Request(str(i), list(range(40)), SamplingParams(), max_tokens=4, generator=make_generator(0))
        tracer.arrived(request.request_id, [request], None)
        tracer.queued(request, 1)
        tracer.admitted(request, 16)
        for start in range(16, 40, 8):
            tracer.scheduled(request, start, 8)
        request.append_token(1)
        request.finish(FinishReason.STOP)
        tracer.finished(request)
        tracer.step_done(time.perf_counter(), SchedulerOutput())
    return {"num_traces": ring_size, "summaries_ms": median_ms(tracer.snapshots),
            "with_events_ms": median_ms(lambda: tracer.snapshots(with_events=True))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--decode-tokens", type=int, default=200, help="tokens each of 4 requests decodes "
                                                                         "(the decode scenario: short steps)")
    parser.add_argument("--num-blocks", type=int, default=160, help="KV blocks of 16 tokens (small: preemptions)")
    parser.add_argument("--reps", type=int, default=5, help="rounds, each with two fresh engines")
    parser.add_argument("--quick", action="store_true", help="32 requests, 2 rounds")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "bench_trace_overhead.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.reps, args.decode_tokens = 32, 2, 20
    machine = machine_info()
    loaded = load_model(args.model, "float32", 0)
    mixed = workload(args.requests, loaded.config.vocab_size)
    decode = workload(4, loaded.config.vocab_size, seed=1)
    # The control runs tracing off on both sides: how far from 1 the method itself reads.
    scenarios = {"mixed": (mixed, args.max_tokens, 1000), "decode": (decode, args.decode_tokens, 1000),
                 "decode_control_off_vs_off": (decode, args.decode_tokens, 0)}
    results = {name: measure(args, loaded, prompts, max_tokens, ring, name)
               for name, (prompts, max_tokens, ring) in scenarios.items()}
    hooks = {"off": hook_cost_us(Tracer()), "on": hook_cost_us(RequestTracer(1000, 64))}
    report = {"machine": dict(machine, loadavg_end=list(os.getloadavg())),
              "command": module_command("bench.trace_overhead", argv), "model": args.model,
              "requests": args.requests, "max_tokens": args.max_tokens, "num_blocks": args.num_blocks,
              "decode_tokens": args.decode_tokens, "scenarios": results,
              "decode_step_hook_us_32_sequences": hooks, "full_ring_read": full_ring_read_ms()}
    write_json(args.out, report)
    for name, result in results.items():
        summary = result["summary"]
        print(f"{name}: tracing on/off step time, median ratio {summary['median_ratio_on_over_off']:.4f} (range "
              f"{summary['min_ratio']:.4f}-{summary['max_ratio']:.4f}) over {args.reps} rounds, CPU time ratio "
              f"{summary['median_cpu_ratio']:.4f}, "
              f"{summary['median_step_ms_off']:.2f} ms/step off; snapshot of {summary['num_traces']} traces "
              f"{summary['snapshots_ms']:.2f} ms, debug_snapshot {summary['debug_snapshot_ms']:.2f} ms")
    print(f"hooks of one 32-sequence decode step: {hooks['on']:.1f} us traced, {hooks['off']:.1f} us off")
    ring = report["full_ring_read"]
    print(f"reading a full ring of {ring['num_traces']} traces: summaries {ring['summaries_ms']:.1f} ms, "
          f"with events {ring['with_events_ms']:.1f} ms")
    print(f"load {machine['loadavg_start']} -> {report['machine']['loadavg_end']}; wrote {args.out}")


def measure(args: argparse.Namespace, loaded: LoadedModel, prompts: list[list[int]], max_tokens: int,
            ring_size: int, name: str) -> dict:
    """`--reps` rounds of one scenario, each with two fresh engines (tracing off and on) in lockstep."""
    rounds = []
    for rep in range(args.reps):
        engines = {"off": make_engine(args, loaded, 0), "on": make_engine(args, loaded, ring_size)}
        times, cpu = lockstep(engines, prompts, max_tokens)
        on, off = np.array(times["on"]), np.array(times["off"])
        result = {"off": summarize(times["off"], engines["off"]), "on": summarize(times["on"], engines["on"]),
                  "ratio": float(on.sum() / off.sum()), "median_step_ratio": float(np.median(on / off)),
                  "cpu_ratio": sum(cpu["on"]) / sum(cpu["off"]), "read": read_costs(engines["on"])}
        rounds.append(result)
        print(f"{name} round {rep}: {len(on)} steps, off {result['off']['mean_step_ms']:.3f} ms/step, on "
              f"{result['on']['mean_step_ms']:.3f} ms/step, ratio {result['ratio']:.4f} (median of per-step "
              f"ratios {result['median_step_ratio']:.4f}), CPU time ratio {result['cpu_ratio']:.4f}", file=sys.stderr)
    ratios = [r["ratio"] for r in rounds]
    summary = {"median_ratio_on_over_off": float(np.median(ratios)), "min_ratio": min(ratios), "max_ratio": max(ratios),
               "median_per_step_ratio": float(np.median([r["median_step_ratio"] for r in rounds])),
               "median_cpu_ratio": float(np.median([r["cpu_ratio"] for r in rounds])),
               "median_step_ms_off": float(np.median([r["off"]["mean_step_ms"] for r in rounds])),
               "median_step_ms_on": float(np.median([r["on"]["mean_step_ms"] for r in rounds])),
               "num_traces": rounds[-1]["read"]["num_traces"],
               "snapshots_ms": float(np.median([r["read"]["snapshots_ms"] for r in rounds])),
               "debug_snapshot_ms": float(np.median([r["read"]["debug_snapshot_ms"] for r in rounds]))}
    return {"num_requests": len(prompts), "max_tokens": max_tokens, "on_trace_ring_size": ring_size,
            "summary": summary, "rounds": rounds}


if __name__ == "__main__":
    main()
