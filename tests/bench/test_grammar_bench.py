"""Smoke test of the grammar benchmark: `python -m bench.grammar_bench --quick --model random` end to end.

Checks that the figures it reports agree with each other, not how fast anything is.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from paths import REPO_ROOT


def test_grammar_bench_reports_grammar_share_of_step_time(tmp_path):
    out = tmp_path / "bench_grammar.json"
    result = subprocess.run([sys.executable, "-m", "bench.grammar_bench", "--quick", "--model", "random",
                             "--out", str(out)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    grammar, constrained = report["grammar"], report["constrained"]
    assert report["num_requests"] == 4 and grammar["mask_calls"] > 0 and grammar["accept_calls"] > 0
    assert grammar["total_s"] == pytest.approx(grammar["mask_s"] + grammar["accept_s"] + grammar["mask_apply_s"])
    assert grammar["fraction_of_step_time"] == pytest.approx(grammar["total_s"] / constrained["step_s"])
    assert constrained["num_valid_json_of_stopped"] == constrained["num_finished_stop"]
    assert "-m bench.grammar_bench" in report["command"]
