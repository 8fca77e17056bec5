"""POST /v1/completions: prompts in, text completions out, whole or streamed as chunks.

Owns the completions rules: prompt forms (each prompt its own choices, index = prompt_index * n +
sample), echo, best_of, the rejection of `suffix`, and OpenAI's completions logprobs format
(tokens, token_logprobs, top_logprobs, text_offset). Knows nothing of routes or middleware.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from vllmlite.api.errors import bad_request
from vllmlite.api.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse
from vllmlite.api.serving import (
    Admission,
    ServingContext,
    admit,
    check_model,
    check_request,
    clamp_logprob,
    encode_prompt,
    final_outputs,
    make_usage,
    merged,
    raise_if_failed,
    sampling_params,
    sse_event,
    sse_stream,
    top_candidates,
)
from vllmlite.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from vllmlite.sampling_params import SamplingParams
from vllmlite.tokenizer import Tokenizer

MAX_CHOICES = 128  # sequences one request may fork: prompts x max(n, best_of)


@dataclass
class PreparedCompletion:
    """A validated request: one text and one token list per prompt, and the sampling params."""

    request: CompletionRequest
    prompt_texts: list[str]
    prompt_token_ids: list[list[int]]
    params: SamplingParams


@dataclass
class _StreamState:
    num_chars_sent: dict[int, int] = field(default_factory=dict)   # choice index -> text offset
    finished_choices: set[int] = field(default_factory=set)
    finished_outputs: dict[int, RequestOutput] = field(default_factory=dict)


def prepare_completion(ctx: ServingContext, req: CompletionRequest) -> PreparedCompletion:
    """Validate and tokenize every prompt; raise APIError (400/404) before anything is queued."""
    check_model(ctx, req.model)
    if req.suffix is not None:
        raise bad_request("suffix is not supported by this server", "suffix")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    num_choices = len(req.prompt) * max(req.n, req.best_of or 1)
    if num_choices > MAX_CHOICES:
        raise bad_request(f"prompts x max(n, best_of) is {num_choices}; at most {MAX_CHOICES} sequences are "
                          "accepted per request", "n")
    if req.stream and req.best_of is not None and req.best_of > req.n:
        raise bad_request("best_of cannot be used with stream (it ranks finished samples)", "best_of")
    # echo with logprobs also scores the prompt (OpenAI returns logprobs for the echoed tokens).
    prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
    params = sampling_params(req, max_tokens=16 if req.max_tokens is None else req.max_tokens,
                             logprobs=req.logprobs, best_of=req.best_of, prompt_logprobs=prompt_logprobs)
    texts, token_lists = [], []
    for i, prompt in enumerate(req.prompt):
        param = "prompt" if len(req.prompt) == 1 else f"prompt.{i}"
        if isinstance(prompt, str):
            token_ids = encode_prompt(ctx, prompt, param)
        else:
            token_ids = prompt
        check_request(ctx, req, token_ids, params, param)
        texts.append(prompt if isinstance(prompt, str) else _decode_for_echo(ctx, token_ids, req.echo))
        token_lists.append(token_ids)
    return PreparedCompletion(req, texts, token_lists, params)


def _decode_for_echo(ctx: ServingContext, token_ids: list[int], echo: bool) -> str:
    return ctx.engine.tokenizer.decode(token_ids, skip_special_tokens=False) if echo else ""


async def create_completion(ctx: ServingContext, prepared: PreparedCompletion,
                            admission: Admission) -> CompletionResponse | AsyncIterator[str]:
    """Queue the prompts; return the whole response, or the SSE events when streaming."""
    streams = admit(ctx, prepared.prompt_token_ids, prepared.params, admission)
    if prepared.request.stream:
        return sse_stream(_chunks(ctx, prepared, streams, admission.request_id), streams)
    outputs = await final_outputs(streams)
    return _response(ctx, prepared, outputs, admission.request_id)


def _response(ctx: ServingContext, prepared: PreparedCompletion, outputs: Sequence[RequestOutput],
              request_id: str) -> CompletionResponse:
    req = prepared.request
    choices = []
    for prompt_index, output in enumerate(outputs):
        prefix = prepared.prompt_texts[prompt_index] if req.echo else ""
        for completion in output.outputs:
            logprobs = _logprobs(ctx.engine.tokenizer, completion.token_ids, completion.logprobs,
                                 req.logprobs, len(prefix))
            if req.echo:
                logprobs = _with_prompt(ctx.engine.tokenizer, output, req.logprobs, logprobs)
            choices.append(CompletionChoice(
                index=prompt_index * req.n + completion.index, text=prefix + completion.text,
                logprobs=logprobs,
                finish_reason=completion.finish_reason, stop_reason=completion.stop_reason))
    choices.sort(key=lambda c: c.index)
    return CompletionResponse(id=request_id, model=ctx.model_name, choices=choices, usage=make_usage(outputs))


async def _chunks(ctx: ServingContext, prepared: PreparedCompletion, streams, request_id: str) -> AsyncIterator[str]:
    created = int(time.time())
    state = _StreamState()
    async for prompt_index, output in merged(streams):
        raise_if_failed(output)
        choices = [choice for completion in output.outputs
                   if (choice := _delta_choice(ctx, prepared, prompt_index, output, completion, state)) is not None]
        if choices:
            yield sse_event(CompletionResponse(id=request_id, created=created, model=ctx.model_name,
                                               choices=choices))
        if output.finished:
            state.finished_outputs[prompt_index] = output
    if prepared.request.include_usage:
        usage = make_usage([state.finished_outputs[i] for i in sorted(state.finished_outputs)])
        yield sse_event(CompletionResponse(id=request_id, created=created, model=ctx.model_name,
                                           choices=[], usage=usage))


def _delta_choice(ctx: ServingContext, prepared: PreparedCompletion, prompt_index: int, output: RequestOutput,
                  completion: CompletionOutput, state: _StreamState) -> CompletionChoice | None:
    """The chunk for what is new in one choice; None when nothing is (another sample moved)."""
    req = prepared.request
    index = prompt_index * req.n + completion.index
    if index in state.finished_choices:
        return None
    is_first = index not in state.num_chars_sent
    offset = state.num_chars_sent.get(index, 0)
    prefix = prepared.prompt_texts[prompt_index] if req.echo and is_first else ""
    text = prefix + completion.delta_text
    has_logprobs = req.logprobs is not None and bool(completion.delta_token_ids)
    if not text and not has_logprobs and completion.finish_reason is None:
        return None  # e.g. a token holding half a UTF-8 character: its text comes with the next one
    state.num_chars_sent[index] = offset + len(text)
    if completion.finish_reason is not None:
        state.finished_choices.add(index)
    logprobs = _logprobs(ctx.engine.tokenizer, completion.delta_token_ids, completion.delta_logprobs,
                         req.logprobs, offset + len(prefix))
    if prefix:
        logprobs = _with_prompt(ctx.engine.tokenizer, output, req.logprobs, logprobs)
    return CompletionChoice(index=index, text=text, logprobs=logprobs,
                            finish_reason=completion.finish_reason, stop_reason=completion.stop_reason)


def _logprobs(tokenizer: Tokenizer, token_ids: Sequence[int], logprobs: Sequence[PositionLogprobs] | None,
              num_top: int | None, offset: int) -> CompletionLogprobs | None:
    """OpenAI's completions logprobs for `token_ids`; `offset` is the first token's text offset.

    top_logprobs holds the `num_top` most likely tokens plus the sampled one (as vLLM does).
    """
    if num_top is None or logprobs is None:
        return None
    result = CompletionLogprobs()
    for token_id, entry in zip(token_ids, logprobs):
        offset = _append(result, tokenizer, token_id, entry, num_top, offset)
    return result


def _with_prompt(tokenizer: Tokenizer, output: RequestOutput, num_top: int | None,
                 generated: CompletionLogprobs | None) -> CompletionLogprobs | None:
    """Prepend the echoed prompt's logprobs (the first prompt token has none) to `generated`."""
    if num_top is None or generated is None or output.prompt_logprobs is None:
        return generated
    result = CompletionLogprobs()
    offset = 0
    for token_id, entry in zip(output.prompt_token_ids, output.prompt_logprobs):
        offset = _append(result, tokenizer, token_id, entry, num_top, offset)
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        getattr(result, name).extend(getattr(generated, name))
    return result


def _append(result: CompletionLogprobs, tokenizer: Tokenizer, token_id: int, entry: PositionLogprobs | None,
            num_top: int, offset: int) -> int:
    """Add one token (its logprob None when `entry` is); return the next token's text offset."""
    text = tokenizer.token_text(token_id)
    result.tokens.append(text)
    result.text_offset.append(offset)
    if entry is None:
        result.token_logprobs.append(None)
        result.top_logprobs.append(None)
    else:
        logprob = clamp_logprob(entry[token_id].logprob)
        top = {c.decoded_token: clamp_logprob(c.logprob) for c in top_candidates(entry, num_top)}
        top.setdefault(text, logprob)
        result.token_logprobs.append(logprob)
        result.top_logprobs.append(top)
    return offset + (0 if text.startswith("bytes:") else len(text))  # part of a character: no text yet
