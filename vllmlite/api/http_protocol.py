"""The connection, below any request: uvicorn's HTTP/1.1 protocol (h11) with what uvicorn lacks. A
deadline for each request's headers, a bound on open connections (so on the file descriptors they
hold), OpenAI-shaped answers to malformed HTTP, and a way for the app to drop a connection whose
reader stalled.

Owns the per-connection timers and the server's connection slots. Knows nothing of routes, except
that `/health` is answered on a refused connection (a probe must see a live server).
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import Callable

import h11
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from vllmlite.api.errors import error_body, unavailable

# Connections past the limit are kept this long at most: the oldest of them is closed when one more
# comes, so file descriptors stay bounded (limit + REFUSAL_SLOTS) however many clients connect.
REFUSAL_SLOTS = 64
ALWAYS_ANSWERED = frozenset({"/health"})
CLOSE_NOW = "vllmlite.close_now"  # the scope extension: a callable that drops the connection at once


class ConnectionSlots:
    """The server's open connections: up to `limit` served; past it, up to REFUSAL_SLOTS kept only to
    answer each request 503 (or `/health`) and close, the oldest evicted when another comes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.served: set[H11Protocol] = set()
        self.refused: deque[H11Protocol] = deque()

    def admit(self, connection: H11Protocol) -> bool:
        """Take a new connection; False if it is past the limit (then it is one of the refused)."""
        if len(self.served) < self.limit:
            self.served.add(connection)
            return True
        self.refused.append(connection)
        if len(self.refused) > REFUSAL_SLOTS:
            self.refused.popleft().transport.abort()  # its connection_lost releases it
        return False

    def release(self, connection: H11Protocol) -> None:
        self.served.discard(connection)
        if connection in self.refused:
            self.refused.remove(connection)

    @property
    def num_open(self) -> int:
        return len(self.served) + len(self.refused)


def guarded_protocol(header_timeout: float, limit_concurrency: int) -> type[H11Protocol]:
    """uvicorn's HTTP/1.1 protocol, with:
    - a header deadline: a connection that has not sent a whole request's headers within
      `header_timeout` seconds of opening or of its previous response is closed (uvicorn has no such
      limit: a client sending a header line now and then would hold its connection forever);
    - at most `limit_concurrency` connections served; each request on one past it is answered 503
      with Retry-After and the connection closed, `/health` excepted;
    - malformed HTTP (h11's refusals: a bad Transfer-Encoding, conflicting lengths) answered with an
      OpenAI-shaped 400, then the connection closed (uvicorn's own answer is plain text);
    - CLOSE_NOW in each request's scope extensions, for the app to drop the connection at once.
    """
    slots = ConnectionSlots(limit_concurrency)

    class GuardedProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        connection_slots = slots  # the server's, for tests and logs

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            app = _with_close_now(self.app, self._close_now)
            self.app = app if slots.admit(self) else _refusing(app, slots)
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
            slots.release(self)
            self._disarm_header_timer()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            body = json.dumps(error_body(400, "the request is not valid HTTP/1.1 (its framing or headers are "
                                              "malformed or ambiguous)")).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
                       (b"connection", b"close")]
            try:
                for event in (h11.Response(status_code=400, headers=headers), h11.Data(data=body), h11.EndOfMessage()):
                    self.transport.write(self.conn.send(event))
            except h11.LocalProtocolError:
                pass  # a response had already begun: closing is all that is left
            self.transport.close()

        def _close_now(self) -> None:
            """Drop the connection without flushing what it has not sent (its reader takes nothing:
            closing would wait for that, holding the descriptor), the response unfinished but not
            an error to log."""
            if self.cycle is not None:
                self.cycle.disconnected = True
            self.transport.abort()

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

    return GuardedProtocol


def _with_close_now(app: ASGIApp, close_now: Callable[[], None]) -> ASGIApp:
    async def with_close_now(scope: Scope, receive: Receive, send: Send) -> None:
        scope.setdefault("extensions", {})[CLOSE_NOW] = close_now
        await app(scope, receive, send)
    return with_close_now


def _refusing(app: ASGIApp, slots: ConnectionSlots) -> ASGIApp:
    """`app` for ALWAYS_ANSWERED paths; for any other request, a 503 that closes the connection."""
    async def refusing(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["path"] in ALWAYS_ANSWERED:
            await app(scope, receive, send)
            return
        error = unavailable(f"the server has {slots.num_open} connections open, more than its limit of "
                            f"{slots.limit} (--limit-concurrency); retry later")
        body = json.dumps(error.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
                   (b"connection", b"close"), *((k.lower().encode(), v.encode()) for k, v in error.headers.items())]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})
    return refusing
