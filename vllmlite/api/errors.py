"""API errors in OpenAI's shape `{"error": {"message", "type", "param", "code"}}` and the status map.

Owns which failure becomes which HTTP status (docs/architecture.md): validation 400, bad key 401, unknown
model or route 404, body too large 413, a body not sent as JSON 415, engine error for one request 500,
overloaded or draining 503 with Retry-After, request timeout 504. Knows nothing of routes or of the
engine's internals.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import ValidationError

from vllmlite.engine.exceptions import (
    EngineDeadError,
    EngineDrainingError,
    QueueFullError,
    RequestAbortedError,
    RequestTimeoutError,
)

RETRY_AFTER_SECONDS = 1
MAX_MESSAGE_CHARS = 1024  # an error never echoes a huge request value back (validation-error amplification)
MAX_PARAM_CHARS = 256

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    415: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class APIError(Exception):
    """An error answered to the client: status, message and the offending request field."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param)

    def sse_event(self) -> str:
        """The error as one server-sent event, for failures after a stream has started."""
        return f"data: {json.dumps(self.body(), ensure_ascii=False)}\n\n"


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object; a message or param quoting a huge request value is cut short."""
    return {"error": {"message": _cut(message, MAX_MESSAGE_CHARS), "type": ERROR_TYPES.get(status, "api_error"),
                      "param": None if param is None else _cut(param, MAX_PARAM_CHARS), "code": status}}


def _cut(text: str, limit: int) -> str:
    """
    >>> _cut("abcdef", 4)
    'abcd... (2 more characters)'
    """
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def unavailable(message: str) -> APIError:
    return APIError(503, message, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def from_engine_error(error: BaseException, param: str | None = None) -> APIError:
    """Map an exception raised while admitting or running a request to the client's error."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, ValueError):
        return bad_request(str(error), param)
    if isinstance(error, (QueueFullError, EngineDrainingError, EngineDeadError, RequestAbortedError)):
        return unavailable(str(error))
    if isinstance(error, RequestTimeoutError):
        return APIError(504, str(error))
    return APIError(500, f"internal error: {type(error).__name__}: {error}")


_UNION_TAG = re.compile(r"[^A-Za-z0-9_]")  # pydantic names union members in locs: "list[int]", "str"
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def param_path(loc: tuple) -> str | None:
    """A pydantic error location as a dotted path without union tags.

    >>> param_path(("messages", 0, "content")), param_path(("stop", "list[str]", 2)), param_path(())
    ('messages.0.content', 'stop.2', None)
    """
    parts = [str(p) for p in loc if isinstance(p, int) or not (_UNION_TAG.search(p) or p in _TYPE_TAGS)]
    return ".".join(parts) or None


def from_validation_error(error: ValidationError) -> APIError:
    """The first problem pydantic found, as a 400 naming the field's dotted path."""
    first = error.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {first['msg']}")
    if first["type"] == "model_type" and not first["loc"]:
        return bad_request("the request body must be a JSON object")
    param = param_path(tuple(first["loc"]))
    message = first["msg"].removeprefix("Value error, ")
    return bad_request(f"{param}: {message}" if param else message, param)
