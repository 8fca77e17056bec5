"""`python -m bench.quant_bench` runs on the default model's stored matrices and reports what it measured."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from paths import REPO_ROOT


@pytest.mark.real_model
def test_quick_run_times_both_paths_for_each_token_count(tmp_path):
    out = tmp_path / "bench_quant.json"
    result = subprocess.run([sys.executable, "-m", "bench.quant_bench", "--quick", "--out", str(out)], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["tokens"] for r in rows] == [1, 17]          # the few-token kernel and the BLAS tiles
    for r in rows:
        assert r["quantized_s"] > 0 and r["float32_s"] > 0
        assert r["ratio"] == r["quantized_s"] / r["float32_s"]
