"""bench/gpu.py's CPU smoke (--device cpu): the offline run and the HTTP burst, the burst served by an
engine process that builds the shape's model itself from a loader (bench.gpu.shape_model, by name),
with --timeline recording the steps of both (in the engine process, through its loader)."""

from __future__ import annotations

import json
import subprocess
import sys

from paths import REPO_ROOT


def test_the_cpu_smoke_serves_the_burst_from_an_engine_process(tmp_path):
    out = tmp_path / "gpu.json"
    result = subprocess.run([sys.executable, "-m", "bench.gpu", "--device", "cpu", "--shapes", "tiny",
                             "--num-requests", "8", "--output-len", "8", "--out", str(out),
                             "--timeline", str(tmp_path / "steps")],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["device"] == "cpu" and row["ours"]["output_tokens"] == 64
    assert row["http"]["engine_process"] is True and row["http"]["output_tokens"] == 64
    assert "HTTP" in result.stdout and "(an engine process)" in result.stdout
    for timeline in (row["ours"]["timeline"], row["http"]["timeline"]):   # 8 requests x 8 tokens: at least 8 steps
        assert timeline["steps"] >= 8 and 0 < timeline["busy_s"] <= timeline["span_s"]
    assert (tmp_path / "steps" / "http_tiny.jsonl").read_text().count("\n") >= 8   # written in the engine process
