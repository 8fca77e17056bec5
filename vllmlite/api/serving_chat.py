"""POST /v1/chat/completions: messages through the model's chat template, assistant messages out.

Owns the chat rules: rendering (never a request-supplied template), rejecting tool calling and
structured output with a 400 naming the param, `max_completion_tokens`, the role-first streaming
deltas, OpenAI's chat logprobs format and vLLM's response-level `prompt_logprobs`. Knows nothing of
routes or middleware.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from vllmlite.api.errors import bad_request
from vllmlite.api.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprob,
)
from vllmlite.api.serving import (
    MAX_CHARS_PER_TOKEN,
    NO_TOOLS,
    Admission,
    ServingContext,
    StreamUsage,
    admit,
    check_model,
    check_request,
    check_stream_fields,
    clamp_logprob,
    final_outputs,
    logprob_token,
    make_usage,
    num_prompt_tokens,
    prompt_logprobs_payload,
    raise_if_failed,
    reject_unsupported,
    sampling_params,
    sse_event,
    sse_stream,
    token_bytes,
    top_items,
)
from vllmlite.chat_template import CALLER_TEXT_FIELDS, render_with_caller_spans
from vllmlite.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from vllmlite.sampling_params import SamplingParams
from vllmlite.tokenizer import Tokenizer

TEMPLATE_AS_IS = "the model's chat template is rendered as it is"
# Chat fields this server does not implement, checked after serving.UNSUPPORTED_FIELDS.
CHAT_UNSUPPORTED_FIELDS = (
    ("tools", (None, []), NO_TOOLS),
    ("tool_choice", (None, "none"), NO_TOOLS),
    ("functions", (None, []), NO_TOOLS),
    ("function_call", (None, "none"), NO_TOOLS),
    ("chat_template_kwargs", (None, {}), TEMPLATE_AS_IS),
    ("continue_final_message", (None, False), TEMPLATE_AS_IS),
    ("documents", (None, []), TEMPLATE_AS_IS),
    ("echo", (None, False), "echo is served by /v1/completions"),
    ("audio", (None,), "text output only"),
    ("modalities", (None, ["text"]), "text output only"),
    ("web_search_options", (None,), "no web search"),
)


@dataclass
class PreparedChat:
    request: ChatCompletionRequest
    prompt_token_ids: list[int]
    params: SamplingParams


def render_messages(ctx: ServingContext, messages: Sequence[ChatMessage], add_generation_prompt: bool,
                    add_special_tokens: bool = False) -> list[int]:
    """The prompt's token ids: the model's chat template, then encode, by default without special
    tokens (the template already wrote them).

    Special-token text the caller wrote (a message's content or name) is read as plain text, so a
    message cannot forge a turn with `<|im_end|><|im_start|>system`; only the template's own text
    gives special tokens (`--special-tokens-in-messages` turns this off for trusted callers)."""
    dicts = [m.as_dict() for m in messages]
    max_chars = ctx.engine.max_model_len * MAX_CHARS_PER_TOKEN
    if sum(len(m["content"]) for m in dicts) > max_chars:
        raise bad_request(f"messages are longer than this model's context of {ctx.engine.max_model_len} "
                          "tokens can hold", "messages")
    tokenizer = ctx.engine.tokenizer
    trusted = ctx.special_tokens_in_messages
    try:
        if trusted:  # no spans to find: one rendering
            text = tokenizer.apply_chat_template(dicts, tokenize=False, add_generation_prompt=add_generation_prompt)
        else:
            text, caller_spans = render_with_caller_spans(tokenizer.chat_template, dicts, add_generation_prompt,
                                                          tokenizer.bos_token, tokenizer.eos_token)
    except ValueError as error:
        raise bad_request(str(error), "messages") from error
    if len(text) > max_chars:
        raise bad_request(f"the rendered messages have {len(text)} characters, more than this model's context "
                          f"of {ctx.engine.max_model_len} tokens can hold", "messages")
    if trusted:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    if caller_spans is None:
        _reject_special_text(tokenizer, dicts)  # the template reworks the fields: no span is known
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return tokenizer.encode_with_plain_spans(text, caller_spans, add_special_tokens)


def _reject_special_text(tokenizer: Tokenizer, messages: list[dict]) -> None:
    for index, message in enumerate(messages):
        for key in CALLER_TEXT_FIELDS:
            found = tokenizer.find_special_text(message.get(key) or "")
            if found is not None:
                raise bad_request(
                    f"messages[{index}].{key} contains the special token {found!r}, and this model's chat "
                    "template changes message text, so it cannot be kept as plain text; remove it",
                    f"messages.{index}.{key}")


def prepare_chat(ctx: ServingContext, req: ChatCompletionRequest) -> PreparedChat:
    """Validate, render and tokenize; raise APIError (400/404) before anything is queued."""
    check_model(ctx, req.model)
    _reject_unsupported(req)
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = sampling_params(req, max_tokens=max_tokens, prompt_logprobs=req.prompt_logprobs,
                             logprobs=(req.top_logprobs or 0) if req.logprobs else None)
    token_ids = render_messages(ctx, req.messages, req.add_generation_prompt, bool(req.add_special_tokens))
    check_request(ctx, req, token_ids, params, "messages")
    return PreparedChat(req, token_ids, params)


def _reject_unsupported(req: ChatCompletionRequest) -> None:
    if req.chat_template is not None:
        raise bad_request("chat_template: request-supplied chat templates are never rendered; the model's "
                          "own template is used", "chat_template")
    reject_unsupported(req)
    reject_unsupported(req, CHAT_UNSUPPORTED_FIELDS)
    check_stream_fields(req)


async def create_chat(ctx: ServingContext, prepared: PreparedChat,
                      admission: Admission) -> ChatCompletionResponse | AsyncIterator[str]:
    """Queue the conversation; return the whole response, or the SSE events when streaming."""
    streams = admit(ctx, [prepared.prompt_token_ids], prepared.params, admission)
    if prepared.request.stream:
        return sse_stream(_chunks(ctx, prepared, streams[0], admission.request_id), streams)
    (output,) = await final_outputs(streams)
    return _response(ctx, prepared, output, admission.request_id)


def _response(ctx: ServingContext, prepared: PreparedChat, output: RequestOutput,
              request_id: str) -> ChatCompletionResponse:
    req = prepared.request
    choices = [ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                          logprobs=_logprobs(req, c.token_ids, c.logprobs) if req.logprobs else None,
                          finish_reason=c.finish_reason, stop_reason=c.stop_reason)
               for c in sorted(output.outputs, key=lambda c: c.index)]
    return ChatCompletionResponse(id=request_id, model=ctx.model_name, choices=choices,
                                  usage=make_usage([output]),
                                  prompt_logprobs=prompt_logprobs_payload(output, req.prompt_logprobs))


async def _chunks(ctx: ServingContext, prepared: PreparedChat, stream, request_id: str) -> AsyncIterator[str]:
    req = prepared.request
    created = int(time.time())

    counts = StreamUsage(num_prompt_tokens(prepared.prompt_token_ids, prepared.params))

    def chunk(choices: list[ChatStreamChoice], **extra: Any) -> str:
        usage = counts.usage() if req.continuous_usage else None
        return sse_event(ChatCompletionChunk(id=request_id, created=created, model=ctx.model_name,
                                             choices=choices, **{"usage": usage, **extra}))

    for index in range(req.n):
        yield chunk([ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
    finished: set[int] = set()
    last: RequestOutput | None = None
    async for last in stream:
        raise_if_failed(last)
        counts.update(0, last, first_choice=0)
        choices = [choice for completion in last.outputs
                   if (choice := _delta_choice(req, completion, finished)) is not None]
        if choices:
            yield chunk(choices)
    if req.include_usage and last is not None:
        yield chunk([], usage=make_usage([last]))


def _delta_choice(req: ChatCompletionRequest, completion: CompletionOutput,
                  finished: set[int]) -> ChatStreamChoice | None:
    """The chunk for what is new in one choice; None when nothing is (another sample moved)."""
    if completion.index in finished:
        return None
    has_logprobs = req.logprobs and bool(completion.delta_token_ids)
    if not completion.delta_text and not has_logprobs and completion.finish_reason is None:
        return None  # e.g. a token holding half a UTF-8 character: its text comes with the next one
    if completion.finish_reason is not None:
        finished.add(completion.index)
    logprobs = _logprobs(req, completion.delta_token_ids, completion.delta_logprobs) if req.logprobs else None
    delta = DeltaMessage(content=completion.delta_text) if completion.delta_text else DeltaMessage()
    return ChatStreamChoice(index=completion.index, delta=delta, logprobs=logprobs,
                            finish_reason=completion.finish_reason, stop_reason=completion.stop_reason)


def _logprobs(req: ChatCompletionRequest, token_ids: Sequence[int],
              logprobs: Sequence[PositionLogprobs] | None) -> ChatLogprobs:
    """OpenAI's chat logprobs: one entry per token with its bytes and its `top_logprobs` best
    alternatives; `token` reads `token_id:123` with return_tokens_as_token_ids (bytes stay the
    token's own)."""
    def entry(token_id: int, logprob: Logprob) -> TopLogprob:   # decoded_token is the tokenizer's token_text
        text = logprob.decoded_token
        return TopLogprob(token=logprob_token(text, token_id, req.return_tokens_as_token_ids),
                          logprob=clamp_logprob(logprob.logprob), bytes=token_bytes(text))

    content = []
    for token_id, position in zip(token_ids, logprobs or ()):
        sampled = entry(token_id, position[token_id])
        top = [entry(i, candidate) for i, candidate in top_items(position, req.top_logprobs or 0)]
        content.append(ChatTokenLogprob(**sampled.model_dump(), top_logprobs=top))
    return ChatLogprobs(content=content)
