"""The front end's side of the engine process's command pipe (engine_process.py): commands posted in
order from any thread, sent as one list per turn of the event loop by a writer thread of their own.

Owns the batching and the writer: a burst's adds of one event-loop turn cross the pipe as one message,
and a full pipe (the engine process busy in a long step) blocks the writer, never the event loop. A
turn that runs long (a burst of requests parsed back to back) hands what it posted to the writer every
HOLD_S seconds, so the engine starts on the first while the server still parses the rest.
Knows nothing of what commands do, except that an add's final-only mark is read when it is handed over.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

from vllmlite.engine.engine_process import AbortRequest, AddRequest, Command, ReadEngine, Shutdown
from vllmlite.engine.request_stream import GenerateRequest, RequestStream


@dataclass
class PendingAdd:
    """An add in the outbox: an AddRequest once sent, `final_only` read from its stream then."""

    request: GenerateRequest
    stream: RequestStream


Posted = PendingAdd | AbortRequest | ReadEngine | Shutdown

# The longest a posted command waits for its event-loop turn to end while the turn posts more. Run 57
# on the H200: 228 requests of a 256-request burst were parsed in one turn and reached the engine
# together 0.4 s in, which left it stepping 28 of them meanwhile.
HOLD_S = 0.002


class CommandOutbox:
    """Post commands with `post` (any thread); `on_send()` runs on the writer thread before each list
    goes out. A Shutdown is the last command sent; `close()` stops the writer without one."""

    def __init__(self, connection: Connection, on_send: Callable[[], None]) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None  # where flushes run; None: at once
        self._connection = connection
        self._on_send = on_send
        self._lock = threading.Lock()
        self._posted: list[Posted] = []
        self._held_since = 0.0  # when the first of _posted was posted
        self._flush_scheduled = False
        self._lists: queue.SimpleQueue[list[Command] | None] = queue.SimpleQueue()  # None: stop
        self._writer = threading.Thread(target=self._write, name="vllmlite-engine-writer", daemon=True)
        self._writer.start()

    def post(self, command: Posted) -> None:
        """Queue `command` behind those posted before it. It is sent on the event loop's next turn, so a
        caller that marks its stream final-only right after add_request (final_outputs does) is seen
        doing so, and every request admitted in that turn goes in one list; in a turn that runs
        longer than HOLD_S, the commands posted before this one are handed over now."""
        now = time.monotonic()
        with self._lock:
            if self._posted and now - self._held_since > HOLD_S:
                self._hand_over()
            if not self._posted:
                self._held_since = now
            self._posted.append(command)
            if self._flush_scheduled:
                return
            self._flush_scheduled = True
        try:
            if self.loop is None:
                raise RuntimeError("no event loop yet")
            self.loop.call_soon_threadsafe(self.flush)
        except RuntimeError:  # no loop, or a closed one, would ever flush: at once, then
            self.flush()

    def flush(self) -> None:
        """Hand what was posted to the writer now."""
        with self._lock:  # handed over under the lock, so two flushes keep the commands' order
            self._flush_scheduled = False
            self._hand_over()

    def _hand_over(self) -> None:  # under the lock
        if self._posted:
            self._lists.put([AddRequest(c.request, c.stream.final_only) if isinstance(c, PendingAdd) else c
                             for c in self._posted])
            self._posted = []

    def close(self, timeout: float) -> None:
        """Stop the writer once what was handed to it is sent (or within `timeout` seconds)."""
        self._lists.put(None)
        self._writer.join(timeout)

    def _write(self) -> None:
        stop = False
        while not stop:
            commands = self._lists.get()
            if commands is None:
                return
            while not self._lists.empty():  # the lists waiting together go as one
                more = self._lists.get()
                if more is None:
                    stop = True
                    break
                commands += more
            self._on_send()
            try:
                self._connection.send(commands)
            except OSError:
                return  # the engine process is gone: the front end's reader says why
            stop = stop or any(isinstance(command, Shutdown) for command in commands)
