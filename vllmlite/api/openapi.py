"""The OpenAPI document: what each route accepts and answers, declared for bodies parsed by hand.

Routes read their bodies with `parse_body` (strict pydantic, a 400 naming the field), so FastAPI sees
no body parameter and no response model; `route_doc` declares them, and `install_openapi` adds the
protocol models' JSON schemas to the document's components. /openapi.json then describes the whole
API (schema fuzzing checks the server against it). Knows nothing of the engine; of serving, only the
tables of the fields it accepts only to reject.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from vllmlite.api.llamacpp import protocol as llamacpp
from vllmlite.api.openai.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    ErrorResponse,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from vllmlite.api.openai.protocol_responses import STREAM_EVENTS, ResponsesRequest, ResponsesResponse
from vllmlite.api.openai.serving import NO_OP_FIELDS, UNSUPPORTED_FIELDS
from vllmlite.api.openai.serving_chat import CHAT_UNSUPPORTED_FIELDS
from vllmlite.api.openai.serving_responses import RESPONSES_UNSUPPORTED_FIELDS
from vllmlite.api.ops.protocol_debug import (
    DebugEngineResponse,
    ReplicasDebugEngineResponse,
    RequestDetail,
    RequestList,
    StatsResponse,
)

REF_TEMPLATE = "#/components/schemas/{model}"
REQUEST_MODELS = (CompletionRequest, ChatCompletionRequest, ResponsesRequest, EmbeddingRequest, TokenizeRequest,
                  DetokenizeRequest, *llamacpp.REQUEST_MODELS)
RESPONSE_MODELS = (CompletionResponse, ChatCompletionResponse, ChatCompletionChunk, ResponsesResponse, *STREAM_EVENTS,
                   EmbeddingResponse, TokenizeResponse, DetokenizeResponse, ModelList, VersionResponse, ErrorResponse,
                   StatsResponse, DebugEngineResponse, ReplicasDebugEngineResponse, RequestList, RequestDetail,
                   *llamacpp.RESPONSE_MODELS)

ERROR_DESCRIPTIONS = {
    400: "Invalid request; `param` names the offending field",
    401: "Missing or wrong API key (when the server has one)",
    404: "The `model` field names a model this server does not serve (debug routes: an unknown request id)",
    408: "The body did not arrive within the server's body timeout",
    413: "The body is larger than the server's limit",
    415: "The body was not sent as `Content-Type: application/json`",
    503: "Overloaded, shutting down or the engine has failed; retry after `Retry-After` seconds",
    504: "The request ran longer than the server's request timeout",
}
GUARDED = (400, 401, 408, 413)       # every guarded route: framing, Host, API key, body time and size
GENERATE = (*GUARDED, 404, 503, 504)  # routes that run the engine
# Fields declared only to be rejected: the schema lists the values that mean "not used".
ACCEPTED_ONLY_UNUSED = {
    CompletionRequest: UNSUPPORTED_FIELDS,
    ChatCompletionRequest: (*UNSUPPORTED_FIELDS, *CHAT_UNSUPPORTED_FIELDS,
                            ("chat_template", (None,), "the model's own template is rendered")),
    ResponsesRequest: RESPONSES_UNSUPPORTED_FIELDS,
    llamacpp.LlamaCompletionRequest: llamacpp.REFUSED_FIELDS,
}


def ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF_TEMPLATE.format(model=model.__name__)}


def sse_item_schema(chunk: type[BaseModel] | Sequence[type[BaseModel]]) -> dict[str, Any]:
    """One server-sent event of a stream (OpenAPI 3.2's `itemSchema`, as FastAPI writes it): for a
    chunk model (chat, completions), `data` is a JSON chunk, an error (a failure after the stream
    started) or the final `[DONE]`; for a sequence of event models (the Responses API), `data` is
    one of them and `event` names its type, with no [DONE]."""
    if isinstance(chunk, type):
        json_data = {"type": "string", "contentMediaType": "application/json",
                     "contentSchema": {"anyOf": [ref(chunk), ref(ErrorResponse)]}}
        data = {"if": {"const": "[DONE]"}, "then": {"const": "[DONE]"}, "else": json_data}
    else:
        data = {"type": "string", "contentMediaType": "application/json",
                "contentSchema": {"anyOf": [ref(model) for model in chunk]}}
    return {"type": "object", "required": ["data"],
            "properties": {"data": data, "event": {"type": "string"}, "id": {"type": "string"},
                           "retry": {"type": "integer"}}}


def route_doc(ok: type[BaseModel] | dict[str, Any], *, body: type[BaseModel] | None = None,
              stream: type[BaseModel] | Sequence[type[BaseModel]] | None = None, errors: Sequence[int] = GUARDED,
              media_type: str = "application/json") -> dict[str, Any]:
    """Route decorator arguments declaring the JSON body `body`, the 200 answer `ok` (a model or a
    schema; plus an event stream of `stream` chunks or events when the body asks `stream: true`) and
    the OpenAI-shaped `errors`. Nothing here changes how the route parses or answers."""
    content: dict[str, Any] = {media_type: {"schema": ref(ok) if isinstance(ok, type) else ok}}
    if stream is not None:
        content["text/event-stream"] = {"itemSchema": sse_item_schema(stream)}
    responses: dict[int | str, Any] = {200: {"description": "Success", "content": content}}
    for status in (*errors, 415) if body is not None else errors:
        responses[status] = {"description": ERROR_DESCRIPTIONS[status],
                             "content": {"application/json": {"schema": ref(ErrorResponse)}}}
    extra = {} if body is None else {
        "requestBody": {"required": True, "content": {"application/json": {"schema": ref(body)}}}}
    return {"response_model": None, "responses": responses, "openapi_extra": extra}


def component_schemas() -> dict[str, Any]:
    """JSON schemas of every model `route_doc` may name: requests as they are validated, responses
    as they are serialized."""
    _, schemas = models_json_schema([(m, "validation") for m in REQUEST_MODELS]
                                    + [(m, "serialization") for m in RESPONSE_MODELS], ref_template=REF_TEMPLATE)
    defs = schemas["$defs"]
    for model in REQUEST_MODELS:  # an undeclared top-level field is a 400, but for OpenAI's no-ops
        schema = defs[model.__name__]
        schema["additionalProperties"] = False
        for name in NO_OP_FIELDS:
            schema["properties"].setdefault(name, {"description": "Accepted and ignored: it changes no output"})
    for model, fields in ACCEPTED_ONLY_UNUSED.items():
        properties = defs[model.__name__]["properties"]
        for name, unused, why in fields:
            properties[name] = {"enum": list(unused), "default": None,
                                "description": f"Not supported ({why}); only these values are accepted"}
    return defs


def install_openapi(app: FastAPI) -> None:
    """Make `app.openapi()` (served at /openapi.json) include the protocol models' schemas."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            document.setdefault("components", {}).setdefault("schemas", {}).update(component_schemas())
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
