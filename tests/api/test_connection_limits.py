"""A bound on open connections, so on file descriptors: a few thousand idle connections (a slowloris
without even a header line) leave the server holding at most --limit-concurrency of them plus 64
refused ones, a new request is answered 503 with Retry-After, /health keeps answering, and the
server serves again once they go."""

from __future__ import annotations

import os
import resource
import socket

import httpx
import pytest
from server_util import running_server, wait_until

from vllmlite.api.cli import ServerArgs, parse_config
from vllmlite.api.http_protocol import REFUSAL_SLOTS
from vllmlite.api.server import _reserve_file_descriptors

LIMIT = 50
NUM_IDLE = 3000


def open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def enough_files():
    """This process holds both ends (the idle clients' and the server's): raise `ulimit -n` if need be."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = open_files() + 2 * NUM_IDLE + 1000
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.skip(f"ulimit -n allows at most {hard} open files; this test needs {needed}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, needed), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def test_idle_connections_past_the_limit_are_refused_and_health_answers(tiny_model, enough_files):
    with running_server(tiny_model, limit_concurrency=LIMIT, header_timeout=120) as live:
        slots = live.server.config.http_protocol_class.connection_slots
        files_before = open_files()
        idle = [connect(live.url) for _ in range(NUM_IDLE)]
        try:
            # every one accepted; the server keeps LIMIT served and REFUSAL_SLOTS refused, closing the rest
            assert wait_until(lambda: slots.num_open == LIMIT + REFUSAL_SLOTS and
                              len(live.server.server_state.connections) == LIMIT + REFUSAL_SLOTS, 60)
            assert open_files() - files_before <= NUM_IDLE + LIMIT + REFUSAL_SLOTS + 16

            refused = httpx.get(live.base_url + "/models", timeout=10)
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert refused.headers["connection"] == "close"
            error = refused.json()["error"]
            assert error["code"] == 503 and "--limit-concurrency" in error["message"]
            post = httpx.post(live.base_url + "/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=10)
            assert post.status_code == 503 and live.engine.num_unfinished_requests == 0
            for _ in range(3):
                assert httpx.get(live.url + "/health", timeout=10).status_code == 200
            assert len(live.server.server_state.connections) <= LIMIT + REFUSAL_SLOTS
        finally:
            for sock in idle:
                sock.close()
        assert wait_until(lambda: slots.num_open == 0, 30)
        served = httpx.post(live.base_url + "/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=30)
        assert served.status_code == 200


def test_connections_within_the_limit_are_all_served(tiny_model):
    with running_server(tiny_model, limit_concurrency=4) as live:
        clients = [httpx.Client(base_url=live.base_url, timeout=30) for _ in range(4)]
        try:
            for _ in range(2):  # each keeps its connection: 4 at once, none refused
                assert all(client.get("/models").status_code == 200 for client in clients)
            assert httpx.get(live.base_url + "/models", timeout=30).status_code == 503
        finally:
            for client in clients:
                client.close()


def test_the_limit_is_a_knob_with_a_bounded_default():
    assert 0 < ServerArgs().limit_concurrency <= 4096
    assert parse_config(["--limit-concurrency", "10"]).limit_concurrency == 10
    with pytest.raises(ValueError, match="limit_concurrency must be >= 1"):
        ServerArgs(limit_concurrency=0)


def test_the_server_raises_its_open_file_limit_to_what_the_limit_needs():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        _reserve_file_descriptors(1024 + REFUSAL_SLOTS + 256)
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == min(1024 + REFUSAL_SLOTS + 256, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
