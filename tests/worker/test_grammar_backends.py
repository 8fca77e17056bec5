"""Smoke test of the grammar backend comparison: `python -m bench.grammar_backends --quick` with
llguidance (and xgrammar, reported "not installed" where it is absent, as in CI).

Checks what the walks found, not how fast anything is. Uses the default model's tokenizer (~6 s).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from paths import REPO_ROOT


@pytest.mark.real_model
def test_llguidance_accepts_every_valid_document_and_refuses_every_invalid_one(tmp_path):
    out = tmp_path / "bench_grammar_backends.json"
    result = subprocess.run([sys.executable, "-m", "bench.grammar_backends", "--quick",
                             "--backends", "llguidance,xgrammar", "--out", str(out)],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["num_repetitions"] == 1 and "-m bench.grammar_backends" in report["command"]
    llg = report["backends"]["llguidance"]
    assert llg["status"] == "ok" and not llg["needs_torch"] and llg["vocabulary_ms"] > 0
    case_names = [case["name"] for case in report["cases"]]
    assert list(llg["cases"]) == case_names and len(case_names) == 5
    for name, row in llg["cases"].items():
        assert row["accepted_all"] and row["eos_at_end"] and row["rejects_invalid"], name
        # one mask before each token of the valid document, and one after its last
        assert row["num_masks"] == next(c["num_valid_tokens"] for c in report["cases"] if c["name"] == name) + 1
        assert row["mask_mean_us"] > 0 and row["warm_mask_mean_us"] > 0 and row["compile_ms"] > 0
    assert report["backends"]["xgrammar"]["status"] in ("ok", "not installed")
