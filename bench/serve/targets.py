"""The servers a serving benchmark runs against: our server or llama.cpp's llama-server, launched
here as child processes, or any OpenAI-compatible URL. Owns their command lines and lifetimes.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.report import REPO_ROOT

OURS, LLAMA, URL = "vllmlite", "llama-server", "url"
LLAMA_SERVER_BIN = REPO_ROOT / "bench" / "llama.cpp-build" / "build" / "bin" / "llama-server"
START_TIMEOUT_S = 300.0
# Our server runs with its defaults and every core, as a user starts it (no extra environment).
OURS_ENV: dict[str, str] = {}
_LABEL = re.compile(r"^([A-Za-z0-9_.+-]+)=(.*)$", re.DOTALL)


@dataclass
class Target:
    """One server under test. `args` are extra flags for a launched server; `url` is its base URL."""

    kind: str
    label: str
    args: list[str] = field(default_factory=list)
    url: str | None = None
    command: str | None = None          # the launch command as run, with its environment
    process: subprocess.Popen | None = None

    @classmethod
    def parse(cls, kind: str, spec: str) -> Target:
        """`[LABEL=]ARGS` for launched servers, `[LABEL=]URL` for --url: 'static=--batching static'."""
        match = _LABEL.match(spec)
        label, rest = (match.group(1), match.group(2)) if match and not spec.startswith("-") else (None, spec)
        if kind == URL:
            return cls(URL, label or rest, url=rest.rstrip("/").removesuffix("/v1"))
        args = shlex.split(rest)
        return cls(kind, label or " ".join([kind, *args]), args=args)

    @property
    def completions_url(self) -> str:
        return f"{self.url}/v1/completions"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _flag_value(args: list[str], names: tuple[str, ...]) -> str | None:
    for i, arg in enumerate(args[:-1]):
        if arg in names:
            return args[i + 1]
    return None


def launch_command(target: Target, model: str, gguf_path: str | None, ctx_per_slot: int,
                   port: int) -> tuple[list[str], dict[str, str]]:
    """The argv and extra environment that start `target` on `port`.

    llama-server gets the same GGUF, two threads, and unless `-c` is given, a context of
    parallel slots x `ctx_per_slot` (its KV is split evenly across slots): `-np 8` -> `-c 8 * 448`.
    """
    if target.kind == OURS:
        # --enable-prompt-tokens-details: the usage then reports the prefix cache's tokens (cached_tokens)
        argv = [sys.executable, "-m", "vllmlite.api.server", "--port", str(port), "--model", model,
                "--log-level", "warning", "--enable-prompt-tokens-details", *target.args]
        return argv, dict(OURS_ENV)
    if not LLAMA_SERVER_BIN.exists():
        raise FileNotFoundError(f"{LLAMA_SERVER_BIN} not built: run bash bench/build_llama_server.sh")
    if gguf_path is None:
        raise ValueError("llama-server needs a GGUF model")
    args = list(target.args)
    if _flag_value(args, ("-t", "--threads")) is None:
        args += ["-t", "2"]
    if _flag_value(args, ("-c", "--ctx-size")) is None:
        num_slots = int(_flag_value(args, ("-np", "--parallel")) or 1)
        args += ["-c", str(num_slots * ctx_per_slot)]
    argv = [str(LLAMA_SERVER_BIN), "-m", gguf_path, "--host", "127.0.0.1", "--port", str(port), *args]
    return argv, {}


def start(target: Target, model: str, gguf_path: str | None, ctx_per_slot: int, log_path: Path) -> None:
    """Start a launched target and wait until its /health answers 200; URL targets are left alone."""
    if target.kind == URL:
        return
    port = free_port()
    argv, extra_env = launch_command(target, model, gguf_path, ctx_per_slot, port)
    shown = ["python", *argv[1:]] if target.kind == OURS else argv  # the interpreter's path is noise
    target.command = " ".join([f"{k}={v}" for k, v in extra_env.items()] + [shlex.join(shown)])
    target.url = f"http://127.0.0.1:{port}"
    env = {**os.environ, **extra_env, "PYTHONPATH": str(REPO_ROOT)}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        target.process = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _is_healthy(target, log_path):
        if time.monotonic() > deadline:
            stop(target)
            raise RuntimeError(f"{target.label} did not become healthy; log: {log_path}")
        time.sleep(0.25)


def _is_healthy(target: Target, log_path: Path) -> bool:
    if target.process is not None and target.process.poll() is not None:
        tail = log_path.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{target.label} exited with {target.process.returncode}:\n{tail}")
    try:
        return httpx.get(f"{target.url}/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def cpu_seconds(target: Target) -> dict[str, float] | None:
    """CPU seconds a launched server has used so far (Linux /proc): the whole process, and its main
    thread alone. Our server's main thread runs the event loop (HTTP, SSE, JSON; the engine and the
    kernels have threads of their own), so its share is what the HTTP layer costs."""
    if target.process is None or not Path("/proc/self/stat").exists():
        return None
    pid, tick = target.process.pid, os.sysconf("SC_CLK_TCK")

    def read(path: str) -> float:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()  # after "pid (comm)"
        return (int(fields[11]) + int(fields[12])) / tick          # utime + stime
    return {"process": read(f"/proc/{pid}/stat"), "main_thread": read(f"/proc/{pid}/task/{pid}/stat")}


def memory_mib(target: Target) -> dict[str, float] | None:
    """A launched server's resident memory now and at its peak, in MiB (Linux /proc: VmRSS, VmHWM)."""
    if target.process is None or not Path(f"/proc/{target.process.pid}/status").exists():
        return None
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{target.process.pid}/status").read_text().splitlines()
                  if ":" in line)
    return {"rss_mib": int(fields["VmRSS"].split()[0]) / 1024, "peak_rss_mib": int(fields["VmHWM"].split()[0]) / 1024}


def stop(target: Target) -> None:
    """SIGTERM a launched target, then SIGKILL if it has not exited within 30 s."""
    process, target.process = target.process, None
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=30)


def served_model_name(target: Target) -> str:
    """The first model id in /v1/models (llama-server ignores the name, ours checks it)."""
    try:
        models = httpx.get(f"{target.url}/v1/models", timeout=10.0).json().get("data") or []
    except (httpx.HTTPError, ValueError):
        models = []
    return models[0]["id"] if models else "default"


def server_version(target: Target) -> str | None:
    """What the launched binary says it is (llama-server prints its build), and the instruction sets it was
    built for, for the JSON."""
    if target.kind != LLAMA:
        return None
    try:
        out = subprocess.run([str(LLAMA_SERVER_BIN), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    version = (out.stdout + out.stderr).strip()[-300:]
    flags = LLAMA_SERVER_BIN.parent / "cpu-flags.txt"  # the ISA options bench/build_llama_server.sh chose
    if flags.is_file():
        version += "\nbuilt with " + " ".join(flags.read_text().split())
    return version
