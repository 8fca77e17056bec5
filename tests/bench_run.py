"""Running a benchmark module the way the bench tests do: its quick mode, from the repository root."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from paths import REPO_ROOT


def run_quick(module: str, out: Path, *args: str) -> subprocess.CompletedProcess:
    """`python -m <module> --quick --out <out> <args>`; asserts it exited 0 (with the end of its
    stderr if not) and returns it, for its output."""
    result = subprocess.run([sys.executable, "-m", module, "--quick", "--out", str(out), *args],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result
