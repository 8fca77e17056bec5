"""`python -m bench.quant_speed` serves the default model as float32, int4 and int8 (rounded from an F32 copy)
and reports what it measured (llama-server left out: CI does not build it)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from paths import REPO_ROOT


@pytest.mark.real_model
def test_quick_run_serves_every_format_and_records_speed_and_memory(tmp_path):
    result = subprocess.run([sys.executable, "-m", "bench.quant_speed", "--quick", "--no-llama", "--out-dir", str(tmp_path)],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "quant_quick_speed.json").read_text())
    for kind in ("single_stream", "burst"):
        rows = report[kind]
        assert [r["target"] for r in rows] == ["none", "int4", "int8_from_f32"]
        for r in rows:
            assert r["errors"] == 0 and r["output_tok_s"] > 0 and r["decode_tok_s"] > 0
            assert r["server_memory"]["peak_rss_mib"] >= r["server_memory"]["rss_mib"] > 0
    raw = json.loads((tmp_path / "quant_quick_single_stream.json").read_text())
    commands = [t["command"] for t in raw["targets"]]
    assert "--quantization int4" in commands[1] and "F32.gguf --quantization int8" in commands[2]


def test_burst_medians_take_each_ratio_within_its_round():
    from bench.quant_speed import burst_medians

    def row(target, tok_s):
        return {"target": target, "output_tok_s": tok_s, "ttft_p50_s": tok_s / 10, "errors": 0}
    rounds = [[row("none", 100), row("int4", 90)],
              [row("int4", 60), row("none", 50)],       # a slow round for both: its ratio is 1.2
              [row("none", 80), row("int4", 88)]]
    none, int4 = burst_medians(rounds)
    assert (none["target"], int4["target"]) == ("none", "int4")
    assert int4["x_float32_rounds"] == [0.9, 1.2, 1.1] and int4["x_float32"] == 1.1
    assert int4["output_tok_s"] == 88 and none["output_tok_s"] == 80 and none["x_float32"] == 1.0
