"""The soak (`python -m bench.soak`): thousands of mixed requests against one server process with a
tiny KV cache, client disconnects and timeouts; then nothing may be left behind.

At every checkpoint (after each `--checkpoint-every` requests the client waits for the server to go
idle) it reads the server's RSS and /metrics. At the end: no block used and no request running or
waiting, RSS within `--rss-tolerance` of the first checkpoint's, every completed answer valid, every
greedy one identical to the same request run alone afterwards, the counts reconciled with /metrics,
and a clean shutdown (no request left to abort, exit code 0, no traceback or ERROR line in the log).
Writes results/soak.json (`--out`). Owns the run and its checks; the mix and client are soak_client.py.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.report import REPO_ROOT, ProgressBar, machine_info, module_command, write_json
from bench.serve.targets import OURS, Target, memory_mib, start
from bench.soak_client import Outcome, SoakRequest, differences, make_mix, send, validate

IDLE_TIMEOUT_S = 120.0


@dataclass
class SoakConfig:
    num_requests: int = 10_000
    concurrency: int = 24
    seed: int = 0
    checkpoint_every: int = 1000       # the first checkpoint is RSS's reference level
    rss_tolerance: float = 0.10
    log_path: Path = REPO_ROOT / "bench" / "serve-logs" / "soak.log"
    server_args: list[str] = field(default_factory=lambda: [
        "--dtype", "float64", "--block-size", "8", "--num-blocks", "64", "--max-num-seqs", "16",
        "--max-num-batched-tokens", "64", "--max-queue", "1000",
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])


@dataclass
class Checkpoint:
    num_requests: int
    elapsed_s: float
    rss_mib: float
    metrics: dict[str, float]


def parse_metrics(text: str) -> dict[str, float]:
    """`name{labels}` -> value for every sample of a Prometheus text exposition, read with
    prometheus_client's parser (as the tests read /metrics); buckets and the model_name label left out."""
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sample.labels.items() if k != "model_name")
            values[sample.name.removeprefix("vllmlite:") + (f"{{{labels}}}" if labels else "")] = sample.value
    return values


def _reason(metrics: dict[str, float], reason: str) -> float:
    return metrics.get(f'request_success_total{{finished_reason="{reason}"}}', 0.0)


async def wait_idle(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """/metrics once nothing runs, waits or holds a block, or as it is after IDLE_TIMEOUT_S (the
    end checks then fail on it)."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        metrics = parse_metrics((await client.get(f"{url}/metrics")).text)
        busy = [metrics[k] for k in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")]
        if not any(busy) or time.monotonic() > deadline:
            return metrics
        await asyncio.sleep(0.1)


async def _run_requests(client: httpx.AsyncClient, url: str, requests: list[SoakRequest], concurrency: int,
                        outcomes: list[Outcome], progress: ProgressBar) -> None:
    queue = list(reversed(requests))

    async def worker() -> None:
        while queue:
            outcome = await send(client, url, queue.pop())
            outcomes.append(outcome)
            progress.advance(outcome.status == "error")
    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def _soak(config: SoakConfig, target: Target, requests: list[SoakRequest]) -> dict:
    limits = httpx.Limits(max_connections=config.concurrency + 4, max_keepalive_connections=config.concurrency)
    outcomes: list[Outcome] = []
    checkpoints: list[Checkpoint] = []
    progress = ProgressBar(len(requests), "soak")
    start_time = time.perf_counter()
    async with httpx.AsyncClient(limits=limits) as client:
        for first in range(0, len(requests), config.checkpoint_every):
            chunk = requests[first:first + config.checkpoint_every]
            await _run_requests(client, target.url, chunk, config.concurrency, outcomes, progress)
            metrics = await wait_idle(client, target.url)
            checkpoints.append(Checkpoint(len(outcomes), time.perf_counter() - start_time,
                                          memory_mib(target)["rss_mib"], metrics))
        progress.close()
        soak_s = time.perf_counter() - start_time
        alone = await _run_alone(client, target.url, requests, outcomes)
        after_alone = await wait_idle(client, target.url)
    return {"soak_s": soak_s, "alone_s": time.perf_counter() - start_time - soak_s, "outcomes": outcomes,
            "checkpoints": checkpoints, "alone": alone, "metrics_after_alone": after_alone}


async def _run_alone(client: httpx.AsyncClient, url: str, requests: list[SoakRequest],
                     outcomes: list[Outcome]) -> dict:
    """Each distinct completed greedy (and seeded sampled) request again, one at a time and whole;
    every soaked answer to it (a prompt may repeat) is compared with that one."""
    by_index = {o.index: o for o in outcomes}
    groups: dict[str, list[tuple[SoakRequest, Outcome]]] = {}
    for request in requests:
        outcome = by_index[request.index]
        if outcome.status == "completed" and (request.is_greedy or "seed" in request.body):
            groups.setdefault(request.key, []).append((request, outcome))
    result = {kind: {"distinct": 0, "checked": 0, "mismatches": []} for kind in ("greedy", "seeded")}
    for group in groups.values():
        first = group[0][0]
        alone = await send(client, url, SoakRequest(first.index, first.route, first.alone_body, "complete"))
        kind = result["greedy" if first.is_greedy else "seeded"]
        kind["distinct"] += 1
        for request, soaked in group:
            kind["checked"] += 1
            found = differences(request, soaked, alone)
            if found:
                kind["mismatches"].append({"index": request.index, "body": request.body, "differences": found})
    return result


def reconcile(requests: list[SoakRequest], outcomes: list[Outcome], metrics: dict[str, float]) -> dict:
    """Client counts next to the server's: every completed request finished stop/length there, every
    request the server admitted finished (stop, length or abort), none in error."""
    by_index = {r.index: r for r in requests}
    count = {s: sum(o.status == s for o in outcomes) for s in ("completed", "disconnected", "timed_out", "error")}
    admitted_cut = sum(o.admitted and o.status != "completed" for o in outcomes)
    finished = _reason(metrics, "stop") + _reason(metrics, "length")
    aborted = _reason(metrics, "abort")
    usage_tokens = sum(o.completion_tokens or 0 for o in outcomes if o.status == "completed")
    checks = {
        "no_client_errors": count["error"] == 0,
        "no_server_errors": _reason(metrics, "error") == 0,
        "completed_finished_on_server": count["completed"] <= finished,
        "admitted_accounted_for": count["completed"] + admitted_cut <= finished + aborted <= len(outcomes),
        "e2e_observed_per_finish": metrics["e2e_request_latency_seconds_count"] == finished,
        "generation_tokens_cover_usage": usage_tokens <= metrics["generation_tokens_total"],
        "preemption_happened": metrics["num_preemptions_total"] > 0,
        "prefix_hits_happened": metrics["prefix_cache_hits_total"] > 0,
        "speculation_happened": metrics.get("spec_decode_num_drafts_total", 0) > 0,
    }
    fates = Counter(f"{by_index[o.index].fate}->{o.status}" for o in outcomes)
    return {"client": count, "client_fate_to_outcome": dict(fates), "admitted_then_cut": admitted_cut,
            "server_finished_stop_length": finished, "server_aborted": aborted,
            "usage_completion_tokens": usage_tokens, "checks": checks}


def _stop_server(target: Target, log_path: Path) -> dict:
    """SIGTERM, then what the shutdown said: exit code, requests it had to abort, tracebacks."""
    process = target.process
    process.send_signal(signal.SIGTERM)
    try:
        returncode = process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        returncode = process.wait(timeout=30)
    log = log_path.read_text(errors="replace")
    aborted = [int(m) for m in re.findall(r"shutdown: aborting (\d+) unfinished", log)]
    return {"exit_code": returncode, "aborted_at_shutdown": sum(aborted), "tracebacks": log.count("Traceback"),
            "error_lines": sum(" ERROR " in line for line in log.splitlines())}


def run_soak(config: SoakConfig, command: str | None = None) -> dict:
    """Start the server, soak it, check everything; the report (its `passed` says if all held)."""
    machine = machine_info()  # before the run: its load and the commit as started
    requests = make_mix(config.num_requests, config.seed)
    target = Target(OURS, "soak", args=list(config.server_args))
    start(target, "random", None, 0, config.log_path)
    try:
        run = asyncio.run(_soak(config, target, requests))
    finally:
        shutdown = _stop_server(target, config.log_path)
    outcomes, checkpoints = run["outcomes"], run["checkpoints"]
    by_index = {r.index: r for r in requests}
    invalid = [{"index": o.index, "problems": p} for o in outcomes if o.status == "completed"
               for p in [validate(by_index[o.index], o)] if p]
    end, first = checkpoints[-1], checkpoints[0]
    counts = reconcile(requests, outcomes, end.metrics)
    rss_growth = end.rss_mib / first.rss_mib - 1
    checks = {
        **counts.pop("checks"),
        "no_blocks_used_at_end": end.metrics["kv_cache_usage_perc"] == 0,
        "no_requests_at_end": end.metrics["num_requests_running"] == end.metrics["num_requests_waiting"] == 0,
        "rss_flat": rss_growth <= config.rss_tolerance,
        "all_completed_valid": not invalid,
        "greedy_identical_alone": not run["alone"]["greedy"]["mismatches"],
        "idle_after_alone_runs": run["metrics_after_alone"]["kv_cache_usage_perc"] == 0,
        "clean_shutdown": shutdown["exit_code"] == 0 and not shutdown["aborted_at_shutdown"]
                          and not shutdown["tracebacks"] and not shutdown["error_lines"],
    }
    return {
        "command": command or module_command("bench.soak"), "machine": machine, "settings": asdict(config),
        "server_command": target.command, "soak_s": run["soak_s"], "alone_s": run["alone_s"], "counts": counts,
        "rss_mib": {"first_checkpoint": first.rss_mib, "end": end.rss_mib, "growth": rss_growth,
                    "after_requests": [(c.num_requests, round(c.rss_mib, 2)) for c in checkpoints]},
        "checkpoints": [asdict(c) for c in checkpoints], "invalid": invalid[:50], "num_invalid": len(invalid),
        "alone": {k: {"distinct": v["distinct"], "checked": v["checked"], "num_mismatches": len(v["mismatches"]),
                      "mismatches": v["mismatches"][:20]} for k, v in run["alone"].items()},
        "shutdown": shutdown, "checks": checks, "passed": all(checks.values()),
    }


def summary(report: dict) -> str:
    rss, counts, alone = report["rss_mib"], report["counts"], report["alone"]
    failed = [name for name, ok in report["checks"].items() if not ok]
    return "\n".join([
        f"soak: {sum(counts['client'].values())} requests in {report['soak_s']:.0f} s: {counts['client']}",
        f"server: {counts['server_finished_stop_length']:.0f} finished, {counts['server_aborted']:.0f} aborted",
        f"RSS: {rss['first_checkpoint']:.1f} MiB at the first checkpoint, {rss['end']:.1f} MiB at the end "
        f"({rss['growth']:+.1%})",
        f"alone: greedy {alone['greedy']['num_mismatches']}/{alone['greedy']['checked']} differ, "
        f"seeded {alone['seeded']['num_mismatches']}/{alone['seeded']['checked']} differ",
        f"invalid answers: {report['num_invalid']}; shutdown: {report['shutdown']}",
        "PASSED" if report["passed"] else f"FAILED: {', '.join(failed)}",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = SoakConfig()
    parser.add_argument("--num-requests", type=int, default=defaults.num_requests)
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--checkpoint-every", type=int, default=defaults.checkpoint_every)
    parser.add_argument("--rss-tolerance", type=float, default=defaults.rss_tolerance)
    parser.add_argument("--server-args", default=None, help="replace the server's flags (one string)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "soak.json")
    args = parser.parse_args(argv)
    config = SoakConfig(args.num_requests, args.concurrency, args.seed, args.checkpoint_every, args.rss_tolerance)
    if args.server_args is not None:
        config.server_args = shlex.split(args.server_args)
    report = run_soak(config, module_command("bench.soak", argv))
    write_json(args.out, report)
    print(summary(report))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
