"""Shutdown stays quiet and bounded: a body still arriving when the drain starts is answered 503 and
its connection closed (it held the drain for uvicorn's grace period, then logged a CancelledError
traceback and a 500), and a second signal exits at once, without a traceback. The drain letting an
in-flight request finish is tests/api/test_server_errors.py's."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import httpx
import pytest
from server_util import SubprocessServer, running_server, wait_until

HALF_SENT = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
             b"Content-Length: 100\r\n\r\n{\"prompt\":")
SERVER_ARGS = ["--model", "random", "--dtype", "float64", "--num-blocks", "512", "--log-level", "info"]


def half_sent(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=20)
    sock.sendall(HALF_SENT)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def assert_503_then_closed(received: bytes) -> None:
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503"), received[:300]
    assert b"connection: close" in head.lower() and b"retry-after: 1" in head.lower()
    assert json.loads(body)["error"]["code"] == 503


def test_a_half_sent_body_is_answered_503_when_draining_starts(tiny_model):
    with running_server(tiny_model, body_timeout=60) as live:
        sock = half_sent(int(live.url.rsplit(":", 1)[1]))
        time.sleep(0.3)  # the guard is waiting for the rest of the body
        started = time.monotonic()
        live.engine.begin_draining()
        received = read_until_closed(sock)
        assert time.monotonic() - started < 2, "the half-sent body held its connection past the drain"
        assert_503_then_closed(received)


@pytest.fixture
def server(tmp_path):
    started = SubprocessServer(SERVER_ARGS, env={"VLLMLITE_SHUTDOWN_TIMEOUT": "60", "VLLMLITE_BODY_TIMEOUT": "60"})
    started.start(tmp_path / "server.log")
    yield started
    started.kill()


def test_sigterm_with_a_half_sent_body_exits_promptly_and_quietly(server):
    sock = half_sent(server.port)
    time.sleep(0.3)
    started = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    assert_503_then_closed(read_until_closed(sock))
    assert server.process.wait(timeout=30) == 0
    # uvicorn's grace period is 5 s: a half-sent body used to hold the exit that long
    assert time.monotonic() - started < 4, time.monotonic() - started
    log = server.log()
    assert "Traceback" not in log and "CancelledError" not in log and '" 500' not in log, log


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_exits_at_once_without_tracebacks(server, second):
    lines: list[str] = []

    def stream() -> None:  # a request the drain would wait 60 s for
        body = {"prompt": "long", "max_tokens": 3500, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
                lines.extend(response.iter_lines())
        except httpx.HTTPError:
            pass  # the process went away mid-stream, as asked

    client = threading.Thread(target=stream)
    client.start()
    assert wait_until(lambda: len(lines) > 0 or not client.is_alive(), 20) and lines
    server.process.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    started = time.monotonic()
    server.process.send_signal(second)
    assert server.process.wait(timeout=10) == 128 + second
    assert time.monotonic() - started < 3
    client.join(timeout=10)
    log = server.log()
    assert "Traceback" not in log and "CancelledError" not in log, log
    assert f"signal {int(second)} again: exiting at once" in log

