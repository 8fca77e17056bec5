"""What every local engine client (AsyncLLMEngine, ProcessEngine) decides the same way: its bounds,
whether one more request may queue, when a silence makes it unhealthy, and why an abort happened.
Knows nothing of threads, processes or HTTP.
"""

from __future__ import annotations

import time

from vllmlite.engine.exceptions import (
    EngineDeadError,
    EngineDrainingError,
    QueueFullError,
    RequestAbortedError,
    RequestTimeoutError,
)

ABORT_DISCONNECTED = "client disconnected"  # why a stream's reader stopped listening, in its trace


def check_bounds(max_queue: int | None, request_timeout: float | None, heartbeat_timeout: float | None) -> None:
    """An engine client's admission and liveness bounds: a ValueError naming the one out of range."""
    if max_queue is not None and max_queue < 1:
        raise ValueError(f"max_queue must be >= 1, got {max_queue}")
    for name, seconds in (("request_timeout", request_timeout), ("heartbeat_timeout", heartbeat_timeout)):
        if seconds is not None and seconds <= 0:
            raise ValueError(f"{name} must be > 0 seconds, got {seconds}")


def check_admission(health_error: str | None, closed: bool, max_queue: int | None, num_not_running: int) -> None:
    """Raise unless an engine client may queue one more request: EngineDeadError while it is unhealthy
    (dead, or hung: a queued request would only wait), EngineDrainingError once it is closed to new
    requests, QueueFullError with `max_queue` requests already not running."""
    if health_error is not None:
        raise EngineDeadError(health_error)
    if closed:
        raise EngineDrainingError("the server is shutting down and accepts no new requests")
    if max_queue is not None and num_not_running >= max_queue:
        raise QueueFullError(f"the server is overloaded: {max_queue} requests are already waiting; retry later")


def heartbeat_error(since: float | None, timeout: float | None, silence: str) -> str | None:
    """Why the engine is unhealthy once what began at `since` (monotonic seconds; None: nothing is
    running) has lasted past `timeout`, else None. `silence` formats the elapsed seconds."""
    if since is None or timeout is None:
        return None
    elapsed = time.monotonic() - since
    if elapsed <= timeout:
        return None
    return f"the engine loop is unresponsive: {silence.format(elapsed)} (heartbeat timeout {timeout:g} s)"


def abort_reason(error: BaseException | None) -> str:
    """Why a request was aborted, for its trace."""
    if error is None:
        return ABORT_DISCONNECTED
    if isinstance(error, RequestTimeoutError):
        return "timeout"
    if isinstance(error, RequestAbortedError):
        return "server shutdown"
    return str(error)
