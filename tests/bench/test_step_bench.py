"""Smoke test of the step microbenchmark: `python -m bench.step_bench --quick --model random` end to end.

Checks that every decode shape and the prefill row ran and that the reported figures agree with
each other, not how fast anything is.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from paths import REPO_ROOT


def test_step_bench_reports_every_shape_for_each_backend(tmp_path):
    out = tmp_path / "bench_step.json"
    result = subprocess.run([sys.executable, "-m", "bench.step_bench", "--quick", "--model", "random",
                             "--kernels", "numba,numpy", "--out", str(out)],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["kernels"] == ["numba", "numpy"] and set(report["kernel_warm_up_s"]) == {"numba", "numpy"}
    assert [(r["kernels"], r["num_seqs"], r["context"]) for r in report["decode"]] == [
        (k, n, c) for k in ("numba", "numpy") for n, c in [(2, 16), (4, 16), (2, 40), (4, 40)]]
    for row in report["decode"]:
        assert row["forward_s"] > 0 and row["gemm_only_s"] > 0
        assert row["ratio"] == pytest.approx(row["forward_s"] / row["gemm_only_s"])
        assert row["tokens_per_s"] == pytest.approx(row["num_seqs"] / row["forward_s"])
        assert row["rounds"] >= 3 and row["ratio_quartiles"][0] <= row["ratio_quartiles"][1]
    assert [p["kernels"] for p in report["prefill"]] == ["numba", "numpy"]
    for prefill in report["prefill"]:
        assert prefill["prompt_len"] == 32
        assert prefill["fraction_of_gemm_rate"] == pytest.approx(prefill["gemm_only_s"] / prefill["forward_s"])
    assert report["machine"]["cpu_count"] >= 1 and "-m bench.step_bench" in report["command"]


def test_step_bench_decodes_chosen_shapes_over_a_packed_cache(tmp_path):
    out = tmp_path / "bench_step.json"
    result = subprocess.run([sys.executable, "-m", "bench.step_bench", "--quick", "--model", "random",
                             "--kv-cache-dtype", "int8", "--decode", "3x20,2x40", "--out", str(out)],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["kv_cache_dtype"] == "int8" and report["prefill"] == []
    assert [(r["num_seqs"], r["context"], r["kv_cache_dtype"]) for r in report["decode"]] == [(3, 20, "int8"),
                                                                                               (2, 40, "int8")]


def test_interleaved_times_each_function_in_turn_every_round():
    """bench.measure.interleaved calls the functions in turn, round after round, after one untimed
    call each: the step bench's forward pass and GEMM-only pass see the same machine."""
    from bench.measure import interleaved
    calls = []
    times = interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=4)
    assert calls == ["a", "b"] * 5                      # the untimed first calls, then 4 rounds
    assert [len(v) for v in times.values()] == [4, 4] and all(t >= 0 for v in times.values() for t in v)
