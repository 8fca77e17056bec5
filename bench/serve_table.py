"""What the serving benchmark prints: a progress bar on stderr, one line per run, and the side-by-side
table of every target per arrival with ratios to the first target. Formats plain dicts only.
"""

from __future__ import annotations

import math
import sys
import time


class ProgressBar:
    """`label [#####.....] 24/48 done, 0 errors, 12.3 s` on stderr: redrawn in place on a terminal,
    a line per tenth of the requests otherwise (logs)."""

    WIDTH = 30

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label = total, label
        self.done = self.errors = 0
        self.start = time.perf_counter()
        self.is_tty = sys.stderr.isatty()
        self._last_tenth = 0

    def advance(self, is_error: bool) -> None:
        self.done += 1
        self.errors += is_error
        tenth = 10 * self.done // self.total
        if self.is_tty or tenth > self._last_tenth or self.done == self.total:
            self._last_tenth = tenth
            self._draw()

    def _draw(self) -> None:
        filled = self.WIDTH * self.done // self.total
        bar = "#" * filled + "." * (self.WIDTH - filled)
        text = (f"{self.label} [{bar}] {self.done}/{self.total} done, {self.errors} errors, "
                f"{time.perf_counter() - self.start:.1f} s")
        sys.stderr.write(("\r" + text) if self.is_tty else (text + "\n"))
        sys.stderr.flush()

    def close(self) -> None:
        if self.is_tty:
            sys.stderr.write("\n")


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


COLUMNS = [  # (header, width, function of (summary, ratio) -> text)
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
        header = "target".ljust(width) + "  " + "  ".join(title.rjust(w) for title, w, _ in COLUMNS)
        lines = [f"arrival {arrival}", header]
        for run in group:
            ratio = run["summary"]["output_throughput"] / base if base else math.nan
            cells = [fn(run["summary"], ratio).rjust(w) for _, w, fn in COLUMNS]
            lines.append(run["target"].ljust(width) + "  " + "  ".join(cells))
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
