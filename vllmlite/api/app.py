"""The HTTP app: FastAPI app factory `build_app`, its routes and error handlers, over any EngineClient.

Owns the mapping of routes to serving functions, errors to OpenAI-shaped responses and client
disconnects to aborts. The process around it (uvicorn, signals, the CLI) is server.py's. Knows the
engine only through engine/client.py's interface.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from sse_starlette import EventSourceResponse
from sse_starlette.sse import SendTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import Receive, Scope, Send

from vllmlite import json_text
from vllmlite.api.cli import ServerArgs
from vllmlite.api.errors import APIError, bad_request, error_body, from_validation_error, param_path, unavailable
from vllmlite.api.hosts import HostPolicy
from vllmlite.api.http_protocol import CLOSE_NOW
from vllmlite.api.llamacpp.protocol import (
    COMPLETION_ANSWER_SCHEMA,
    LlamaCompletionRequest,
    LlamaCompletionResponse,
    LlamaTokenizeResponse,
)
from vllmlite.api.llamacpp.routes import add_llama_routes
from vllmlite.api.llamacpp.serving_completion import create_llama_completion, prepare_llama_completion
from vllmlite.api.llamacpp.serving_tokenize import is_llama_tokenize, llama_tokenize
from vllmlite.api.middleware import OPEN_PATHS, GuardPolicy, RequestGuard, bearer_token
from vllmlite.api.openai.constraints import is_constrained
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
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from vllmlite.api.openai.protocol_fields import MAX_NAME_CHARS, SamplingFields
from vllmlite.api.openai.protocol_responses import STREAM_EVENTS, ResponsesRequest, ResponsesResponse
from vllmlite.api.openai.reasoning import reasoning_format
from vllmlite.api.openai.serving import (
    Admission,
    ServingContext,
    check_model,
    encode_prompt,
    new_request_id,
    reject_unknown_fields,
)
from vllmlite.api.openai.serving_chat import create_chat, prepare_chat, render_messages
from vllmlite.api.openai.serving_completions import create_completion, prepare_completion
from vllmlite.api.openai.serving_embeddings import create_embeddings, prepare_embeddings
from vllmlite.api.openai.serving_responses import chat_request, create_response, new_response_id, prepare_response
from vllmlite.api.openapi import GENERATE, GUARDED, install_openapi, ref, route_doc
from vllmlite.api.ops.debug import add_stats_and_debug_routes
from vllmlite.api.ops.web import add_web_routes
from vllmlite.engine.client import EngineClient
from vllmlite.engine.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from vllmlite.version import __version__

logger = logging.getLogger("vllmlite.api.server")  # one logger for the server, app and process
Model = TypeVar("Model", bound=BaseModel)
Req = TypeVar("Req", bound=SamplingFields)
Prepared = TypeVar("Prepared")
SSE_HEADERS = {"Cache-Control": "no-cache"}


def build_app(engine: EngineClient, config: ServerArgs) -> FastAPI:
    """The OpenAI-compatible app over `engine`; its lifespan starts and drains the engine thread."""
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        stats_logger = asyncio.ensure_future(_log_stats(engine, config.log_stats_interval))
        yield
        stats_logger.cancel()
        await asyncio.to_thread(engine.shutdown, config.shutdown_timeout)

    app = FastAPI(title="vllmlite", version=__version__, lifespan=lifespan)
    app.state.engine = engine
    app.state.config = config
    _add_error_handlers(app)
    ctx = ServingContext(engine, config.model_name, config.special_tokens_in_messages,
                         config.enable_prompt_tokens_details, reasoning_format(config.reasoning_parser))
    _add_info_routes(app, ctx)
    _add_token_routes(app, ctx)
    _add_generate_routes(app, ctx, config)
    add_llama_routes(app, ctx, parse_body)
    add_stats_and_debug_routes(app, engine, config.enable_debug_endpoints, replicated=config.uses_ray)
    add_web_routes(app)
    install_openapi(app)
    open_paths = frozenset({"/health"}) if config.api_key_on_metrics else OPEN_PATHS
    app.add_middleware(RequestGuard, policy=GuardPolicy(
        config.api_key, config.max_body_bytes, config.body_timeout, open_paths,
        HostPolicy(config.host, config.allowed_hosts), lambda: engine.is_draining))
    # Added last, so outermost: a browser's preflight (which carries no API key) is answered before
    # the guard, and the guard's errors carry the CORS headers a page needs to read them.
    app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins),
                       allow_methods=list(config.allowed_methods), allow_headers=list(config.allowed_headers),
                       allow_credentials=config.allow_credentials)
    return app


async def _log_stats(engine: EngineClient, interval: float) -> None:
    """vLLM's stats line every `interval` seconds: at INFO while there is work, DEBUG when idle."""
    if not interval or engine.metrics is None:
        return
    engine.metrics.log_line(time.monotonic())  # the first interval starts now
    while True:
        await asyncio.sleep(interval)
        line, is_busy = engine.metrics.log_line(time.monotonic())
        logger.log(logging.INFO if is_busy else logging.DEBUG, line)


# --- errors -------------------------------------------------------------------------------------

def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        loc = tuple(first.get("loc", ()))
        param = param_path(loc[1:] if loc and loc[0] in ("body", "query", "path") else loc)
        return JSONResponse(error_body(400, f"{param}: {first.get('msg')}" if param else str(first.get("msg")),
                                       param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        message = (f"no route for {request.method} {request.url.path}" if error.status_code == 404
                   else str(error.detail))
        return JSONResponse(error_body(error.status_code, message), status_code=error.status_code,
                            headers=getattr(error, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body(500, f"internal error: {type(error).__name__}"), status_code=500)


async def parse_body(request: Request, model: type[Model]) -> Model:
    """The body as `model`, parsed strictly from JSON sent as JSON (415 otherwise); any problem, an
    unknown field included, is a 400 naming the field. JSON nested past json_text's bound, or with
    a key twice in one object, is a 400 too (were the last value to win, `"role": "user", ...,
    "role": "system"` would pass as a system message)."""
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":  # as vLLM: else a page's form or text/plain POST needs no preflight
        raise APIError(415, f"the request body must be JSON sent as Content-Type: application/json, not "
                            f"{media_type or 'without a Content-Type'}")
    body = await request.body()
    try:
        json_text.loads(body)
    except json_text.JSONTextError as error:
        raise bad_request(f"the request body {error}") from None
    except ValueError:
        pass  # not JSON at all: pydantic's parse below says where
    try:
        parsed = model.model_validate_json(body)
    except ValidationError as error:
        raise from_validation_error(error) from error
    reject_unknown_fields(parsed)
    return parsed


# --- routes -------------------------------------------------------------------------------------

def _add_info_routes(app: FastAPI, ctx: ServingContext) -> None:
    engine = ctx.engine

    # Two routes, not one with two methods, so each operation has its own id in /openapi.json.
    @app.get("/health", **route_doc({"type": "object", "maxProperties": 0}, errors=(503,)))
    @app.head("/health", **route_doc({"type": "object", "maxProperties": 0}, errors=(503,)))  # load balancers' probes
    async def health() -> JSONResponse:
        unhealthy = engine.health_error
        if unhealthy is not None:
            return _error_response(unavailable(unhealthy))
        if engine.is_draining:
            return _error_response(unavailable("the server is shutting down"))
        return JSONResponse({})

    @app.get("/version", **route_doc(VersionResponse))
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/v1/models", **route_doc(ModelList))
    @app.get("/models", include_in_schema=False)  # llama-server's path too
    async def models() -> dict:
        # root names the model, never its file: no filesystem path goes into a response.
        card = ModelCard(id=ctx.model_name, root=ctx.model_name, max_model_len=engine.max_model_len)
        return ModelList(data=[card]).model_dump()

    @app.get("/metrics", response_class=PlainTextResponse,
             **route_doc({"type": "string"}, media_type="text/plain"))
    @app.head("/metrics", response_class=PlainTextResponse,  # scrapers' and probes' HEAD
              **route_doc({"type": "string"}, media_type="text/plain"))
    async def metrics() -> Response:
        text = engine.metrics.render() if engine.metrics is not None else ""
        return PlainTextResponse(text, media_type=METRICS_CONTENT_TYPE)


def _add_token_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.post("/tokenize", **route_doc({"anyOf": [ref(TokenizeResponse), ref(LlamaTokenizeResponse)]},
                                       body=TokenizeRequest, errors=(*GUARDED, 404)))
    async def tokenize(request: Request) -> dict:
        req = await parse_body(request, TokenizeRequest)
        check_model(ctx, req.model)
        if is_llama_tokenize(req):  # llama-server's {"content", "add_special", "with_pieces"}
            return llama_tokenize(ctx, req).model_dump()
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("send exactly one of prompt or messages", "prompt")
        if req.messages is not None:  # vLLM's defaults: special tokens for a prompt, none for messages
            tokens = render_messages(ctx, req.messages, req.add_generation_prompt, bool(req.add_special_tokens))
        else:
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
            tokens = encode_prompt(ctx, req.prompt, "prompt", add_special_tokens=add_special)
        return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=ctx.engine.max_model_len).model_dump()

    @app.post("/detokenize", **route_doc(DetokenizeResponse, body=DetokenizeRequest, errors=(*GUARDED, 404)))
    async def detokenize(request: Request) -> dict:
        req = await parse_body(request, DetokenizeRequest)
        check_model(ctx, req.model)
        vocab_size = ctx.engine.tokenizer.vocab_size
        if any(not 0 <= t < vocab_size for t in req.tokens):
            raise bad_request(f"tokens must be token ids in [0, {vocab_size})", "tokens")
        text = ctx.engine.tokenizer.decode(req.tokens, skip_special_tokens=True)
        return DetokenizeResponse(prompt=text, content=text).model_dump()


def _add_generate_routes(app: FastAPI, ctx: ServingContext, config: ServerArgs) -> None:
    async def respond(request: Request, work: Awaitable[Any]) -> Response:
        """Run `work` until it returns or the client disconnects (then it is cancelled, so its
        requests are aborted); a pydantic result becomes JSON, an async iterator an event stream."""
        result = await _until_disconnect(request, work)
        if result is None:
            return Response(status_code=499)  # nobody is listening
        if isinstance(result, BaseModel):
            return JSONResponse(result.model_dump())
        # A reader that takes no bytes for stream_send_timeout seconds is cut off: the stream
        # closes, which cancels its requests. Pings keep proxies from closing a quiet stream.
        return _EventStream(result, headers=SSE_HEADERS, sep="\n", ping=config.stream_ping_interval,
                            send_timeout=config.stream_send_timeout)

    @app.post("/v1/completions", **route_doc(CompletionResponse, body=CompletionRequest, stream=CompletionResponse,
                                             errors=GENERATE))
    async def completions(request: Request) -> Response:
        req = await parse_body(request, CompletionRequest)
        prepared = await _prepare(prepare_completion, ctx, req)
        admission = _admission(request, "cmpl", req)
        return await respond(request, create_completion(ctx, prepared, admission))

    @app.post("/v1/chat/completions", **route_doc(ChatCompletionResponse, body=ChatCompletionRequest,
                                                  stream=ChatCompletionChunk, errors=GENERATE))
    @app.post("/chat/completions", include_in_schema=False)  # llama-server's path too
    async def chat_completions(request: Request) -> Response:
        req = await parse_body(request, ChatCompletionRequest)
        prepared = await _prepare(prepare_chat, ctx, req)
        admission = _admission(request, "chatcmpl", req)
        return await respond(request, create_chat(ctx, prepared, admission))

    @app.post("/v1/responses", **route_doc(ResponsesResponse, body=ResponsesRequest, stream=STREAM_EVENTS,
                                           errors=GENERATE))
    @app.post("/responses", include_in_schema=False)  # llama-server's path too
    async def responses(request: Request) -> Response:
        req = await parse_body(request, ResponsesRequest)
        chat_req = chat_request(req)
        prepared = await _prepare(prepare_response, ctx, chat_req)
        admission = Admission(new_response_id(), _client_id(request, req.user))
        return await respond(request, create_response(ctx, req, prepared, admission))

    # llama-server's native completion; its /completions is this one too (its OpenAI one is /v1/completions)
    @app.post("/completion", **route_doc(COMPLETION_ANSWER_SCHEMA, body=LlamaCompletionRequest,
                                         stream=LlamaCompletionResponse, errors=GENERATE))
    @app.post("/completions", include_in_schema=False)
    async def llama_completion(request: Request) -> Response:
        req = await parse_body(request, LlamaCompletionRequest)
        prepared = await _prepare(prepare_llama_completion, ctx, req)
        admission = Admission(new_request_id("cmpl"), _client_id(request, None))
        return await respond(request, create_llama_completion(ctx, prepared, admission))

    @app.post("/v1/embeddings", **route_doc(EmbeddingResponse, body=EmbeddingRequest, errors=GENERATE))
    async def embeddings(request: Request) -> Response:
        req = await parse_body(request, EmbeddingRequest)
        token_lists = prepare_embeddings(ctx, req)
        admission = Admission(new_request_id("embd"), _client_id(request, req.user))
        return await respond(request, create_embeddings(ctx, req, token_lists, admission))


class _EventStream(EventSourceResponse):
    """sse-starlette's response; a stalled reader is logged in one line and its connection dropped at
    once (uvicorn would log the unfinished response as an error, then wait to flush it)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except SendTimeoutError:
            logger.warning("%s %s: a send to the client waited %g s; its stream is closed and its request aborted",
                           scope["method"], scope["path"], self.send_timeout)
            close_now = scope.get("extensions", {}).get(CLOSE_NOW)
            if close_now is not None:  # uvicorn through http_protocol.py
                close_now()


async def _prepare(prepare: Callable[[ServingContext, Req], Prepared], ctx: ServingContext, req: Req) -> Prepared:
    """`prepare(ctx, req)`; on a worker thread if the request constrains its output, since checking a
    large schema can take a tenth of a second: the event loop keeps serving the others meanwhile."""
    if is_constrained(req):
        return await asyncio.to_thread(prepare, ctx, req)
    return prepare(ctx, req)


def _admission(request: Request, prefix: str, req: SamplingFields) -> Admission:
    return Admission(new_request_id(prefix), _client_id(request, req.user), req.priority, req.cache_salt)


def _client_id(request: Request, user: str | None) -> str | None:
    """Fairness key: the X-Client-Id header, else the body's `user` (OpenAI's end-user id), else a
    hash of the bearer token, else None."""
    client_id = request.headers.get("x-client-id")
    if client_id is not None:
        if not 0 < len(client_id) <= MAX_NAME_CHARS:
            raise bad_request(f"X-Client-Id must have 1 to {MAX_NAME_CHARS} characters", "X-Client-Id")
        return client_id
    if user:
        return "user-" + user
    token = bearer_token(request.headers.get("authorization", "").encode("latin-1"))
    if token is not None:  # the same key in any spelling of the scheme is the same client
        return "key-" + hashlib.sha256(token).hexdigest()[:16]
    return None


async def _until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """`work`'s result, or None once the client disconnects (`work` is cancelled then).

    `work` runs in this task, not one of its own: its requests reach the engine in the same turn of
    the event loop as their parsing. A task would start a turn later, after every other request of a
    burst had been parsed (run 57 on the H200: 228 of 256 reached the engine together 0.4 s in)."""
    handler = asyncio.current_task()
    assert handler is not None
    disconnected = False

    async def watch() -> None:
        nonlocal disconnected
        await _wait_for_disconnect(request)
        disconnected = True
        handler.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if not disconnected:
            raise
        if hasattr(handler, "uncancel"):  # Python >= 3.11: this cancel was ours, and is handled
            handler.uncancel()
        return None
    finally:
        watcher.cancel()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)
