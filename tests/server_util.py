"""Live-server fixtures: a real uvicorn server on a free loopback port, in a thread or a subprocess,
plus a strict parser of the Prometheus text format and small polling helpers.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from vllmlite.api.app import build_app
from vllmlite.api.cli import ServerArgs
from vllmlite.api.server import uvicorn_config
from vllmlite.engine.client import EngineClient
from vllmlite.engine.factory import make_async_engine, make_process_engine
from vllmlite.models.loader import LoadedModel

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT = 60.0


def wait_until(predicate: Callable[[], bool], timeout: float = 30.0, interval: float = 0.02) -> bool:
    """Poll `predicate` until it holds or `timeout` seconds pass; return its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


@dataclass
class ThreadServer:
    """uvicorn serving the app in a background thread; the engine stays reachable for checks."""

    engine: EngineClient  # an AsyncLLMEngine, or a ProcessEngine with engine_process=True
    config: ServerArgs
    server: uvicorn.Server
    sock: socket.socket
    thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def start(self) -> None:
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        if not wait_until(lambda: self.server.started, START_TIMEOUT):
            raise RuntimeError("the test server did not start")

    def stop(self) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout=30)
        self.sock.close()

    def is_idle(self) -> bool:
        """Every block free and no request left in the engine (polled from the test thread)."""
        stats = self.engine.get_stats().scheduler
        return self.engine.num_unfinished_requests == 0 and stats.num_kv_blocks_free == stats.num_kv_blocks


def server_config(**overrides) -> ServerArgs:
    values = dict(model="random", dtype="float64", num_blocks=1024, port=0, shutdown_timeout=2.0,
                  log_level="warning", max_queue=64)
    values.update(overrides)
    return ServerArgs(**values)


@contextlib.contextmanager
def running_server(loaded: LoadedModel, **overrides) -> Iterator[ThreadServer]:
    """A live server over the random model with `overrides` of ServerArgs; stopped on exit. With
    engine_process=True the engine process loads the random model itself (`loaded` is not sent)."""
    config = server_config(**overrides)
    engine = make_process_engine(config) if config.uses_engine_process else make_async_engine(config, loaded)
    app = build_app(engine, config)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn_config(app, config))
    live = ThreadServer(engine, config, server, sock)
    live.start()
    try:
        yield live
    finally:
        live.stop()


def is_running(pid: int) -> bool:
    """The process exists and is not a zombie waiting to be reaped (Linux's /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def engine_processes(pid: int) -> list[int]:
    """The engine processes (multiprocessing's spawned children, not its resource tracker) of process `pid`."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(child) for child in (task / "children").read_text().split()]
    return [child for child in children if "spawn_main" in Path(f"/proc/{child}/cmdline").read_text()]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class SubprocessServer:
    """`python -m vllmlite.api.server` in a child process (for signals and the CLI)."""

    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None
    log_path: Path | None = None
    start_timeout: float = START_TIMEOUT

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, log_path: Path) -> None:
        self.log_path = log_path
        env = {**os.environ, "PYTHONPATH": str(REPO), **self.env}
        command = [sys.executable, "-m", "vllmlite.api.server", "--port", str(self.port), *self.args]
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        if not wait_until(self._is_healthy, self.start_timeout, interval=0.1):
            self.kill()
            raise RuntimeError(f"server did not start:\n{self.log()}")

    def _is_healthy(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log()}")
        try:
            return httpx.get(self.url + "/health", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)


# --- Prometheus text format -----------------------------------------------------------------------

def parse_prometheus(text: str) -> tuple[dict[str, str], list[Sample]]:
    """Parse text format 0.0.4 with prometheus_client's own parser (it raises ValueError on a
    malformed line). Returns (metric name -> type, samples); a counter is named as its samples are
    (`..._total`). Checks that every sample belongs to a declared metric, and that each histogram's
    buckets are monotone, end in +Inf and that +Inf equals `_count`.
    """
    assert text.endswith("\n"), "the exposition must end with a newline"
    types: dict[str, str] = {}
    samples: list[Sample] = []
    for family in text_string_to_metric_families(text):
        assert family.type != "unknown", f"{family.name} has samples but no # TYPE"
        name = family.name + "_total" if family.type == "counter" else family.name
        assert name not in types, f"{name} declared twice"
        types[name] = family.type
        samples += family.samples
    for name, kind in types.items():
        if kind == "histogram":
            _check_histogram(name, samples)
    return types, samples


def _check_histogram(name: str, samples: list[Sample]) -> None:
    series: dict[tuple, list[tuple[float, float]]] = {}
    counts: dict[tuple, float] = {}
    for s in samples:
        key = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
        if s.name == name + "_bucket":
            series.setdefault(key, []).append((float(s.labels["le"]), s.value))
        elif s.name == name + "_count":
            counts[key] = s.value
    assert set(series) == set(counts), f"{name}: buckets and counts disagree on label sets"
    for key, buckets in series.items():
        bounds = [b for b, _ in buckets]
        values = [v for _, v in buckets]
        assert bounds == sorted(bounds) and math.isinf(bounds[-1]), f"{name}: bad bucket bounds {bounds}"
        assert values == sorted(values), f"{name}: bucket counts are not monotone {values}"
        assert values[-1] == counts[key], f"{name}: +Inf bucket {values[-1]} != _count {counts[key]}"


def num_aborted(metrics_text: str) -> float:
    """Requests counted as finished with reason "abort" (0 before the first one)."""
    return sum(s.value for s in parse_prometheus(metrics_text)[1]
               if s.name == "vllmlite:request_success_total" and s.labels.get("finished_reason") == "abort")


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of one sample (summed over label sets that include `labels`)."""
    _, samples = parse_prometheus(text)
    matching = [s.value for s in samples if s.name == name and labels.items() <= s.labels.items()]
    assert matching, f"no sample {name} {labels}"
    return sum(matching)


def fault_on(marker: str) -> Callable:
    """A runner fault hook that raises for any scheduled request whose prompt bytes contain `marker`
    (the tiny model's byte tokens): one request fails, the others must not notice."""
    def fault(scheduler_output) -> None:
        for seq in scheduler_output.scheduled:
            if marker.encode() in bytes(t for t in seq.request.prompt_token_ids if t < 256):
                raise RuntimeError("injected fault")
    return fault
