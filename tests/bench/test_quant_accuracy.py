"""`python -m bench.quant_accuracy --quick` on the default model: float32 is its own reference (and matches
transformers), int4 rounded from float32 is a different function with a sane perplexity."""

from __future__ import annotations

import json
import math

import pytest
from bench_run import run_quick


@pytest.mark.real_model
def test_quick_run_measures_int4_rounding_against_float32(tmp_path):
    out = tmp_path / "quant_accuracy.json"
    result = run_quick("bench.quant_accuracy", out)
    assert "perplexity within 5% of float32" in result.stdout  # the table and the target line were printed
    report = json.loads(out.read_text())
    assert {"command", "machine", "text", "rows"} <= set(report)
    assert report["text"] == {"path": "bench/data/coriolanus.txt", "tokens": 512}
    none, int4 = report["rows"]
    assert [none["name"], int4["name"]] == ["none", "int4 rounded from float32"]

    assert none["max_abs_logit_diff_vs_none"] == 0 and none["perplexity_vs_none"] == 1
    assert none["greedy_same_as_none"] == none["greedy_same_as_transformers"] == none["num_prompts"] == 3
    assert none["max_abs_logit_diff_vs_transformers"] < 1e-3  # the logits captured are the last position's
    assert none["weight_error_embedding"] == none["weight_error_layers"] == 0

    assert int4["max_abs_logit_diff_vs_none"] > 0 and int4["weight_error_embedding"] > 0
    assert math.isfinite(int4["perplexity"]) and int4["perplexity"] > 1
    assert int4["perplexity_vs_none"] == pytest.approx(int4["perplexity"] / none["perplexity"])
    assert none["weights_bytes"] > 4 * int4["weights_bytes"]  # float32 vs 4 bits + a scale and min per 32
