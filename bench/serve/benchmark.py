"""Serving benchmark, in the manner of `vllm bench serve`: stream completions from OpenAI-compatible
servers under a workload and an arrival process, several servers back to back, side by side.

    python -m bench.serve --launch ""                                   # our server, 48-request burst
    python -m bench.serve --launch "static=--batching static --max-num-seqs 16" \\
        --launch "continuous=--no-enable-prefix-caching" --launch-llama "llama.cpp=-np 8" \\
        --arrivals burst,poisson:1,poisson:2,poisson:4,poisson:8 --out results/serve_sweep.json
    python -m bench.serve --url mine=http://127.0.0.1:8000 --workload shared_prefix
    python -m bench.serve --launch "" --quick --model random            # a smoke test in seconds

See bench/README.md for the metrics, the targets and the recorded runs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path

import httpx

from bench.report import (
    REPO_ROOT,
    ProgressBar,
    format_side_by_side,
    format_summary_line,
    machine_info,
    module_command,
    write_json,
)
from bench.serve.client import RequestResult, send_request
from bench.serve.metrics import Arrival, summarize
from bench.serve.targets import (
    LLAMA,
    OURS,
    URL,
    Target,
    cpu_seconds,
    memory_mib,
    served_model_name,
    server_version,
    start,
    stop,
)
from bench.workload import FULL, QUICK, WORKLOADS, BenchRequest, Workload, build_workload, load_tokenizer

LOG_DIR = REPO_ROOT / "bench" / "serve-logs"
WARMUP_TOKENS = 4


async def run_arrival(target: Target, model_name: str, prompts: list[BenchRequest], arrival: Arrival,
                      seed: int, progress: ProgressBar | None) -> list[RequestResult]:
    """Release `prompts` on `arrival`'s schedule against `target`; every request's result, in order."""
    schedule = arrival.schedule(len(prompts), seed)
    limit = asyncio.Semaphore(arrival.concurrency) if arrival.concurrency else None
    timeout = httpx.Timeout(600.0, connect=30.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        run_start = time.perf_counter()

        async def one(prompt: BenchRequest, release_s: float) -> RequestResult:
            result = RequestResult(prompt.request_id, len(prompt.prompt_token_ids), prompt.max_tokens, release_s)
            await asyncio.sleep(max(0.0, run_start + release_s - time.perf_counter()))
            if limit is None:
                await send_request(client, target.completions_url, model_name, prompt, result, run_start)
            else:
                async with limit:
                    await send_request(client, target.completions_url, model_name, prompt, result, run_start)
            if progress is not None:
                progress.advance(result.error is not None)
            return result

        return list(await asyncio.gather(*(one(p, t) for p, t in zip(prompts, schedule))))


def warm_up(target: Target, model_name: str, workload: Workload) -> None:
    """Two short requests, untimed, so first-call costs (threads, allocation) are paid. Their prompts
    are workload prompts reversed, so they leave nothing in a prefix cache that a timed request could hit."""
    prompts = [BenchRequest(f"warmup-{i}", p.prompt_token_ids[::-1], WARMUP_TOKENS)
               for i, p in enumerate(workload.requests[:2])]
    results = asyncio.run(run_arrival(target, model_name, prompts, Arrival("burst"), 0, None))
    failed = [r.error for r in results if r.error is not None]
    if failed:
        raise RuntimeError(f"{target.label}: warm-up failed: {failed[0]}")


def bench_arrival(target: Target, workload: Workload, arrival: Arrival, args: argparse.Namespace) -> dict:
    """One run on a freshly started target (a URL target is reused as it is): nothing cached from
    an earlier run, like the offline benchmark's fresh engine per row."""
    log_path = LOG_DIR / f"{target.label.replace('/', '_').replace(' ', '_')}.log"
    start(target, args.model, args.gguf_path, workload.max_model_len, log_path)
    try:
        model_name = served_model_name(target)
        warm_up(target, model_name, workload)
        progress = ProgressBar(len(workload.requests), f"{target.label} {arrival.label}")
        cpu_before, started = cpu_seconds(target), time.perf_counter()
        results = asyncio.run(run_arrival(target, model_name, workload.requests, arrival, args.seed, progress))
        cpu_after, memory = cpu_seconds(target), memory_mib(target)
        progress.close()
    finally:
        stop(target)
    summary = summarize(results)
    return {"target": target.label, "arrival": arrival.label, "kind": arrival.kind, "rate": arrival.rate,
            "concurrency": arrival.concurrency, "wall_time_s": time.perf_counter() - started,
            "loadavg_end": list(os.getloadavg()), "summary": summary,
            "server_cpu": server_cpu(cpu_before, cpu_after, summary["total_output_tokens"]),
            "server_memory": memory, "requests": [r.to_dict() for r in results]}


def server_cpu(before: dict | None, after: dict | None, output_tokens: int) -> dict | None:
    """The server's CPU seconds over the timed run, and per output token in microseconds."""
    if before is None or after is None:
        return None
    used = {name: after[name] - before[name] for name in before}
    return {**{f"{name}_s": value for name, value in used.items()},
            **{f"{name}_us_per_token": 1e6 * value / max(output_tokens, 1) for name, value in used.items()}}


def bench_target(target: Target, workload: Workload, args: argparse.Namespace, report: dict) -> None:
    """Every arrival on `target`; the runs go into `report`, which is saved after each one."""
    for arrival in args.arrivals:
        run = bench_arrival(target, workload, arrival, args)
        if not any(t["label"] == target.label for t in report["targets"]):
            report["targets"].append({"label": target.label, "kind": target.kind, "args": target.args,
                                      "command": target.command, "url": target.url,
                                      "version": server_version(target)})
        report["runs"].append(run)
        print(format_summary_line(run), flush=True)
        write_json(args.out, report)  # after every run, so a late failure keeps what was measured


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--launch", action="append", default=[], metavar="[LABEL=]ARGS",
                        help="start our server with these extra flags ('' for defaults); repeatable")
    parser.add_argument("--launch-llama", action="append", default=[], metavar="[LABEL=]ARGS",
                        help="start llama-server (bench/build_llama_server.sh) on the same GGUF; repeatable")
    parser.add_argument("--url", action="append", default=[], metavar="[LABEL=]URL",
                        help="an OpenAI-compatible server already running; repeatable")
    parser.add_argument("--model", default="default", help='"default" (SmolLM2-135M-Instruct), "random", or a path')
    parser.add_argument("--workload", default="base", choices=WORKLOADS)
    parser.add_argument("--arrivals", default="burst",
                        help="comma-separated: burst, poisson:RATE (req/s), concurrency:N (default burst)")
    parser.add_argument("--num-requests", type=int, default=None, help="default 48 (8 with --quick)")
    parser.add_argument("--seed", type=int, default=0, help="workload and Poisson arrival seed")
    parser.add_argument("--quick", action="store_true", help="8 short requests: a smoke test")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default results/serve_run.json)")
    args = parser.parse_args(argv)
    args.targets = ([Target.parse(OURS, s) for s in args.launch] + [Target.parse(LLAMA, s) for s in args.launch_llama]
                    + [Target.parse(URL, s) for s in args.url])
    if not args.targets:
        parser.error("give at least one --launch, --launch-llama or --url")
    labels = [t.label for t in args.targets]
    if len(set(labels)) != len(labels):
        parser.error(f"target labels must differ: {labels}")
    try:
        args.arrivals = [Arrival.parse(a) for a in args.arrivals.split(",")]
    except ValueError as exc:
        parser.error(str(exc))
    args.num_requests = args.num_requests or (8 if args.quick else 48)
    args.out = args.out or REPO_ROOT / "results" / ("serve_quick.json" if args.quick else "serve_run.json")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    tokenizer, source = load_tokenizer(args.model)
    args.gguf_path = source if source.endswith(".gguf") else None
    lengths = QUICK if args.quick else FULL
    workload = build_workload(args.workload, tokenizer, args.num_requests, lengths, args.seed)
    report = {
        "benchmark": "serve", "command": module_command("bench.serve", argv),
        "machine": machine_info(),
        "settings": {"model": source, "workload": workload.name, "workload_description": workload.description,
                     "num_requests": len(workload.requests), "seed": args.seed, "quick": args.quick,
                     "arrivals": [a.label for a in args.arrivals], "max_model_len": workload.max_model_len,
                     "sampling": "greedy (temperature 0), ignore_eos, max_tokens = drawn output length, stream",
                     "prompt_tokens": [len(p.prompt_token_ids) for p in workload.requests],
                     "max_tokens": [p.max_tokens for p in workload.requests]},
        "targets": [], "runs": [],
    }
    started = time.perf_counter()
    for target in args.targets:
        bench_target(target, workload, args, report)
    report["total_wall_time_s"] = time.perf_counter() - started
    report["machine"]["loadavg_end"] = list(os.getloadavg())
    write_json(args.out, report)
    print()
    print(format_side_by_side(report["runs"]))
    print(f"\nraw JSON: {args.out}")
    return report

