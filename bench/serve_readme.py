"""README tables for the serving benchmark, rendered from results/serve_*.json by update_readme.py.

Every number printed here is read from a run's summary; nothing is typed in by hand.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from report import REPO_ROOT

BUSY_LOADAVG = 2.5  # a 1-minute load average above this on 2 cores: something else was running too
OURS_DEFAULT = "continuous+prefix"  # the label of our server's default configuration in the sweep
STATIC, CONTINUOUS, LLAMA_LABEL = "static", "continuous", "llama.cpp"


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


def _ratio(report: dict, a: str, b: str, arrival: str, key: Callable[[dict], float]) -> float | None:
    ra, rb = _run(report, a, arrival), _run(report, b, arrival)
    if ra is None or rb is None:
        return None
    return key(ra["summary"]) / key(rb["summary"])


def sweep_claims(report: dict) -> list[str]:
    """The headline numbers of the sweep, each computed from two runs of the same JSON."""
    tput = lambda s: s["output_throughput"]  # noqa: E731
    claims = []
    for arrival in _arrivals(report):
        ours = _run(report, OURS_DEFAULT, arrival)
        if ours is None:
            continue
        s = ours["summary"]
        parts = [f"our server ({OURS_DEFAULT}) {s['output_throughput']:.1f} output tok/s, "
                 f"TTFT p99 {s['ttft_ms']['p99'] / 1000:.2f} s"]
        for other in (STATIC, CONTINUOUS, LLAMA_LABEL):
            ratio = _ratio(report, OURS_DEFAULT, other, arrival, tput)
            if ratio is not None:
                busy = " (busy*)" if _is_busy(_run(report, other, arrival)) else ""
                parts.append(f"{ratio:.2f}x the throughput of {other}{busy}")
        claims.append(f"- {arrival}: " + "; ".join(parts) + ".")
    return claims


def llama_parallel(report: dict, machine_line: Callable[[dict], str]) -> list[str]:
    """The --parallel search: one line per llama-server setting on the same workload."""
    lines = ["#### Choosing llama-server's `--parallel`", ""] + _about(report, machine_line)
    lines += ["| target | arrival | output tok/s | TTFT p50 / p99 (s) | TPOT mean (ms) | exactly max_tokens |",
              "|---|---|---:|---|---:|---:|"]
    for run in report["runs"]:
        s = run["summary"]
        lines.append(f"| {run['target']} | {run['arrival']} | {s['output_throughput']:.1f} | "
                     f"{s['ttft_ms']['p50'] / 1000:.2f} / {s['ttft_ms']['p99'] / 1000:.2f} | "
                     f"{s['tpot_ms']['mean']:.1f} | {s['num_exact_max_tokens']}/{s['num_requests']} |")
    best = max(report["runs"], key=lambda r: r["summary"]["output_throughput"])
    lines += ["", f"Best output throughput: `{best['target']}` ({best['summary']['output_throughput']:.1f} tok/s)."]
    return lines
