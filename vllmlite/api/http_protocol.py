"""The connection, below any request: uvicorn's HTTP/1.1 protocol (h11) with what uvicorn lacks. A
deadline for each request's headers and OpenAI-shaped answers to malformed HTTP.

Owns the per-connection timers. Knows nothing of routes.
"""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from vllmlite.api.errors import error_body


def guarded_protocol(header_timeout: float) -> type[H11Protocol]:
    """uvicorn's HTTP/1.1 protocol, with:
    - a header deadline: a connection that has not sent a whole request's headers within
      `header_timeout` seconds of opening or of its previous response is closed (uvicorn has no such
      limit: a client sending a header line now and then would hold its connection forever);
    - malformed HTTP (h11's refusals: a bad Transfer-Encoding, conflicting lengths) answered with an
      OpenAI-shaped 400, then the connection closed (uvicorn's own answer is plain text).
    """

    class GuardedProtocol(H11Protocol):
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
