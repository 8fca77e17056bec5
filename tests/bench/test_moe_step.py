"""Smoke test of `python -m bench.moe_step --quick`: both rows ran, the figures agree with each
other, and the two models have the same active MLP size (the comparison's premise), not how fast
anything is."""

from __future__ import annotations

import json

import pytest
from bench_run import run_quick


def test_moe_step_compares_equal_active_sizes_at_each_batch(tmp_path):
    out = tmp_path / "bench_moe_step.json"
    run_quick("bench.moe_step", out)
    report = json.loads(out.read_text())
    assert [row["num_seqs"] for row in report["rows"]] == [1, 32]
    for row in report["rows"]:
        assert row["moe_ms"] > 0 and row["dense_ms"] > 0
        assert row["ratio_moe_over_dense"] == pytest.approx(row["moe_ms"] / row["dense_ms"])
    params, shapes = report["shapes"]["mlp_params_per_layer"], report["shapes"]
    assert params["moe_active"] - params["dense"] == shapes["experts"] * shapes["hidden"]   # the router alone
    assert params["moe_total"] > params["moe_active"]
