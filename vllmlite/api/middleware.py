"""The request guard, a pure ASGI middleware: API key first, then the body size limit, then the app;
and the header deadline, at the connection (uvicorn's protocol), before there is a request at all.

Owns authentication (a constant-time comparison of `Authorization: Bearer <key>`), reading the
body within `max_body_bytes` (Content-Length checked first, then the bytes actually received,
all before any JSON parsing) and `body_timeout` seconds, and the time a connection may take to send
a request's headers. Knows nothing of routes beyond the paths that stay open (/health and the web
page's files, which hold no data).
"""

from __future__ import annotations

import asyncio
import hmac

import h11
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from vllmlite.api.errors import APIError
from vllmlite.api.ops.web import is_page_path

# Open without the API key, as in vLLM (whose key guards /v1/*): probes, scrapers and the version.
# `--api-key-on-metrics` keeps only /health open.
OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})


class _ClientGone(Exception):
    """The client disconnected while sending its body."""


class RequestGuard:
    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int, body_timeout: float | None = None,
                 open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app = app
        self.api_key = None if api_key is None else api_key.encode()
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        error = self._check_authorization(scope) or self._check_declared_length(scope)
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

    def _check_authorization(self, scope: Scope) -> APIError | None:
        if self.api_key is None or scope["path"] in self.open_paths or is_page_path(scope["path"]):
            return None
        # The scheme is case-insensitive (RFC 9110: "bearer", "BEARER" are "Bearer"); the key is not.
        scheme, _, key = (_header(scope, b"authorization") or b"").partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(b" "), self.api_key):
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
        `body_timeout` seconds in all."""
        loop = asyncio.get_running_loop()
        deadline = None if self.body_timeout is None else loop.time() + self.body_timeout
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), None if deadline is None else deadline - loop.time())
            except asyncio.TimeoutError:
                raise APIError(408, f"the request body did not arrive within the server's {self.body_timeout:g} s",
                               headers={"Connection": "close"}) from None
            if message["type"] == "http.disconnect":
                raise _ClientGone()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise self._too_large()
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than the server's limit of {self.max_body_bytes} bytes")


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


def header_timeout_protocol(header_timeout: float) -> type[H11Protocol]:
    """uvicorn's HTTP/1.1 protocol, closing a connection that has not sent a whole request's headers
    within `header_timeout` seconds of opening or of its previous response (uvicorn has no such
    limit: a client sending a header line now and then would hold its connection forever)."""

    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the headers are in
                self._disarm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.conn.their_state is h11.IDLE:  # waiting for the next request's headers
                self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_header_timer()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            self._disarm_header_timer()
            self._header_timer = self.loop.call_later(header_timeout, self._headers_too_slow)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol
