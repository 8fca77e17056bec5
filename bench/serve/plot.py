"""Plots of a serving sweep (`python -m bench.serve ... --arrivals poisson:1,...`): latency against
throughput (one line per target through its Poisson rates) and TTFT against the offered rate.

    python -m bench.serve.plot                              # results/serve_sweep.json -> results/*.png
    python -m bench.serve.plot results/serve_sweep.json --prefix results/serve_sweep

Needs matplotlib (`pip install -e .[bench]`). Reads JSON only.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.report import BUSY_LOADAVG, REPO_ROOT


def poisson_series(report: dict) -> dict[str, list[dict]]:
    """Per target, its Poisson runs sorted by rate."""
    series: dict[str, list[dict]] = {}
    for run in report["runs"]:
        if run["kind"] == "poisson":
            series.setdefault(run["target"], []).append(run)
    return {label: sorted(runs, key=lambda r: r["rate"]) for label, runs in series.items()}


def _caption(report: dict) -> str:
    m, s = report["machine"], report["settings"]
    return (f"{s['num_requests']} requests ({s['workload']}), {m.get('cpu_model')}, {m.get('cpu_count')} cores, "
            f"{m.get('date', '')[:10]}; busy*: the run ended with a 1-min load average > {BUSY_LOADAVG} "
            "(another process shared the CPU)")


def plot_pareto(report: dict, path: Path) -> None:
    """x: output tokens/s achieved; y: median and p99 end-to-end latency; points labelled by rate."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for label, runs in poisson_series(report).items():
        x = [r["summary"]["output_throughput"] for r in runs]
        p50 = [r["summary"]["e2e_ms"]["p50"] / 1000 for r in runs]
        p99 = [r["summary"]["e2e_ms"]["p99"] / 1000 for r in runs]
        line, = ax.plot(x, p50, marker="o", label=f"{label} (p50)")
        ax.plot(x, p99, marker="^", linestyle="--", color=line.get_color(), alpha=0.6, label=f"{label} (p99)")
        for xi, yi, r in zip(x, p50, runs):
            busy = " busy*" if (r.get("loadavg_end") or [0.0])[0] > BUSY_LOADAVG else ""
            ax.annotate(f"{r['rate']:g}/s{busy}", (xi, yi), textcoords="offset points", xytext=(4, -11), fontsize=8)
    ax.set_xlabel("output throughput (tokens/s)")
    ax.set_ylabel("end-to-end request latency (s)")
    ax.set_title("Latency vs throughput at Poisson rates (labels: offered req/s); lower right is better")
    _log_y_in_plain_numbers(ax)
    _finish(fig, ax, report, path)


def _finish(fig, ax, report: dict, path: Path) -> None:
    """Grid, legend, the provenance caption; save as PNG and close."""
    import matplotlib.pyplot as plt

    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.text(0.01, 0.01, _caption(report), fontsize=7, color="gray")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _log_y_in_plain_numbers(ax) -> None:
    """A log y axis labelled 0.5, 2, 30 rather than 5x10^-1."""
    from matplotlib.ticker import FuncFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "25" else ""))


def plot_ttft(report: dict, path: Path) -> None:
    """x: offered Poisson rate; y: TTFT p50 (solid) and p99 (dashed), log scale."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for label, runs in poisson_series(report).items():
        rates = [r["rate"] for r in runs]
        p50 = [r["summary"]["ttft_ms"]["p50"] / 1000 for r in runs]
        p99 = [r["summary"]["ttft_ms"]["p99"] / 1000 for r in runs]
        line, = ax.plot(rates, p50, marker="o", label=f"{label} p50")
        ax.plot(rates, p99, marker="^", linestyle="--", color=line.get_color(), label=f"{label} p99")
    ax.set_xscale("log", base=2)
    _log_y_in_plain_numbers(ax)
    ax.set_xticks(sorted({r["rate"] for runs in poisson_series(report).values() for r in runs}))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("offered load, Poisson arrival rate (requests/s)")
    ax.set_ylabel("time to first token (s)")
    ax.set_title("TTFT vs arrival rate: p50 solid, p99 dashed")
    _finish(fig, ax, report, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", nargs="?", type=Path, default=REPO_ROOT / "results" / "serve_sweep.json")
    parser.add_argument("--prefix", type=Path, default=REPO_ROOT / "results" / "serve_sweep")
    args = parser.parse_args()
    report = json.loads(args.json.read_text())
    for suffix, plot in (("_pareto.png", plot_pareto), ("_ttft_vs_rate.png", plot_ttft)):
        path = args.prefix.with_name(args.prefix.name + suffix)
        plot(report, path)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
