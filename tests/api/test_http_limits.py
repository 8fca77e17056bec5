"""HTTP limits at their edges, over raw sockets where timing matters: a body exactly at the size
limit, a body trickled in time piece by piece but late in total, and the header deadline of a
keep-alive connection's second request."""

from __future__ import annotations

import json
import select
import socket
import time

import httpx
import pytest
from server_util import running_server

LIMIT = 2048  # max_body_bytes of the server below


@pytest.fixture(scope="module")
def live(tiny_model):
    with running_server(tiny_model, max_body_bytes=LIMIT, body_timeout=0.6, header_timeout=0.6) as server:
        yield server


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def body_of_size(size: int) -> bytes:
    """A valid completions request padded with JSON whitespace to exactly `size` bytes."""
    body = json.dumps({"model": "random", "prompt": "x", "max_tokens": 1}).encode()
    assert len(body) <= size
    return body[:-1] + b" " * (size - len(body)) + b"}"


def read_until_closed(sock: socket.socket) -> bytes:
    response = b""
    try:
        while chunk := sock.recv(65536):
            response += chunk
    except ConnectionResetError:
        pass
    return response


def trickle(sock: socket.socket, pieces: list[bytes], interval: float) -> float:
    """Send a piece every `interval` seconds until the server answers or closes (or the pieces run
    out); the seconds that took."""
    start = time.monotonic()
    for piece in pieces:
        if select.select([sock], [], [], interval)[0]:
            break  # readable: an answer, or the server closed
        try:
            sock.sendall(piece)
        except OSError:
            break
    return time.monotonic() - start


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_exactly_at_the_limit_is_accepted_and_one_byte_more_is_413(live, chunked):
    """The limit is inclusive, for a declared Content-Length and for bytes counted as they arrive."""
    url = live.url + "/v1/completions"

    def send(body: bytes) -> httpx.Response:
        content = iter([body[:100], body[100:]]) if chunked else body  # a generator: no Content-Length
        return httpx.post(url, content=content, headers={"Content-Type": "application/json"})

    at_limit = send(body_of_size(LIMIT))
    assert at_limit.status_code == 200, at_limit.text
    assert send(body_of_size(LIMIT + 1)).status_code == 413


def test_a_body_trickled_past_the_body_timeout_in_total_gets_408(live):
    """Each piece arrives well within the body timeout, but the whole body does not: 408."""
    body = body_of_size(200)
    sock = connect(live.url)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body))
    # 10 bytes every 0.15 s, stopping short of the end: 3 s in all if nothing stops it
    elapsed = trickle(sock, [body[i:i + 10] for i in range(0, len(body) - 10, 10)], 0.15)
    response = read_until_closed(sock)
    sock.close()
    assert response.startswith(b"HTTP/1.1 408"), response[:200]
    assert elapsed < 2.0, f"answered after {elapsed:.1f} s: 0.6 s is for the whole body, not each piece"


def test_the_header_deadline_rearms_for_the_next_request_on_a_keep_alive_connection(live):
    """After a response, a keep-alive connection has the header timeout again to send its next
    request's headers: trickling them one line at a time does not hold it open."""
    sock = connect(live.url)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    first = b""
    while b"\r\n\r\n" not in first:
        first += sock.recv(65536)
    assert first.startswith(b"HTTP/1.1 200")
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    # a header line every 0.2 s, never the blank line: 4 s if nothing closes the connection
    elapsed = trickle(sock, [b"X-Slow-%d: 1\r\n" % i for i in range(20)], 0.2)
    assert elapsed < 2.0, f"held {elapsed:.1f} s against a header timeout of 0.6 s"
    assert read_until_closed(sock) == b""  # closed without an answer
    sock.close()
