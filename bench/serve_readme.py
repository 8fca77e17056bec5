"""README tables for the serving benchmark, rendered from results/serve_*.json by update_readme.py.

Every number printed here is read from a run's summary; nothing is typed in by hand.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from report import REPO_ROOT

BUSY_LOADAVG = 2.5  # a 1-minute load average above this on 2 cores: something else was running too
OURS_DEFAULT = "vllmlite"  # the label of our server, at its defaults, in the sweep
LLAMA_PREFIX = "llama.cpp"  # llama-server's labels in the sweep, one per --parallel setting


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _run(report: dict, target: str, arrival: str) -> dict | None:
    return next((r for r in report["runs"] if r["target"] == target and r["arrival"] == arrival), None)


def _arrivals(report: dict) -> list[str]:
    return list(dict.fromkeys(r["arrival"] for r in report["runs"]))


def _about(report: dict, machine_line: Callable[[dict], str]) -> list[str]:
    s = report["settings"]
    lines = [machine_line(report), "",
             f"Workload: {s['num_requests']} requests, {s['workload_description']}; {s['sampling']}. "
             f"Total {report.get('total_wall_time_s', math.nan):.0f} s. Targets as launched (ports vary):", ""]
    lines += [f"- `{t['label']}`: `{(t['command'] or t['url']).replace(str(REPO_ROOT) + '/', '')}`"
              for t in report["targets"]]
    lines += [f"- Note: {note}" for note in report.get("notes", [])]
    return lines + [""]


def side_by_side(report: dict, machine_line: Callable[[dict], str], title: str) -> list[str]:
    """Per arrival, every target with its output tok/s, the ratio to the first target, TTFT, TPOT."""
    lines = [title, ""] + _about(report, machine_line)
    first = report["targets"][0]["label"]
    lines += [f"| arrival | target | output tok/s | x {first} | TTFT p50 / p99 (s) | TPOT mean / p99 (ms) "
              "| ITL p50 (ms) | e2e p50 / p99 (s) | errors | exactly max_tokens |",
              "|---|---|---:|---:|---|---|---:|---|---:|---:|"]
    for arrival in _arrivals(report):
        base = _run(report, first, arrival)
        for run in (r for r in report["runs"] if r["arrival"] == arrival):
            s = run["summary"]
            ratio = s["output_throughput"] / base["summary"]["output_throughput"] if base else math.nan
            busy = " (busy*)" if _is_busy(run) else ""
            lines.append(
                f"| {arrival} | {run['target']}{busy} | {s['output_throughput']:.1f} | {_fmt(ratio, '.2f')} | "
                f"{s['ttft_ms']['p50'] / 1000:.2f} / {s['ttft_ms']['p99'] / 1000:.2f} | "
                f"{s['tpot_ms']['mean']:.0f} / {s['tpot_ms']['p99']:.0f} | {s['itl_ms']['p50']:.0f} | "
                f"{s['e2e_ms']['p50'] / 1000:.1f} / {s['e2e_ms']['p99'] / 1000:.1f} | {s['errors']} | "
                f"{s['num_exact_max_tokens']}/{s['num_requests']} |")
    if not any(_is_busy(run) for run in report["runs"]):
        return lines
    return lines + ["", f"`(busy*)`: the run ended with a 1-minute load average above {BUSY_LOADAVG} on this "
                    "2-core machine (`loadavg_end` in the JSON), so another process shared the CPU; treat it "
                    "with suspicion."]


def _is_busy(run: dict) -> bool:
    return (run.get("loadavg_end") or [0.0])[0] > BUSY_LOADAVG


def sweep_claims(report: dict) -> list[str]:
    """Per arrival: our server against llama-server's best --parallel at that arrival (the most
    output tok/s), each ratio computed from two runs of the same JSON, with the issue's targets."""
    claims = []
    for arrival in _arrivals(report):
        ours = _run(report, OURS_DEFAULT, arrival)
        llamas = [r for r in report["runs"] if r["arrival"] == arrival and r["target"].startswith(LLAMA_PREFIX)]
        if ours is None or not llamas:
            continue
        best = max(llamas, key=lambda r: r["summary"]["output_throughput"])
        s, b = ours["summary"], best["summary"]
        tput = s["output_throughput"] / b["output_throughput"]
        p50, p99 = (s["ttft_ms"][p] / b["ttft_ms"][p] for p in ("p50", "p99"))
        if arrival == "burst":
            verdict = (f"targets >= 2.0x throughput {'met' if tput >= 2.0 else '**missed**'}, "
                       f"TTFT p50 <= 0.5x {'met' if p50 <= 0.5 else '**missed**'}")
        else:
            verdict = (f"targets throughput >= 1x {'met' if tput >= 1.0 else '**missed**'}, "
                       f"TTFT p99 lower {'met' if p99 < 1.0 else '**missed**'}")
        busy = " (busy*)" if _is_busy(best) or _is_busy(ours) else ""
        cpu = ours.get("server_cpu") or {}
        http = (f"; our event-loop thread (HTTP, SSE, JSON) used {cpu['main_thread_us_per_token']:.0f} us of CPU "
                "per output token" if cpu else "")
        claims.append(f"- {arrival}{busy}: {s['output_throughput']:.1f} output tok/s against `{best['target']}`'s "
                      f"{b['output_throughput']:.1f}: **{tput:.2f}x**; TTFT p50 {p50:.2f}x, p99 {p99:.2f}x its; "
                      f"{verdict}{http}.")
    return claims
