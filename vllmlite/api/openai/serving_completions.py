"""POST /v1/completions: prompts in, text completions out, whole or streamed as chunks.

Owns the completions rules: prompt forms (each prompt its own choices, index = prompt_index * n +
sample), echo, best_of, `use_beam_search` (serving_beam_search.py searches; the output is read here as
any other), the rejection of `suffix`, OpenAI's completions logprobs format (tokens,
token_logprobs, top_logprobs, text_offset) and vLLM's `prompt_logprobs` on each choice. Knows
nothing of routes or middleware.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from vllmlite.api.errors import bad_request
from vllmlite.api.openai.constraints import request_constraint
from vllmlite.api.openai.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse
from vllmlite.api.openai.serving import (
    Admission,
    ServingContext,
    admit,
    check_grammar,
    check_model,
    check_request,
    check_stream_fields,
    clamp_logprob,
    encode_prompt,
    final_outputs,
    logprob_token,
    make_usage,
    merged,
    prompt_logprobs_payload,
    raise_if_failed,
    reject_unsupported,
    right_truncated,
    running_usage,
    sampling_params,
    sse_event,
    sse_stream,
    top_items,
)
from vllmlite.api.openai.serving_beam_search import BeamSearchRequest, beam_search_request, beam_search_streams
from vllmlite.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from vllmlite.sampling_params import SamplingParams
from vllmlite.tokenizer import Tokenizer
from vllmlite.tokenizer.detokenizer import PROMPT_CONTEXT_TOKENS, REPLACEMENT_CHAR

MAX_CHOICES = 128  # sequences one request may fork: prompts x max(n, best_of)


@dataclass
class PreparedCompletion:
    """A validated request: one text and one token list per prompt, and the sampling params."""

    request: CompletionRequest
    prompt_texts: list[str]
    prompt_token_ids: list[list[int]]
    params: SamplingParams
    beam: BeamSearchRequest | None = None  # use_beam_search: the prompts' beams are searched instead


class Echo(NamedTuple):
    """The prompt as echoed: its text, and whether special tokens (a BOS) are spelled in it."""

    text: str
    shows_special_tokens: bool


class TextOffsets:
    """Where each token starts in detokenized text (OpenAI's `text_offset`); feed tokens in order.

    A token starts where the text before it and the text with it stop agreeing, so a special
    token the text leaves out (the BOS a tokenizer adds) has width 0, and a byte that turns out
    invalid owns its U+FFFD. A token inside a character still open (its bytes split over tokens)
    starts where the run of pending bytes does.
    The text is decoded over a short window as the engine's detokenizer does (the last prompt
    tokens as left context), so this costs two small decodes per token. Offsets never decrease.

    Byte tokenizer, skipping special tokens: [BOS, "a", 0xC3, 0xA9, "b"] -> 0, 0, 1, 1, 2 ("aéb").
    """

    def __init__(self, tokenizer: Tokenizer, context_ids: Sequence[int], skip_special_tokens: bool,
                 start: int = 0) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = [int(i) for i in context_ids[-PROMPT_CONTEXT_TOKENS:]]
        if self._decode(context).endswith(REPLACEMENT_CHAR):
            context = []  # the prompt ends inside a character: the output must not complete it
        self._window = context
        self._origin = start - len(self._decode(context))  # text offset of decode(window)[0]
        self._last = start

    def next(self, token_id: int) -> int:
        before = self._decode(self._window)
        self._window.append(int(token_id))
        after = self._decode(self._window)
        is_open = after.endswith(REPLACEMENT_CHAR)  # the token is inside a character not complete yet
        start = len(after.rstrip(REPLACEMENT_CHAR)) if is_open else len(os.path.commonprefix([before, after]))
        self._last = max(self._last, self._origin + start)
        if not is_open:  # a clean boundary: slide the window
            kept = self._window[-PROMPT_CONTEXT_TOKENS:]
            self._origin += len(after) - len(self._decode(kept))
            self._window = kept
        return self._last

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)


@dataclass
class _StreamState:
    num_chars_sent: dict[int, int] = field(default_factory=dict)   # choice index -> text offset
    finished_choices: set[int] = field(default_factory=set)
    finished_outputs: dict[int, RequestOutput] = field(default_factory=dict)
    offsets: dict[int, TextOffsets] = field(default_factory=dict)  # choice index -> its tokens' offsets


def prepare_completion(ctx: ServingContext, req: CompletionRequest) -> PreparedCompletion:
    """Validate and tokenize every prompt; raise APIError (400/404) before anything is queued. May
    take a while for a large schema (it is compiled once to check it): run it off the event loop then."""
    check_model(ctx, req.model)
    if req.suffix is not None:
        raise bad_request("suffix is not supported by this server", "suffix")
    reject_unsupported(req)
    check_stream_fields(req)
    num_choices = len(req.prompt) * max(req.n, req.best_of or 1)
    if num_choices > MAX_CHOICES:
        raise bad_request(f"prompts x max(n, best_of) is {num_choices}; at most {MAX_CHOICES} sequences are "
                          "accepted per request", "n")
    if req.stream and req.best_of is not None and req.best_of > req.n:
        raise bad_request("best_of cannot be used with stream (it ranks finished samples)", "best_of")
    beam = beam_search_request(req, _engine_prompt_logprobs(req))
    constraint = request_constraint(req)
    params = sampling_params(req, max_tokens=16 if req.max_tokens is None else req.max_tokens,
                             logprobs=req.logprobs, best_of=req.best_of, prompt_logprobs=_engine_prompt_logprobs(req),
                             structured_outputs=None if constraint is None else constraint[1])
    check_grammar(ctx, constraint)
    texts, token_lists = [], []
    for i, prompt in enumerate(req.prompt):
        param = "prompt" if len(req.prompt) == 1 else f"prompt.{i}"
        if isinstance(prompt, str):
            token_ids = encode_prompt(ctx, prompt, param, add_special_tokens=req.add_special_tokens is not False)
        else:
            token_ids = prompt
        check_request(ctx, req, token_ids, params, param)
        texts.append(prompt if isinstance(prompt, str) else _decode_for_echo(ctx, token_ids, req.echo))
        token_lists.append(token_ids)
    return PreparedCompletion(req, texts, token_lists, params, beam)


def _engine_prompt_logprobs(req: CompletionRequest) -> int | None:
    """How many candidates the engine scores per prompt token: enough for `prompt_logprobs` and for
    echo with logprobs (OpenAI returns logprobs for the echoed tokens too)."""
    wanted = [k for k in (req.prompt_logprobs, req.logprobs if req.echo else None) if k is not None]
    return max(wanted, default=None)


def _decode_for_echo(ctx: ServingContext, token_ids: list[int], echo: bool) -> str:
    return ctx.engine.tokenizer.decode(token_ids, skip_special_tokens=False) if echo else ""


def _echo(ctx: ServingContext, prepared: PreparedCompletion, prompt_index: int, output: RequestOutput) -> Echo:
    """A text prompt echoes as sent (without the BOS its tokenizer added); token ids, or a prompt
    that truncate_prompt_tokens shortened, echo as the kept tokens decoded, special tokens spelled.
    Under return_token_ids the prompt comes back as ids, and its text as "" (as vLLM echoes it)."""
    if prepared.request.return_token_ids:
        return Echo("", False)
    if output.prompt_token_ids != prepared.prompt_token_ids[prompt_index]:
        return Echo(ctx.engine.tokenizer.decode(output.prompt_token_ids, skip_special_tokens=False), True)
    is_text = isinstance(prepared.request.prompt[prompt_index], str)
    return Echo(prepared.prompt_texts[prompt_index], not is_text)


async def create_completion(ctx: ServingContext, prepared: PreparedCompletion,
                            admission: Admission) -> CompletionResponse | AsyncIterator[str]:
    """Queue the prompts; return the whole response, or the SSE events when streaming."""
    if prepared.beam is not None:
        streams = await beam_search_streams(ctx, prepared.prompt_token_ids, prepared.beam, admission)
    else:
        streams = admit(ctx, [right_truncated(ids, prepared.request) for ids in prepared.prompt_token_ids],
                        prepared.params, admission)
    if prepared.request.stream:
        return sse_stream(_chunks(ctx, prepared, streams, admission.request_id), streams)
    outputs = await final_outputs(streams)
    return _response(ctx, prepared, outputs, admission.request_id)


def _response(ctx: ServingContext, prepared: PreparedCompletion, outputs: Sequence[RequestOutput],
              request_id: str) -> CompletionResponse:
    req = prepared.request
    tokenizer = ctx.engine.tokenizer
    choices = []
    for prompt_index, output in enumerate(outputs):
        echo = _echo(ctx, prepared, prompt_index, output) if req.echo else None
        prefix = echo.text if echo is not None else ""
        echoed_logprobs = _prompt_part(tokenizer, req, output, echo)
        prompt_logprobs = prompt_logprobs_payload(output, req.prompt_logprobs)
        for completion in output.outputs:
            offsets = TextOffsets(tokenizer, output.prompt_token_ids, req.skip_special_tokens, len(prefix))
            logprobs = _logprobs(tokenizer, req, completion.token_ids, completion.logprobs, offsets,
                                 len(prefix) + len(completion.text))
            choices.append(CompletionChoice(
                index=prompt_index * req.n + completion.index, text=prefix + completion.text,
                logprobs=_joined(echoed_logprobs, logprobs), finish_reason=completion.finish_reason,
                stop_reason=completion.stop_reason, prompt_logprobs=prompt_logprobs,
                **_token_ids(req, output.prompt_token_ids, completion.token_ids)))
    choices.sort(key=lambda c: c.index)
    return CompletionResponse(id=request_id, model=ctx.model_name, choices=choices,
                              usage=make_usage(outputs, ctx.with_prompt_tokens_details))


def _token_ids(req: CompletionRequest, prompt_ids: Sequence[int] | None, token_ids: Sequence[int]) -> dict:
    """A choice's vLLM `return_token_ids` fields: the prompt's ids (None where already sent) and
    the generated ones; nothing without return_token_ids."""
    if not req.return_token_ids:
        return {}
    return {"prompt_token_ids": None if prompt_ids is None else list(prompt_ids), "token_ids": list(token_ids)}


async def _chunks(ctx: ServingContext, prepared: PreparedCompletion, streams, request_id: str) -> AsyncIterator[str]:
    """The stream's chunks, one choice in each (as OpenAI and vLLM send them), then the usage if
    asked; under continuous_usage_stats a chunk carries its own prompt's and choice's usage so far."""
    req = prepared.request
    created = int(time.time())
    state = _StreamState()
    async for prompt_index, output in merged(streams):
        raise_if_failed(output)
        for completion in output.outputs:
            choice = _delta_choice(ctx, prepared, prompt_index, output, completion, state)
            if choice is not None:
                usage = (running_usage(len(output.prompt_token_ids), len(completion.token_ids))
                         if req.continuous_usage else None)
                yield sse_event(CompletionResponse(id=request_id, created=created, model=ctx.model_name,
                                                   choices=[choice], usage=usage))
        if output.finished:
            state.finished_outputs[prompt_index] = output
    if req.include_usage:
        usage = make_usage([state.finished_outputs[i] for i in sorted(state.finished_outputs)],
                           ctx.with_prompt_tokens_details)
        yield sse_event(CompletionResponse(id=request_id, created=created, model=ctx.model_name,
                                           choices=[], usage=usage))


def _delta_choice(ctx: ServingContext, prepared: PreparedCompletion, prompt_index: int, output: RequestOutput,
                  completion: CompletionOutput, state: _StreamState) -> CompletionChoice | None:
    """The chunk for what is new in one choice; None when nothing is (another sample moved)."""
    req = prepared.request
    tokenizer = ctx.engine.tokenizer
    index = prompt_index * req.n + completion.index
    if index in state.finished_choices:
        return None
    is_first = index not in state.num_chars_sent
    offset = state.num_chars_sent.get(index, 0)
    echo = _echo(ctx, prepared, prompt_index, output) if req.echo and is_first else None
    prefix = echo.text if echo is not None else ""
    text = prefix + completion.delta_text
    has_tokens = (req.logprobs is not None or bool(req.return_token_ids)) and bool(completion.delta_token_ids)
    if not text and not has_tokens and completion.finish_reason is None:
        return None  # e.g. a token holding half a UTF-8 character: its text comes with the next one
    state.num_chars_sent[index] = offset + len(text)
    if completion.finish_reason is not None:
        state.finished_choices.add(index)
    if is_first:
        state.offsets[index] = TextOffsets(tokenizer, output.prompt_token_ids, req.skip_special_tokens, len(prefix))
    logprobs = _logprobs(tokenizer, req, completion.delta_token_ids, completion.delta_logprobs,
                         state.offsets[index], state.num_chars_sent[index])
    return CompletionChoice(index=index, text=text, logprobs=_joined(_prompt_part(tokenizer, req, output, echo), logprobs),
                            finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
                            **_token_ids(req, output.prompt_token_ids if is_first else None,
                                         completion.delta_token_ids))


def _logprobs(tokenizer: Tokenizer, req: CompletionRequest, token_ids: Sequence[int],
              logprobs: Sequence[PositionLogprobs] | None, offsets: TextOffsets, text_end: int) -> CompletionLogprobs | None:
    """OpenAI's completions logprobs for generated `token_ids`; no offset passes `text_end`, the end
    of the choice's text so far (a stop string may have cut text after a token began).

    top_logprobs holds the `req.logprobs` most likely tokens plus the sampled one (as vLLM does).
    """
    if req.logprobs is None or logprobs is None:
        return None
    result = CompletionLogprobs()
    for token_id, entry in zip(token_ids, logprobs):
        _append(result, tokenizer, req, token_id, entry, min(offsets.next(token_id), text_end))
    return result


def _prompt_part(tokenizer: Tokenizer, req: CompletionRequest, output: RequestOutput,
                 echo: Echo | None) -> CompletionLogprobs | None:
    """Logprobs of the echoed prompt (the first token has none), offsets into the echoed text."""
    if req.logprobs is None or echo is None or output.prompt_logprobs is None:
        return None
    offsets = TextOffsets(tokenizer, (), skip_special_tokens=not echo.shows_special_tokens)
    result = CompletionLogprobs()
    for token_id, entry in zip(output.prompt_token_ids, output.prompt_logprobs):
        _append(result, tokenizer, req, token_id, entry, min(offsets.next(token_id), len(echo.text)))
    return result


def _joined(first: CompletionLogprobs | None, second: CompletionLogprobs | None) -> CompletionLogprobs | None:
    """`first` then `second` (a new object: the echoed part is shared by a prompt's choices)."""
    if first is None or second is None:
        return second
    return CompletionLogprobs(**{name: getattr(first, name) + getattr(second, name)
                                 for name in ("text_offset", "token_logprobs", "tokens", "top_logprobs")})


def _append(result: CompletionLogprobs, tokenizer: Tokenizer, req: CompletionRequest, token_id: int,
            entry: PositionLogprobs | None, offset: int) -> None:
    """Add one token at `offset`; its logprob and top_logprobs are None when `entry` is."""
    as_ids = req.return_tokens_as_token_ids
    if entry is None:
        result.tokens.append(logprob_token(tokenizer.token_text(token_id), token_id, as_ids))
        result.text_offset.append(offset)
        result.token_logprobs.append(None)
        result.top_logprobs.append(None)
        return
    sampled = entry[token_id]
    token = logprob_token(sampled.decoded_token, token_id, as_ids)
    logprob = clamp_logprob(sampled.logprob)
    top = {logprob_token(c.decoded_token, i, as_ids): clamp_logprob(c.logprob)
           for i, c in top_items(entry, req.logprobs)}
    top.setdefault(token, logprob)
    result.tokens.append(token)
    result.text_offset.append(offset)
    result.token_logprobs.append(logprob)
    result.top_logprobs.append(top)
