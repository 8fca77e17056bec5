"""The errors an engine client raises to its caller: the engine is dead, full, draining, or a request
was aborted or timed out; or an engine process could not start.

Owns their names and meaning only; the API maps each to an HTTP status (api/errors.py). Knows nothing
of the engine loop or of HTTP.
"""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine loop itself failed; no request can be served until a restart."""


class QueueFullError(RuntimeError):
    """Too many requests are waiting to run; the client should retry later."""


class EngineDrainingError(RuntimeError):
    """The engine is shutting down and admits no new request."""


class RequestAbortedError(RuntimeError):
    """The request was aborted by the server (shutdown) before it finished."""


class RequestTimeoutError(RuntimeError):
    """The request ran past the engine's request timeout and was aborted."""


class EngineStartError(RuntimeError):
    """The engine process failed (or died) before its engine was ready; the message says why."""
