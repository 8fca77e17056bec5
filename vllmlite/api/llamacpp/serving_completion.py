"""POST /completion (and /completions): llama-server's native completion endpoint.

Owns its rules: prompt forms (text, token ids, both mixed in one prompt; a list of prompts gives a
list of results), n_predict (-1 until EOS or the context is full, 0 evaluates the prompt and
returns nothing), the result's shape (content, tokens, stop_type, timings, generation_settings,
completion_probabilities) and the stream's (`data: {...}` events of new text with `stop: false`,
then the result with `stop: true`; no `[DONE]`). Knows nothing of routes or middleware.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, RootModel

from vllmlite.api.llamacpp.protocol import (
    GenerationSettings,
    LlamaCompletionRequest,
    LlamaCompletionResponse,
    Prompt,
    Timings,
    TokenProb,
    TokenProbs,
)
from vllmlite.api.llamacpp.sampling import generation_settings, sampling_params
from vllmlite.api.openai.serving import (
    Admission,
    ServingContext,
    admit,
    cancel_all,
    check_model,
    check_request,
    clamp_logprob,
    encode_prompt,
    final_outputs,
    merged,
    raise_if_failed,
    sse_event,
    sse_stream,
    token_bytes,
    top_items,
)
from vllmlite.engine.request_stream import RequestStream
from vllmlite.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from vllmlite.sampling_params import SamplingParams
from vllmlite.tokenizer import Tokenizer


@dataclass
class PreparedLlamaCompletion:
    """A validated request: one token list and one SamplingParams per prompt (each prompt's
    max_tokens stops where the context ends, as llama-server stops)."""

    request: LlamaCompletionRequest
    prompt_token_ids: list[list[int]]
    params: list[SamplingParams]
    settings: GenerationSettings

    @property
    def hides_output(self) -> bool:
        """n_predict 0: the prompt is evaluated (so its blocks are cached) and no token is returned."""
        return self.request.num_predict == 0


def _timings(output: RequestOutput, num_predicted: int) -> Timings:
    """llama-server's timings, from the engine's clock: the prompt from its first scheduling to the
    first token, the prediction from the first token to the end (or to now, while it runs)."""
    metrics = output.metrics
    now = time.monotonic()
    scheduled = (metrics.first_scheduled_time or metrics.arrival_time) if metrics is not None else now
    first = metrics.first_token_time if metrics is not None and metrics.first_token_time is not None else now
    end = metrics.finished_time if metrics is not None and metrics.finished_time is not None else now
    cached = output.num_cached_tokens
    prompt_n = len(output.prompt_token_ids) - cached
    prompt_ms, predicted_ms = max(first - scheduled, 0.0) * 1e3, max(end - first, 0.0) * 1e3
    return Timings(cache_n=cached, prompt_n=prompt_n, prompt_ms=prompt_ms,
                   prompt_per_token_ms=_ratio(prompt_ms, prompt_n), prompt_per_second=_ratio(prompt_n * 1e3, prompt_ms),
                   predicted_n=num_predicted, predicted_ms=predicted_ms,
                   predicted_per_token_ms=_ratio(predicted_ms, num_predicted),
                   predicted_per_second=_ratio(num_predicted * 1e3, predicted_ms))


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else 0.0


def prepare_llama_completion(ctx: ServingContext, req: LlamaCompletionRequest) -> PreparedLlamaCompletion:
    """Validate and tokenize every prompt; raise APIError (400/404) before anything is queued."""
    check_model(ctx, req.model)
    token_lists = [_tokenize(ctx, prompt, "prompt" if len(req.prompt) == 1 else f"prompt.{i}")
                   for i, prompt in enumerate(req.prompt)]
    base = sampling_params(req, ctx.engine.tokenizer, _max_tokens(req.num_predict, None))
    params = []
    for i, token_ids in enumerate(token_lists):
        room = ctx.engine.max_model_len - len(token_ids)
        prompt_params = dataclasses.replace(base, max_tokens=_max_tokens(req.num_predict, room))
        check_request(ctx, req, token_ids, prompt_params,  # type: ignore[arg-type]  (fields read by name)
                      "prompt" if len(token_lists) == 1 else f"prompt.{i}")
        params.append(prompt_params)
    return PreparedLlamaCompletion(req, token_lists, params, generation_settings(req, base))


def _max_tokens(n_predict: int, room: int | None) -> int | None:
    """The engine's max_tokens: None runs until EOS or the context is full, as n_predict -1 does and
    as any n_predict past the room the prompt leaves does; 0 samples one token, never shown."""
    if n_predict == 0:
        return 1
    if n_predict < 0 or (room is not None and n_predict >= room):
        return None
    return n_predict


def _tokenize(ctx: ServingContext, prompt: Prompt, param: str) -> list[int]:
    """Token ids of one prompt: texts are encoded in place, the first one (only when it leads the
    prompt) with the tokenizer's BOS, as llama-server adds it."""
    token_ids: list[int] = []
    for i, piece in enumerate(prompt):
        if isinstance(piece, str):
            token_ids += encode_prompt(ctx, piece, param, add_special_tokens=i == 0)
        else:
            token_ids.append(piece)
    return token_ids


async def create_llama_completion(ctx: ServingContext, prepared: PreparedLlamaCompletion,
                                  admission: Admission) -> BaseModel | AsyncIterator[bytes]:
    """Queue the prompts; return the result(s), or the SSE events when streaming."""
    streams = _admit(ctx, prepared, admission)
    if prepared.request.stream:
        return sse_stream(_events(ctx, prepared, streams), streams, done_event=None)
    outputs = await final_outputs(streams)
    results = [_result(ctx, prepared, i, output, streamed=False) for i, output in enumerate(outputs)]
    if len(results) > 1:
        return RootModel[list[LlamaCompletionResponse]](results)
    fields = prepared.request.response_fields
    return results[0] if not fields else RootModel[dict[str, Any]](pick_fields(results[0].model_dump(), fields))


def _admit(ctx: ServingContext, prepared: PreparedLlamaCompletion, admission: Admission) -> list[RequestStream]:
    """One engine request per prompt, each with its own params; all or nothing."""
    streams: list[RequestStream] = []
    many = len(prepared.prompt_token_ids) > 1
    try:
        for i, (token_ids, params) in enumerate(zip(prepared.prompt_token_ids, prepared.params)):
            one = dataclasses.replace(admission, request_id=f"{admission.request_id}-{i}") if many else admission
            streams += admit(ctx, [token_ids], params, one)
    except BaseException:
        cancel_all(streams)
        raise
    return streams


async def _events(ctx: ServingContext, prepared: PreparedLlamaCompletion,
                  streams: Sequence[RequestStream]) -> AsyncIterator[str]:
    req = prepared.request
    async for index, output in merged(streams):
        raise_if_failed(output)
        completion = output.outputs[0]
        if (completion.delta_token_ids or completion.delta_text) and not prepared.hides_output:
            probs = _probs(ctx.engine.tokenizer, req.n_probs, completion.delta_token_ids, completion.delta_logprobs)
            timings = _timings(output, len(completion.token_ids)) if req.timings_per_token else None
            yield sse_event(LlamaCompletionResponse(
                index=index, content=completion.delta_text, tokens=completion.delta_token_ids, stop=False,
                tokens_predicted=len(completion.token_ids), tokens_evaluated=len(output.prompt_token_ids),
                timings=timings, completion_probabilities=probs or None))
        if output.finished:
            yield sse_event(_result(ctx, prepared, index, output, streamed=True))


def _result(ctx: ServingContext, prepared: PreparedLlamaCompletion, index: int, output: RequestOutput,
            streamed: bool) -> LlamaCompletionResponse:
    """A prompt's final result; in a stream its text and tokens were already sent."""
    req = prepared.request
    tokenizer = ctx.engine.tokenizer
    completion = output.outputs[0]
    hidden = prepared.hides_output
    token_ids = [] if hidden else completion.token_ids
    text = "" if hidden else completion.text
    stop_type, stopping_word = ("limit", "") if hidden else _stop(completion)
    probs = None if streamed else _probs(tokenizer, req.n_probs, token_ids, completion.logprobs)
    return LlamaCompletionResponse(
        index=index, content="" if streamed else text, tokens=token_ids if req.return_tokens and not streamed else [],
        stop=True, tokens_predicted=len(token_ids), tokens_evaluated=len(output.prompt_token_ids),
        timings=_timings(output, len(token_ids)), completion_probabilities=probs or None,
        model=ctx.model_name, generation_settings=prepared.settings,
        prompt=tokenizer.decode(output.prompt_token_ids, skip_special_tokens=False), has_new_line="\n" in text,
        truncated=stop_type == "limit" and not hidden and not 0 < req.num_predict <= len(token_ids),
        stop_type=stop_type, stopping_word=stopping_word, tokens_cached=output.num_cached_tokens)


def _stop(completion: CompletionOutput) -> tuple[str, str]:
    """llama-server's stop_type and stopping_word: a stop string is "word", a length "limit", an end
    of sequence (or a stop token) "eos"."""
    if completion.finish_reason == "length":
        return "limit", ""
    if isinstance(completion.stop_reason, str):
        return "word", completion.stop_reason
    return "eos", ""


def _probs(tokenizer: Tokenizer, n_probs: int, token_ids: Sequence[int],
           logprobs: Sequence[PositionLogprobs] | None) -> list[TokenProbs]:
    """`completion_probabilities`: each generated token with the n_probs most likely at its position."""
    if not n_probs or logprobs is None:
        return []
    return [TokenProbs(**_prob(tokenizer, token_id, position[token_id].logprob).model_dump(),
                       top_logprobs=[_prob(tokenizer, i, p.logprob) for i, p in top_items(position, n_probs)])
            for token_id, position in zip(token_ids, logprobs)]


def _prob(tokenizer: Tokenizer, token_id: int, logprob: float) -> TokenProb:
    raw = bytes(token_bytes(tokenizer.token_text(token_id)))
    return TokenProb(id=token_id, token=raw.decode("utf-8", errors="ignore"), bytes=list(raw),
                     logprob=clamp_logprob(logprob))


def pick_fields(result: dict[str, Any], paths: Sequence[str]) -> dict[str, Any]:
    """llama-server's `response_fields`: each path found in `result` ("a/b" reads b inside a), under
    its path; missing ones are left out.

    >>> pick_fields({"content": "x", "a": {"b": 1}}, ["content", "a/b", "nope"])
    {'content': 'x', 'a/b': 1}
    """
    picked: dict[str, Any] = {}
    for path in paths:
        node: Any = result
        for part in path.split("/"):
            if not isinstance(node, dict) or part not in node:
                break
            node = node[part]
        else:
            picked[path] = node
    return picked
