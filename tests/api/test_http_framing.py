"""Request smuggling, over raw sockets: a request whose length can be read two ways (Content-Length
and Transfer-Encoding together in either order, conflicting lengths, Transfer-Encoding spelt so that
one parser reads chunks and another does not) is answered with one OpenAI-shaped 400 and its
connection closed, so the bytes behind it never run as a second request (RFC 9112, section 6.1).
Well-framed pipelined requests still get one answer each."""

from __future__ import annotations

import json
import re
import socket

import httpx
import pytest
from server_util import parse_prometheus, running_server

BODY = b'{"prompt": "hi", "max_tokens": 1}'
SMUGGLED = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY))
CHUNKED = b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY)
STATUS_LINE = re.compile(rb"HTTP/1\.1 (\d{3}) ")


@pytest.fixture(scope="module")
def live(tiny_model):
    with running_server(tiny_model) as server:
        yield server


def exchange(url: str, data: bytes, timeout: float = 5.0) -> tuple[list[int], bytes, bool]:
    """Send `data` at once; (the status of every response read, the bytes, whether the server closed
    the connection before `timeout` seconds without data)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(data)
        received, closed = b"", False
        try:
            while chunk := sock.recv(65536):
                received += chunk
            closed = True
        except ConnectionResetError:
            closed = True
        except TimeoutError:
            pass
    return [int(s) for s in STATUS_LINE.findall(received)], received, closed


def head(*lines: bytes) -> bytes:
    return b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" + \
        b"".join(line + b"\r\n" for line in lines) + b"\r\n"


def num_completions(live) -> float:
    """Requests the engine finished (0 before the first)."""
    samples = parse_prometheus(httpx.get(live.url + "/metrics").text)[1]
    return sum(s.value for s in samples if s.name == "vllmlite:request_success_total")


AMBIGUOUS = {
    # both headers: the chunked body, then a second request behind it
    "cl-te": head(b"Content-Length: %d" % len(CHUNKED), b"Transfer-Encoding: chunked") + CHUNKED + SMUGGLED,
    "te-cl": head(b"Transfer-Encoding: chunked", b"Content-Length: %d" % len(CHUNKED)) + CHUNKED + SMUGGLED,
    # a front end reading the length sends one request; read as chunks, the body ends early
    "cl-te-classic": head(b"Content-Length: %d" % (5 + len(SMUGGLED)), b"Transfer-Encoding: chunked")
    + b"0\r\n\r\n" + SMUGGLED,
    "te-tab-cl": head(b"Transfer-Encoding:\tchunked", b"Content-Length: 4") + CHUNKED + SMUGGLED,
    "te-uppercase-cl": head(b"Transfer-Encoding: CHUNKED", b"Content-Length: 4") + CHUNKED + SMUGGLED,
    "te-lowercase-name-cl": head(b"transfer-encoding: chunked", b"Content-Length: 4") + CHUNKED + SMUGGLED,
    "conflicting-cl": head(b"Content-Length: %d" % len(BODY), b"Content-Length: 4") + BODY + SMUGGLED,
    "conflicting-cl-list": head(b"Content-Length: %d, 4" % len(BODY)) + BODY + SMUGGLED,
    "te-xchunked": head(b"Transfer-Encoding: xchunked") + CHUNKED + SMUGGLED,
    "te-chunked-identity": head(b"Transfer-Encoding: chunked, identity") + CHUNKED + SMUGGLED,
    "te-twice": head(b"Transfer-Encoding: chunked", b"Transfer-Encoding: identity") + CHUNKED + SMUGGLED,
    "te-space-before-colon": head(b"Transfer-Encoding : chunked") + CHUNKED + SMUGGLED,
    "te-identity-cl": head(b"Transfer-Encoding: identity", b"Content-Length: %d" % len(BODY)) + BODY + SMUGGLED,
    "te-folded": head(b"Transfer-Encoding:", b" chunked", b"Content-Length: 4") + CHUNKED + SMUGGLED,
}


@pytest.mark.parametrize("name", AMBIGUOUS)
def test_an_ambiguously_framed_request_gets_one_400_and_the_connection_closes(live, name):
    before = num_completions(live)
    statuses, received, closed = exchange(live.url, AMBIGUOUS[name])
    assert statuses == [400] and closed, received[:400]
    error = json.loads(received.partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == 400 and error["type"] == "invalid_request_error"
    assert num_completions(live) == before  # neither the request nor the one behind it ran


def test_content_length_and_transfer_encoding_are_named_in_the_400(live):
    _, received, _ = exchange(live.url, AMBIGUOUS["cl-te"])
    assert b"both Content-Length and Transfer-Encoding" in received


@pytest.mark.parametrize("first", [
    head(b"Content-Length: %d" % len(BODY)) + BODY,
    head(b"Transfer-Encoding: chunked") + CHUNKED,
    head(b"Content-Length: %d" % len(BODY), b"Content-Length: %d" % len(BODY)) + BODY,  # the same length twice
], ids=["content-length", "chunked", "same-length-twice"])
def test_well_framed_pipelined_requests_get_an_answer_each(live, first):
    before = num_completions(live)
    statuses, received, closed = exchange(live.url, first + SMUGGLED, timeout=1.0)
    assert statuses == [200, 200] and not closed, received[:400]  # kept alive (uvicorn closes it after 5 s idle)
    assert num_completions(live) == before + 2
