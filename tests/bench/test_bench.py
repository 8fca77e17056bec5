"""Smoke test of the offline benchmark: `bench/bench.py --quick --model random` end to end.

Checks the JSON's shape and that its numbers agree with each other, not how fast anything is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from paths import REPO_ROOT

ROW_NAMES = ["sequential", "static_4", "static_8", "static_16", "paged", "prefix_off", "prefix_on"]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "bench_offline.json"
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "bench/bench.py", "--quick", "--model", "random", "--out", str(out)],
                            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "paged_throughput_vs_sequential" in result.stdout  # the table and target lines were printed
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def rows(report) -> dict[str, dict]:
    return {row["name"]: row for row in report["rows"]}


def test_every_row_ran_every_request(report, rows):
    assert [row["name"] for row in report["rows"]] == ROW_NAMES
    num_requests = report["settings"]["num_requests"]
    for row in rows.values():
        assert len(row["requests"]) == row["num_requests"] == num_requests
        assert sorted(r["request_id"] for r in row["requests"]) == [f"req-{i:03d}" for i in range(num_requests)]


def test_every_request_got_exactly_max_tokens(rows):
    for row in rows.values():
        assert row["all_complete"]
        for r in row["requests"]:
            assert r["output_tokens"] == r["max_tokens"], (row["name"], r)
            assert r["finish_reason"] == "length"


def test_rows_of_a_workload_serve_the_same_requests(rows):
    base = {r["request_id"]: (r["prompt_tokens"], r["max_tokens"]) for r in rows["sequential"]["requests"]}
    system_len = 32  # --quick
    for name in ROW_NAMES:
        extra = system_len if rows[name]["workload"] == "shared_prefix" else 0
        assert {r["request_id"]: (r["prompt_tokens"] - extra, r["max_tokens"]) for r in rows[name]["requests"]} == base


def test_latencies_and_rates_are_positive_and_consistent(rows):
    for row in rows.values():
        assert row["wall_time_s"] > 0 and row["output_tokens_per_s"] > 0
        assert row["output_tokens"] == sum(r["output_tokens"] for r in row["requests"])
        assert row["output_tokens_per_s"] == pytest.approx(row["output_tokens"] / row["wall_time_s"])
        assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"]
        assert row["tpot_mean_s"] > 0
        for r in row["requests"]:
            assert 0 < r["ttft_s"] <= r["e2e_s"] <= row["wall_time_s"] + 1e-6


def test_forward_passes_fall_as_batching_grows(rows):
    # Sequential runs one pass per output token at least; batching shares passes between requests.
    seq = rows["sequential"]
    assert seq["forward_passes"] >= seq["output_tokens"]
    passes = [rows[n]["forward_passes"] for n in ("sequential", "static_4", "static_8", "static_16")]
    assert passes == sorted(passes, reverse=True)
    assert rows["paged"]["forward_passes"] <= rows["static_16"]["forward_passes"]


def test_kv_utilization_is_a_fraction_and_paged_wastes_less(rows):
    for row in rows.values():
        assert 0 < row["kv_utilization"] <= 1
        assert 0 < row["kv_budget_fraction_mean"] <= row["kv_budget_fraction_peak"] <= 1
    assert rows["static_16"]["kv_budget_fraction_mean"] == 1.0  # B=16 reserves the whole budget
    assert rows["paged"]["kv_utilization"] > max(rows[n]["kv_utilization"] for n in ROW_NAMES if n.startswith("static"))


def test_prefix_caching_hits_the_shared_system_prompt(rows):
    assert rows["prefix_off"]["prefix_hit_rate"] is None
    assert rows["prefix_on"]["prefix_hit_rate"] > 0
    hits = [r["cached_tokens"] for r in rows["prefix_on"]["requests"]]
    # Requests admitted in the first step prefill the system prompt side by side (its blocks are
    # published only after that step); later ones reuse exactly those 32 tokens (2 blocks).
    assert set(hits) == {0, 32} and hits.count(32) >= len(hits) // 2
    assert all(r["cached_tokens"] == 0 for r in rows["prefix_off"]["requests"])


def test_greedy_outputs_do_not_depend_on_batching(rows):
    # The random model runs in float32 here; exact agreement holds for this tiny seeded workload.
    for row in rows.values():
        assert row["agreement"] == f"{row['num_requests']}/{row['num_requests']}"


def test_report_records_machine_and_targets(report):
    machine = report["machine"]
    assert machine["cpu_count"] >= 1 and machine["numpy"] and machine["python"]
    assert "bench/bench.py --quick --model random" in report["command"]
    names = {t["name"] for t in report["targets"]}
    assert names == {"paged_throughput_vs_sequential", "paged_kv_utilization", "static_kv_utilization_far_lower",
                     "prefix_caching_throughput", "prefix_caching_mean_ttft"}
