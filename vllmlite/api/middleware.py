"""The request guard, a pure ASGI middleware: the message framing first, then the Host header, then
the API key, then the body size limit, then the app. What happens before there is a request (the
header deadline, the connection limit) is the connection's: http_protocol.py.

Owns refusing ambiguous framing (Content-Length with Transfer-Encoding) and unknown hosts,
authentication (a constant-time comparison of `Authorization: Bearer <key>`), and reading the body
within `max_body_bytes` (Content-Length checked first, then the bytes actually received, all before
any JSON parsing), within `body_timeout` seconds and until the server drains. Knows nothing of
routes beyond the paths that stay open (/health and the web page's files, which hold no data).
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable
from dataclasses import dataclass

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vllmlite.api.errors import RETRY_AFTER_SECONDS, APIError
from vllmlite.api.hosts import HostPolicy
from vllmlite.api.ops.web import is_page_path

# Open without the API key, as in vLLM (whose key guards /v1/*): probes, scrapers and the version.
# `--api-key-on-metrics` keeps only /health open.
OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})
DRAIN_POLL_SECONDS = 0.1  # how often a body still arriving checks whether the server drains


class _ClientGone(Exception):
    """The client disconnected while sending its body."""


@dataclass(frozen=True)
class GuardPolicy:
    """What the guard enforces, from the server's knobs."""

    api_key: str | None
    max_body_bytes: int
    body_timeout: float | None = None
    open_paths: frozenset[str] = OPEN_PATHS     # answered without the API key
    hosts: HostPolicy | None = None             # None: any Host header
    is_draining: Callable[[], bool] = lambda: False  # the server is shutting down


class RequestGuard:
    def __init__(self, app: ASGIApp, policy: GuardPolicy) -> None:
        self.app = app
        self.api_key = None if policy.api_key is None else policy.api_key.encode()
        self.max_body_bytes = policy.max_body_bytes
        self.body_timeout = policy.body_timeout
        self.open_paths = policy.open_paths
        self.hosts = policy.hosts
        self.is_draining = policy.is_draining

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        error = (_check_framing(scope) or self._check_host(scope) or self._check_authorization(scope)
                 or self._check_declared_length(scope))
        if error is None:
            try:
                body = await self._read_body(receive)
            except APIError as too_large:
                error = too_large
            except _ClientGone:
                return
        if error is not None:
            response = JSONResponse(error.body(), status_code=error.status, headers=error.headers)
            await response(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    def _check_host(self, scope: Scope) -> APIError | None:
        """DNS rebinding: a page that points its own name at this server sends that name as Host."""
        if self.hosts is None:
            return None
        header = _header(scope, b"host")
        text = None if header is None else header.decode("latin-1")
        if self.hosts.allows(text):
            return None
        return APIError(400, f"the Host header {text!r} names none of the hosts this server answers to (loopback "
                             "names and the address it listens on); add it with --allowed-hosts")

    def _check_authorization(self, scope: Scope) -> APIError | None:
        if self.api_key is None or scope["path"] in self.open_paths or is_page_path(scope["path"]):
            return None
        key = bearer_token(_header(scope, b"authorization"))
        if key is not None and hmac.compare_digest(key, self.api_key):
            return None
        return APIError(401, "a valid API key is required: send `Authorization: Bearer <key>`",
                        headers={"WWW-Authenticate": "Bearer"})

    def _check_declared_length(self, scope: Scope) -> APIError | None:
        declared = _header(scope, b"content-length")
        if declared is None:
            return None
        if not declared.isdigit():
            return APIError(400, "the Content-Length header is not a number")
        if int(declared) > self.max_body_bytes:
            return self._too_large()
        return None

    async def _read_body(self, receive: Receive) -> bytes:
        """The whole body, counted as it arrives (a chunked body has no Content-Length), within
        `body_timeout` seconds in all, and only until the server starts draining."""
        loop = asyncio.get_running_loop()
        deadline = None if self.body_timeout is None else loop.time() + self.body_timeout
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await self._next_message(receive, deadline)
            if message["type"] == "http.disconnect":
                raise _ClientGone()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise self._too_large()
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _next_message(self, receive: Receive, deadline: float | None) -> Message:
        """The next message of the body: 408 past `deadline`; 503 (and the connection closed) once the
        server drains, so a half-sent body holds neither the drain nor uvicorn's grace period."""
        loop = asyncio.get_running_loop()
        receiving = asyncio.ensure_future(receive())
        try:
            while True:
                wait = DRAIN_POLL_SECONDS if deadline is None else min(DRAIN_POLL_SECONDS, deadline - loop.time())
                done, _ = await asyncio.wait({receiving}, timeout=max(wait, 0.0))
                if done:
                    return receiving.result()
                if self.is_draining():
                    raise APIError(503, "the server is shutting down; send the request again",
                                   headers={"Retry-After": str(RETRY_AFTER_SECONDS), "Connection": "close"})
                if deadline is not None and loop.time() >= deadline:
                    raise APIError(408, f"the request body did not arrive within the server's {self.body_timeout:g} s",
                                   headers={"Connection": "close"})
        finally:
            receiving.cancel()

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than the server's limit of {self.max_body_bytes} bytes")


def bearer_token(authorization: bytes | None) -> bytes | None:
    """The token of an `Authorization: Bearer <token>` header; None for another scheme or no token.
    The scheme is case-insensitive (RFC 9110: "bearer", "BEARER" are "Bearer"); the token is not.

    >>> bearer_token(b"bearer  abc "), bearer_token(b"Basic abc"), bearer_token(b"Bearer"), bearer_token(None)
    (b'abc', None, None, None)
    """
    scheme, _, token = (authorization or b"").strip(b" ").partition(b" ")
    token = token.strip(b" ")
    return token if scheme.lower() == b"bearer" and token else None


def _check_framing(scope: Scope) -> APIError | None:
    """A request with both Content-Length and Transfer-Encoding is framed two ways (h11 reads the
    chunks, a proxy in front may have read the length): answered 400 and its connection closed, so
    no byte after it is read as another request (RFC 9112, section 6.1: request smuggling). h11
    itself refuses a Transfer-Encoding other than `chunked`, two of them, and conflicting lengths."""
    if _header(scope, b"transfer-encoding") is not None and _header(scope, b"content-length") is not None:
        return APIError(400, "the request has both Content-Length and Transfer-Encoding; send one of them",
                        headers={"Connection": "close"})
    return None


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that first hands the app the buffered body, then passes through (to see disconnects)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
