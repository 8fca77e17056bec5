"""bench.update_readme: the committed docs/benchmarks.md and README headline table are what
results/*.json gives, and asking for help or a check writes nothing."""

from __future__ import annotations

import subprocess
import sys

from paths import REPO_ROOT

from bench import update_readme

GENERATED = [REPO_ROOT / "docs" / "benchmarks.md", REPO_ROOT / "README.md"]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.update_readme", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)


def test_committed_docs_match_results():
    # A results/*.json changed without `python -m bench.update_readme` fails here.
    assert update_readme.main(["--check"]) == 0


def test_help_and_check_write_nothing():
    before = [p.read_bytes() for p in GENERATED]
    helped = _run("--help")
    assert helped.returncode == 0 and helped.stdout.startswith("usage: python -m bench.update_readme")
    assert _run("--check").returncode == 0
    assert [p.read_bytes() for p in GENERATED] == before


def test_every_headline_links_a_table_that_exists():
    benchmarks = GENERATED[0].read_text()
    for _, anchor, _ in update_readme.HEADLINES:
        assert anchor is None or f'<a id="{anchor}"></a>' in benchmarks
