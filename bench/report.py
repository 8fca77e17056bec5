"""What the benchmarks record and print: provenance (machine, command, date, commit) and the raw JSON;
the offline benchmark's targets and table; the serving benchmark's progress bar, run lines and
side-by-side table; and the serving tables update_readme.py puts in the README.

Formats plain dicts only; runs nothing but read-only `git` queries.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from tqdm import tqdm

REPO_ROOT = Path(__file__).resolve().parent.parent
BLAS_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_CORETYPE")
BUSY_LOADAVG = 2.5  # a 1-minute load average above this on 2 cores: something else was running too
OURS_DEFAULT = "vllmlite"  # the label of our server, at its defaults, in the sweep
LLAMA_PREFIX = "llama.cpp"  # llama-server's labels in the sweep, one per --parallel setting


def command_line(argv: list[str]) -> str:
    """The command as typed, with the BLAS environment variables that were set in front of it."""
    env = [f"{k}={os.environ[k]}" for k in BLAS_ENV if k in os.environ]
    return " ".join(env + ["python", shlex.join(argv)])


def module_command(module: str, args: list[str] | None = None) -> str:
    """`python -m MODULE ARGS` as command_line() gives it; ARGS default to this process's arguments.
    (Run with -m, sys.argv[0] is the module's absolute path, not what was typed.)"""
    return command_line(["-m", module, *(sys.argv[1:] if args is None else args)])


def _git(*args: str) -> str | None:
    """Output of a read-only git query, or None outside a repository."""
    try:
        result = subprocess.run(["git", "--no-optional-locks", *args], cwd=REPO_ROOT, capture_output=True,
                                text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def _cpuinfo(field: str) -> str | None:
    """The first CPU's `field` in /proc/cpuinfo (None off Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":", 1)[0].strip() == field:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


# The vector extensions the kernels' speed depends on (the AVX-512 and AVX2 EPYCs differ by these).
SIMD_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile")


def _simd_flags() -> list[str] | None:
    flags = _cpuinfo("flags")
    return None if flags is None else [f for f in SIMD_FLAGS if f in flags.split()]


def machine_info() -> dict:
    """Where and how the numbers were made: CPU, BLAS, versions, date, commit, load."""
    try:
        numpy_config = np.show_config(mode="dicts")
    except TypeError:  # numpy < 1.25 has no mode="dicts"
        numpy_config = None
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "processor": platform.processor(), "cpu_model": _cpuinfo("model name"), "cpu_flags": _simd_flags(),
        "machine": platform.machine(),
        "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0], "numpy": np.__version__, "numpy_config": numpy_config,
        "blas_env": {k: os.environ.get(k) for k in BLAS_ENV},
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git_commit": _git("rev-parse", "HEAD"), "git_tracked_changes": bool(status) if status is not None else None,
        "loadavg_start": list(os.getloadavg()),
    }


def _target(name: str, value: float, threshold: float, description: str) -> dict:
    met = not math.isnan(value) and value >= threshold
    return {"name": name, "value": value, "threshold": threshold, "met": met, "description": description}


def check_targets(rows: dict[str, dict]) -> list[dict]:
    """The issue's targets, for whichever rows ran."""
    targets = []
    if "paged" in rows and "sequential" in rows:
        ratio = rows["paged"]["output_tokens_per_s"] / rows["sequential"]["output_tokens_per_s"]
        targets.append(_target("paged_throughput_vs_sequential", ratio, 2.5,
                               "paged output tokens/s divided by sequential output tokens/s"))
    if "paged" in rows:
        targets.append(_target("paged_kv_utilization", rows["paged"]["kv_utilization"], 0.90,
                               "paged: mean over steps of tokens held / slots in used blocks"))
        static = [r["kv_utilization"] for name, r in rows.items() if name.startswith("static")]
        if static:
            # "Far lower", fixed before measuring: every static row at most half the paged utilization.
            margin = rows["paged"]["kv_utilization"] / max(static)
            targets.append(_target("static_kv_utilization_far_lower", margin, 2.0,
                                   "paged KV utilization / highest static KV utilization"))
    if "prefix_on" in rows and "prefix_off" in rows:
        on, off = rows["prefix_on"], rows["prefix_off"]
        targets.append(_target("prefix_caching_throughput", on["output_tokens_per_s"] / off["output_tokens_per_s"],
                               1.4, "shared prefix: tokens/s with caching / without"))
        targets.append(_target("prefix_caching_mean_ttft", off["ttft_mean_s"] / on["ttft_mean_s"], 1.5,
                               "shared prefix: mean TTFT without caching / with"))
    return targets


OFFLINE_COLUMNS = [  # (header, key, width, format spec)
    ("row", "name", 11, ""), ("tok out", "output_tokens", 7, "d"), ("wall s", "wall_time_s", 7, ".1f"),
    ("tok/s", "output_tokens_per_s", 7, ".1f"), ("x base", "speedup", 6, ".2f"),
    ("TTFT mean", "ttft_mean_s", 9, ".2f"), ("p50", "ttft_p50_s", 6, ".2f"), ("p99", "ttft_p99_s", 6, ".2f"),
    ("TPOT ms", "tpot_ms", 7, ".1f"), ("fwd", "forward_passes", 6, "d"),
    ("KV util", "kv_utilization", 7, ".1%"), ("budget", "kv_budget_fraction_mean", 6, ".1%"),
    ("run", "mean_running", 5, ".1f"), ("hit", "prefix_hit_rate", 6, ".1%"),
    ("preempt", "num_preemptions", 7, "d"), ("same", "agreement", 6, ""),
]


def _cell(value, width: int, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-".rjust(width)
    return format(value, spec).rjust(width) if spec else str(value).ljust(width)


def format_table(rows: list[dict]) -> str:
    """One line per row. `x base` is tokens/s relative to the first row of the same workload;
    `same` counts requests whose greedy tokens equal that row's."""
    baseline: dict[str, float] = {}
    lines = ["  ".join(title.ljust(width) if not spec else title.rjust(width)
                       for title, _, width, spec in OFFLINE_COLUMNS)]
    for row in rows:
        base = baseline.setdefault(row["workload"], row["output_tokens_per_s"])
        view = dict(row, speedup=row["output_tokens_per_s"] / base, tpot_ms=row["tpot_mean_s"] * 1000)
        lines.append("  ".join(_cell(view.get(key), width, spec) for _, key, width, spec in OFFLINE_COLUMNS))
    return "\n".join(lines)


def _finite(value):
    """JSON has no NaN: recursively turn NaN into null."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_json(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(report), indent=1, default=str) + "\n")


# The serving benchmark's console output.


class ProgressBar:
    """A tqdm bar on stderr: `label: 50%|#####     | 24/48 [00:12<00:12, errors=0]`, redrawn in place
    on a terminal, about one line per tenth of the requests otherwise (logs)."""

    def __init__(self, total: int, label: str) -> None:
        is_tty = sys.stderr.isatty()
        self.errors = 0
        self._bar = tqdm(total=total, desc=label, unit="req", file=sys.stderr, dynamic_ncols=is_tty,
                         mininterval=0.1 if is_tty else 0, miniters=1 if is_tty else max(1, total // 10))
        self._bar.set_postfix(errors=0, refresh=False)

    def advance(self, is_error: bool) -> None:
        if is_error:
            self.errors += 1
            self._bar.set_postfix(errors=self.errors, refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()


def _num(value, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def format_summary_line(run: dict) -> str:
    s = run["summary"]
    return (f"{run['target']} {run['arrival']}: {s['completed']}/{s['num_requests']} ok, "
            f"{s['output_throughput']:.1f} out tok/s, TTFT p50 {s['ttft_ms']['p50'] / 1000:.2f} s "
            f"p99 {s['ttft_ms']['p99'] / 1000:.2f} s, TPOT p50 {s['tpot_ms']['p50']:.0f} ms, "
            f"exact max_tokens {s['num_exact_max_tokens']}/{s['num_requests']}{_cpu_text(run.get('server_cpu'))}")


def _cpu_text(cpu: dict | None) -> str:
    """The server's CPU per output token: all threads, and the main thread (our event loop) alone."""
    if not cpu:
        return ""
    return (f", server CPU {cpu['process_us_per_token'] / 1000:.1f} ms/token "
            f"(main thread {cpu['main_thread_us_per_token']:.0f} us)")


SERVE_COLUMNS = [  # (header, width, function of (summary, ratio) -> text)
    ("req/s", 6, lambda s, r: _num(s["request_throughput"], ".2f")),
    ("out tok/s", 9, lambda s, r: _num(s["output_throughput"], ".1f")),
    ("x first", 7, lambda s, r: _num(r, ".2f")),
    ("TTFT p50 s", 10, lambda s, r: _num(s["ttft_ms"]["p50"] / 1000, ".2f")),
    ("p90", 6, lambda s, r: _num(s["ttft_ms"]["p90"] / 1000, ".2f")),
    ("p99", 6, lambda s, r: _num(s["ttft_ms"]["p99"] / 1000, ".2f")),
    ("TPOT mean ms", 12, lambda s, r: _num(s["tpot_ms"]["mean"], ".1f")),
    ("p50", 6, lambda s, r: _num(s["tpot_ms"]["p50"], ".1f")),
    ("p99", 6, lambda s, r: _num(s["tpot_ms"]["p99"], ".1f")),
    ("ITL p50 ms", 10, lambda s, r: _num(s["itl_ms"]["p50"], ".1f")),
    ("e2e p50 s", 9, lambda s, r: _num(s["e2e_ms"]["p50"] / 1000, ".2f")),
    ("err", 3, lambda s, r: str(s["errors"])),
    ("exact", 5, lambda s, r: f"{s['num_exact_max_tokens']}/{s['num_requests']}"),
]


def format_side_by_side(runs: list[dict]) -> str:
    """Per arrival, one line per target; `x first` is output tok/s over the first target's."""
    arrivals = list(dict.fromkeys(run["arrival"] for run in runs))
    width = max([len(run["target"]) for run in runs] + [6])
    blocks = []
    for arrival in arrivals:
        group = [run for run in runs if run["arrival"] == arrival]
        base = group[0]["summary"]["output_throughput"]
        header = "target".ljust(width) + "  " + "  ".join(title.rjust(w) for title, w, _ in SERVE_COLUMNS)
        lines = [f"arrival {arrival}", header]
        for run in group:
            ratio = run["summary"]["output_throughput"] / base if base else math.nan
            cells = [fn(run["summary"], ratio).rjust(w) for _, w, fn in SERVE_COLUMNS]
            lines.append(run["target"].ljust(width) + "  " + "  ".join(cells))
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


# The serving benchmark's README tables (update_readme.py renders them from results/serve_*.json).


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
                f"| {arrival} | {run['target']}{busy} | {s['output_throughput']:.1f} | {_num(ratio, '.2f')} | "
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
