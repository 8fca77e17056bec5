"""bench.chunking's quick path: it runs, and its report has the fields the README table and targets read."""

from __future__ import annotations

import json

from bench import chunking


def test_quick_chunking_benchmark_reports_each_policy(tmp_path):
    out = tmp_path / "bench_chunking_quick.json"
    report = chunking.main(["--quick", "--model", "random", "--targets", "2x,50,default,p99:fixed-64", "--out", str(out), "--no-plot"])
    saved = json.loads(out.read_text())
    assert [r["policy"]["name"] for r in saved["rows"]] == ["fixed-16", "fixed-64", "adaptive-2x", "adaptive-50",
                                                             "adaptive-default", "adaptive-p99:fixed-64"]
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
    default = saved["rows"][4]
    assert default["policy"]["target_tpot_ms"] is None and default["chunking"]["target_tpot_ms"] is not None
    matched = saved["rows"][5]["policy"]
    assert matched["matches"] == "fixed-64"
    assert matched["target_tpot_ms"] == round(saved["rows"][1]["stream_itl_ms"]["p99"], 1)
    assert any(t["name"].startswith("adaptive-p99:fixed-64 long TTFT mean / fixed-64's") for t in saved["targets"])
    assert len(saved["targets"]) >= 3 * 4 + 1 and {t["threshold"] for t in saved["targets"]} == {1.5, 1.2}
    alone, bound = saved["prefill_alone"], saved["ttft_bound"]
    assert alone["stream_itl_ms"]["count"] == 0 and set(alone["long_ttft_s"]["each"]) == {"96", "160"}
    assert bound["least_last_ttft_s"] == 3 * bound["prefill_alone_s"] == 3 * alone["long_ttft_s"]["max"]
    assert bound["best_fixed_last_ttft_s"] == min(r["long_ttft_s"]["max"] for r in saved["rows"][:2])
    assert saved["machine"]["git_commit"] and "bench.chunking" in saved["command"]
    table = chunking.format_table(report)
    assert table.count("\n") == 2 + len(saved["rows"]) and "streams alone (no burst)" in table


def _row(name: str, chunking: str, itl_p99: float, ttft: float) -> dict:
    return {"policy": {"name": name, "prefill_chunking": chunking}, "stream_itl_ms": {"p99": itl_p99},
            "stream_tpot_ms": {"p99": itl_p99}, "long_ttft_s": {"mean": ttft, "max": ttft}}


def test_targets_read_best_fixed_both_ways_and_the_bound():
    """Best fixed is the lowest TTFT of any fixed budget; the second reading, of those that kept the
    streams within 1.5x (absent when none did); the bound is 3x the prefill alone at 1.5x."""
    report = {"baseline": _row("alone", "fixed", 100, 0),
              "rows": [_row("fixed-16", "fixed", 140, 60.0), _row("fixed-2048", "fixed", 900, 10.0),
                       _row("adaptive-1.5x", "adaptive", 145, 33.0)],
              "prefill_alone": {"long_ttft_s": {"max": 9.0}}}
    targets = {t["name"]: t for t in chunking.check_targets(report)}
    assert targets["adaptive-1.5x stream_itl_ms p99 / baseline"]["met"]
    assert targets["adaptive-1.5x long TTFT mean / best fixed"]["value"] == 3.3
    holding = targets["adaptive-1.5x long TTFT mean / best fixed holding the streams within 1.5x (fixed-16)"]
    assert holding["value"] == 0.55 and holding["met"]
    bound = chunking.ttft_bound(report)
    assert bound["least_last_ttft_s"] == 27.0 and bound["least_over_best_fixed"] == 2.7
    report["rows"][0]["stream_itl_ms"]["p99"] = 200  # no fixed budget holds the streams: no second reading
    assert len(chunking.check_targets(report)) == 3
