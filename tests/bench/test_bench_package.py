"""bench/ is a package: every benchmark imports as `bench.<name>`, runs as `python -m bench.<name>`
(the offline one also as `python bench/bench.py`), and nothing in bench/ or tests/ edits sys.path
to find it, apart from the one documented shim in bench/bench.py.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
from paths import REPO_ROOT


def python_files(folder: str) -> list[Path]:
    """The package's own .py files: folders that are not Python names (bench/llama.cpp-build, the
    llama.cpp checkout bench/build_llama_server.sh makes) are not part of it."""
    return sorted(p for p in (REPO_ROOT / folder).rglob("*.py")
                  if all(part.isidentifier() for part in p.relative_to(REPO_ROOT).parts[:-1]))


MODULES = ["bench.bench", "bench.measure", "bench.report", "bench.static_batching", "bench.workload",
           "bench.update_readme", "bench.spec_bench", "bench.step_bench", "bench.quant_bench", "bench.quant_speed",
           "bench.quant_accuracy", "bench.kv_agreement", "bench.serve", "bench.serve.benchmark", "bench.serve.client",
           "bench.serve.metrics", "bench.serve.targets", "bench.serve.merge", "bench.serve.plot",
           "bench.soak", "bench.soak_client", "bench.slow_readers", "bench.grammar_bench",
           "bench.grammar_backends", "bench.grammar_adapters", "bench.trace_overhead", "bench.route_sim",
           "bench.chunking", "bench.prefill_attention", "bench.gpu", "bench.gpu_attention", "bench.gpu_steps", "bench.gpu_gemv",
           "bench.gpu_launch_floor", "bench.step_overhead",
           "bench.moe", "bench.moe_step", "bench.attention_options", "bench.int_dot",
           "bench.int8_scores"]


def test_every_bench_module_is_listed_and_imports():
    found = {".".join(p.relative_to(REPO_ROOT).with_suffix("").parts).removesuffix(".__init__")
             for p in python_files("bench") if p.name != "__main__.py"}
    assert found == {"bench", *MODULES}
    for name in MODULES:
        assert importlib.import_module(name).__doc__, f"{name} has no module docstring"


@pytest.mark.parametrize("argv, usage", [
    (["bench/bench.py", "--help"], "usage: bench.py"),
    (["-m", "bench.bench", "--help"], "usage: bench.py"),
    (["-m", "bench.serve", "--help"], "usage: python -m bench.serve"),
])
def test_benchmark_entry_points_run(argv, usage):
    result = subprocess.run([sys.executable, *argv], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(usage) and "--quick" in result.stdout


def test_offline_benchmark_runs_as_a_file_from_any_directory(tmp_path):
    # The shim puts the repository root first on sys.path, so the cwd does not matter.
    result = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / "bench.py"), "--help"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_only_the_documented_shim_touches_sys_path():
    this = Path(__file__).resolve()
    offenders = [str(p.relative_to(REPO_ROOT)) for folder in ("bench", "tests") for p in python_files(folder)
                 if p.resolve() != this and "sys.path" in p.read_text()]
    assert offenders == ["bench/bench.py"]
    shim = [line.strip() for line in (REPO_ROOT / "bench" / "bench.py").read_text().splitlines()
            if "sys.path" in line and not line.lstrip().startswith("#")]
    assert shim == ["sys.path[0] = str(Path(__file__).resolve().parent.parent)"]
