"""bench.chunking's quick path: it runs, and its report has the fields the README table and targets read."""

from __future__ import annotations

import json

from bench import chunking


def test_quick_chunking_benchmark_reports_each_policy(tmp_path):
    out = tmp_path / "bench_chunking_quick.json"
    report = chunking.main(["--quick", "--model", "random", "--targets", "2x,50", "--out", str(out), "--no-plot"])
    saved = json.loads(out.read_text())
    assert [r["policy"]["name"] for r in saved["rows"]] == ["fixed-16", "fixed-64", "adaptive-2x", "adaptive-50"]
    assert saved["baseline"]["with_burst"] is False and saved["baseline"]["stream_itl_ms"]["count"] > 0
    for row in saved["rows"]:
        assert row["with_burst"] and set(row["long_ttft_s"]["each"]) == {"96", "160"}
        assert 0 < row["long_ttft_s"]["mean"] <= row["long_ttft_s"]["max"]
        assert row["tokens_per_s"] > 0 and row["stream_itl_ms"]["p50"] <= row["stream_itl_ms"]["p99"]
        assert row["chunking"]["policy"] == row["policy"]["prefill_chunking"]
    adaptive = saved["rows"][2]
    assert adaptive["policy"]["target_tpot_ms"] == round(2 * saved["baseline"]["stream_itl_ms"]["p50"], 1)
    assert adaptive["chunking"]["step_time_model"]["num_observations"] > 0
    assert saved["rows"][3]["policy"]["target_tpot_ms"] == 50.0
    assert len(saved["targets"]) == 3 * 2 and {t["threshold"] for t in saved["targets"]} == {1.5, 1.2}
    assert saved["machine"]["git_commit"] and "bench.chunking" in saved["command"]
    table = chunking.format_table(report)
    assert table.count("\n") == 2 + len(saved["rows"]) and "streams alone (no burst)" in table
