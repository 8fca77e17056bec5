"""The routing simulator's quick form end to end, and what it must show on any trace: prefix-aware
routing hits the prefix cache more than round robin does, and the report's figures agree."""

from __future__ import annotations

import json

import pytest
from bench_run import run_quick

from bench.route_sim import SimConfig, make_trace, simulate


def test_quick_run_writes_every_row_and_the_plot(tmp_path):
    out, plot = tmp_path / "sim.json", tmp_path / "sim.png"
    run_quick("bench.route_sim", out, "--plot", str(plot))
    report = json.loads(out.read_text())
    assert [(r["num_replicas"], r["policy"]) for r in report["rows"]] == [
        (n, p) for n in (2, 4) for p in ("prefix_aware", "round_robin", "least_loaded")]
    for row in report["rows"]:
        assert 0 <= row["prefix_hit_rate"] <= 1 and row["load_imbalance"] >= 1
        assert row["prefix_hit_rate"] == pytest.approx(row["prefill_tokens_saved"] / row["prefill_tokens"])
        assert sum(row["requests_served"]) == round(report["config"]["num_requests"] * (1 - report["config"]["warmup"]))
    assert plot.stat().st_size > 0 and "-m bench.route_sim" in report["command"]


def test_prefix_aware_beats_round_robin_on_a_small_trace():
    cfg = SimConfig(tenants=24, num_requests=400, blocks=300)
    trace = make_trace(cfg, 4)
    aware, rr = (simulate(cfg, trace, 4, policy) for policy in ("prefix_aware", "round_robin"))
    assert aware["prefix_hit_rate"] > 1.3 * rr["prefix_hit_rate"]
    assert aware["load_imbalance"] < 2.0
