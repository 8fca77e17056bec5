"""The offline benchmark's report: machine facts, target checks, the stdout table and the raw JSON.

Knows row summaries as plain dicts; runs nothing but read-only `git` queries.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
BLAS_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_CORETYPE")


def command_line(argv: list[str]) -> str:
    """The command as typed, with the BLAS environment variables that were set in front of it."""
    env = [f"{k}={os.environ[k]}" for k in BLAS_ENV if k in os.environ]
    return " ".join(env + ["python", shlex.join(argv)])


def _git(*args: str) -> str | None:
    """Output of a read-only git query, or None outside a repository."""
    try:
        result = subprocess.run(["git", "--no-optional-locks", *args], cwd=REPO_ROOT, capture_output=True,
                                text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def machine_info() -> dict:
    """Where and how the numbers were made: CPU, BLAS, versions, date, commit, load."""
    try:
        numpy_config = np.show_config(mode="dicts")
    except TypeError:  # numpy < 1.25 has no mode="dicts"
        numpy_config = None
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "processor": platform.processor(), "cpu_model": _cpu_model(), "machine": platform.machine(),
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


COLUMNS = [  # (header, key, width, format spec)
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
                       for title, _, width, spec in COLUMNS)]
    for row in rows:
        base = baseline.setdefault(row["workload"], row["output_tokens_per_s"])
        view = dict(row, speedup=row["output_tokens_per_s"] / base, tpot_ms=row["tpot_mean_s"] * 1000)
        lines.append("  ".join(_cell(view.get(key), width, spec) for _, key, width, spec in COLUMNS))
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
