"""Smoke test of the step-overhead benchmark: `python -m bench.step_overhead --quick` end to end.

Checks that every row ran with its phases adding up and that the async consumers got every token,
not how fast anything is.
"""

from __future__ import annotations

import json

import pytest
from bench_run import run_quick


def test_step_overhead_reports_every_phase_of_every_row(tmp_path):
    out = tmp_path / "bench_step_overhead.json"
    run_quick("bench.step_overhead", out)
    report = json.loads(out.read_text())
    rows = report["current"]["offline"]
    assert [(r["num_seqs"], r["detokenize"]) for r in rows] == [(8, False), (8, True), (4, False), (4, True)]
    for row in rows:
        us = row["us_per_seq_step"]
        assert all(us[name] > 0 for name in ("schedule", "execute", "update", "outputs", "total"))
        # Medians of parts need not add up exactly to the median total, but they come close.
        parts = sum(us[name] for name in ("schedule", "execute", "update", "outputs", "other"))
        assert parts == pytest.approx(us["total"], rel=0.5)
    served = report["current"]["async"]
    assert served["num_seqs"] == 8 and served["offline_tokens_per_s"] > 0
    assert served["async_tokens_per_s"] > 0 and served["async_frozen_heap_tokens_per_s"] > 0
    assert report["baseline"] is None and "-m bench.step_overhead" in report["command"]
