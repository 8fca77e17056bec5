"""llama-server's routes that run no generation: GET /props (the server's defaults and the model's chat
template) and POST /apply-template (messages rendered by the chat template, not run).

The generating route (/completion) is registered with the others in api/app.py, which owns their
disconnect and streaming handling. Knows the engine only through ServingContext.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request

from vllmlite.api.errors import bad_request
from vllmlite.api.llamacpp.protocol import (
    ApplyTemplateRequest,
    ApplyTemplateResponse,
    DefaultGenerationSettings,
    PropsResponse,
)
from vllmlite.api.llamacpp.sampling import default_settings
from vllmlite.api.openai.serving import MAX_CHARS_PER_TOKEN, ServingContext, check_model
from vllmlite.api.openai.tool_calls import hermes_messages, template_messages, tool_schema
from vllmlite.api.openapi import GUARDED, route_doc
from vllmlite.tokenizer.chat_template import CHATML_TEMPLATE, template_uses_tools
from vllmlite.version import __version__

ParseBody = Callable[[Request, type], Awaitable[Any]]


def add_llama_routes(app: FastAPI, ctx: ServingContext, parse_body: ParseBody) -> None:
    """Register /props and /apply-template; `parse_body` reads a body strictly (a 400 naming the field)."""

    @app.get("/props", **route_doc(PropsResponse))
    async def props() -> dict:
        return server_props(ctx).model_dump()

    @app.post("/apply-template", **route_doc(ApplyTemplateResponse, body=ApplyTemplateRequest,
                                             errors=(*GUARDED, 404)))
    async def apply_template(request: Request) -> dict:
        req = await parse_body(request, ApplyTemplateRequest)
        check_model(ctx, req.model)
        return ApplyTemplateResponse(prompt=render_prompt(ctx, req)).model_dump()


def server_props(ctx: ServingContext) -> PropsResponse:
    tokenizer = ctx.engine.tokenizer
    return PropsResponse(
        default_generation_settings=DefaultGenerationSettings(n_ctx=ctx.engine.max_model_len,
                                                              params=default_settings()),
        total_slots=ctx.engine.request_limits.max_num_seqs, model_alias=ctx.model_name, model_path=ctx.model_name,
        chat_template=tokenizer.chat_template or CHATML_TEMPLATE, bos_token=tokenizer.bos_token or "",
        eos_token=tokenizer.eos_token or "", build_info=f"vllmlite-{__version__}")


def render_prompt(ctx: ServingContext, req: ApplyTemplateRequest) -> str:
    """The prompt text the chat endpoint would run for these messages (tools as it renders them)."""
    tokenizer = ctx.engine.tokenizer
    messages = [m.as_dict() for m in req.messages]
    tools = None
    if template_uses_tools(tokenizer.chat_template):
        messages = template_messages(messages)
        tools = [tool_schema(t) for t in req.tools] if req.tools else None
    elif req.tools or any(m.role == "tool" or m.tool_calls for m in req.messages):
        messages = hermes_messages(messages, req.tools)
    max_chars = ctx.engine.max_model_len * MAX_CHARS_PER_TOKEN
    if sum(len(m["content"]) for m in messages) + len(json.dumps(tools)) > max_chars:
        raise bad_request(f"messages are longer than this model's context of {ctx.engine.max_model_len} "
                          "tokens can hold", "messages")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=req.add_generation_prompt,
                                             tools=tools)
    except ValueError as error:
        raise bad_request(str(error), "messages") from error
