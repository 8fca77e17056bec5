"""`python -m bench.quant_bench` runs on the default model's stored matrices and reports what it measured."""

from __future__ import annotations

import json

import pytest
from bench_run import run_quick


@pytest.mark.real_model
def test_quick_run_times_both_paths_for_each_token_count(tmp_path):
    out = tmp_path / "bench_quant.json"
    run_quick("bench.quant_bench", out)
    rows = json.loads(out.read_text())["rows"]
    assert [r["tokens"] for r in rows] == [1, 17]          # the few-token kernel and the BLAS tiles
    for r in rows:
        assert r["quantized_s"] > 0 and r["float32_s"] > 0
        assert r["ratio"] == r["quantized_s"] / r["float32_s"]
