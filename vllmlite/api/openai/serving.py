"""What the OpenAI routes share: model check, prompt bounds, SamplingParams, admission, merged output
streams, usage and server-sent-event framing.

Owns turning validated request fields into engine requests, and the parts of OpenAI's response
shapes both endpoints use. Knows nothing of routes or middleware: failures are raised as APIError.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from vllmlite.api.errors import APIError, bad_request, from_engine_error
from vllmlite.api.openai.constraints import as_bad_request
from vllmlite.api.openai.protocol import PromptLogprob, PromptLogprobs, PromptTokensDetails, Usage
from vllmlite.api.openai.protocol_fields import SamplingFields
from vllmlite.api.openai.reasoning import ReasoningFormat
from vllmlite.engine.client import EngineClient
from vllmlite.engine.request_stream import GenerateRequest, RequestStream
from vllmlite.outputs import Logprob, PositionLogprobs, RequestOutput
from vllmlite.sampling_params import SamplingParams
from vllmlite.structured_output_params import StructuredOutputsParams

MAX_CHARS_PER_TOKEN = 32  # a prompt longer than this many characters per context token cannot fit
DONE_EVENT = b"data: [DONE]\n\n"
LOGPROB_FLOOR = -9999.0   # JSON has no -inf; vLLM clamps the same way


@dataclass(frozen=True)
class ServingContext:
    """What a handler needs: the engine, the name clients must use for the model, whether chat
    messages may carry special tokens (trusted callers only), whether usage shows the cached
    prompt tokens (vLLM's --enable-prompt-tokens-details), and how the model marks its reasoning."""

    engine: EngineClient
    model_name: str
    special_tokens_in_messages: bool
    with_prompt_tokens_details: bool = False  # --enable-prompt-tokens-details
    reasoning: ReasoningFormat | None = None  # --reasoning-parser


@dataclass(frozen=True)
class Admission:
    """Per-request facts that are not sampling fields: who is asking, and the id prefix."""

    request_id: str
    client_id: str | None
    priority: int = 0
    cache_salt: str | None = None


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def check_model(ctx: ServingContext, requested: str | None) -> None:
    """The `model` field must name the served model (or be omitted); else 404."""
    if requested is not None and requested != ctx.model_name:
        raise APIError(404, f"the model {requested!r} does not exist; this server serves {ctx.model_name!r}",
                       param="model")


def encode_prompt(ctx: ServingContext, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
    """Tokenize `text`, after bounding its length by the context length (so no huge tokenization)."""
    max_chars = ctx.engine.max_model_len * MAX_CHARS_PER_TOKEN
    if len(text) > max_chars:
        raise bad_request(f"{param} has {len(text)} characters, more than this model's context of "
                          f"{ctx.engine.max_model_len} tokens can hold", param)
    return ctx.engine.tokenizer.encode(text, add_special_tokens=add_special_tokens)


_LEADING_NAME = re.compile(r"^([a-z_]+)\b")

# Request fields of both endpoints (OpenAI's or vLLM's) this server does not implement: (name, the
# values that mean "not used", why). Any other value is a 400 naming the field, never ignored.
UNSUPPORTED_FIELDS = (
    ("logits_processors", (None, []), "no custom logits processors"),
    ("spaces_between_special_tokens", (None, True), "detokenization is the tokenizer's own"),
)


# Top-level fields of OpenAI's API accepted and ignored, since ignoring them changes no output: metadata
# for OpenAI's own storage and billing, and hints for caching, prediction and reasoning models. Any
# other field a request model does not declare is a 400.
NO_OP_FIELDS = frozenset({"store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier",
                          "prediction", "reasoning_effort"})


def reject_unknown_fields(req: BaseModel) -> None:
    """A 400 naming the first top-level field `req` does not declare, unless it is a known no-op."""
    for name in req.model_extra or {}:
        if name not in NO_OP_FIELDS:
            raise bad_request(f"unknown field {name!r}: this server does not implement it", name)


def reject_unsupported(req: SamplingFields, fields: Sequence[tuple[str, tuple, str]] = UNSUPPORTED_FIELDS) -> None:
    """A 400 naming the first of `fields` that `req` uses."""
    for name, unused, why in fields:
        if not _is_unused(getattr(req, name), unused):
            raise bad_request(f"{name} is not supported by this server ({why})", name)


def _is_unused(value: Any, unused: tuple) -> bool:
    """`value` is one of `unused` as JSON reads it: 0 is not false nor 1 true (as they are in Python)."""
    return any(type(value) is type(u) and value == u for u in unused)


def sampling_params(req: SamplingFields, **fields: Any) -> SamplingParams:
    """SamplingParams from the shared request fields plus endpoint-specific `fields`; 400 if invalid."""
    values = dict(
        n=req.n, temperature=_default(req.temperature, 1.0), top_p=_default(req.top_p, 1.0),
        top_k=req.top_k, min_p=_default(req.min_p, 0.0),
        presence_penalty=_default(req.presence_penalty, 0.0),
        frequency_penalty=_default(req.frequency_penalty, 0.0),
        repetition_penalty=_default(req.repetition_penalty, 1.0), seed=req.seed, stop=req.stop,
        stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, min_tokens=req.min_tokens,
        skip_special_tokens=req.skip_special_tokens, include_stop_str_in_output=req.include_stop_str_in_output,
        logit_bias=req.logit_bias, max_tokens=req.max_tokens, allowed_token_ids=req.allowed_token_ids,
        bad_words=req.bad_words, truncate_prompt_tokens=req.truncate_prompt_tokens,
    )
    values.update(fields)
    try:
        return SamplingParams(**values)
    except ValueError as error:
        raise bad_request(str(error), _named_field(str(error), req, None)) from error


def check_stream_fields(req: SamplingFields) -> None:
    """Fields that only make sense with (or without) `stream`, as OpenAI and vLLM rule them."""
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if req.stream and req.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs is not available when stream is true (as in vLLM)", "prompt_logprobs")


def _named_field(message: str, req: SamplingFields, fallback: str | None) -> str | None:
    """The request field an engine message starts with ("top_p must be ..." -> "top_p")."""
    match = _LEADING_NAME.match(message)
    return match.group(1) if match and match.group(1) in type(req).model_fields else fallback


def _default(value: float | None, default: float) -> float:
    return default if value is None else value


def check_request(ctx: ServingContext, req: SamplingFields, token_ids: list[int], params: SamplingParams,
                  param: str) -> None:
    """The engine's context-length and vocabulary check, as a 400 naming `param` (the prompt) unless
    the message names another field (logit_bias, stop_token_ids)."""
    try:
        ctx.engine.check_request(token_ids, params)
    except ValueError as error:
        raise bad_request(str(error), _named_field(str(error), req, param)) from error


def check_grammar(ctx: ServingContext, found: tuple[str, StructuredOutputsParams] | None) -> None:
    """The engine's check of the request's constraint (compiled against the vocabulary, walked a few
    tokens), as a 400 naming the field that set it. Off the event loop: it may compile."""
    if found is None:
        return
    param, constraint = found
    try:
        ctx.engine.check_grammar(constraint)
    except ValueError as error:
        raise as_bad_request(error, param) from error


def admit(ctx: ServingContext, prompts: Sequence[list[int]], params: SamplingParams,
          admission: Admission, param: str = "prompt") -> list[RequestStream]:
    """Queue one engine request per prompt; all or nothing (503 on queue full or draining, 400 when
    the prompts outnumber the whole queue: retrying could never help)."""
    max_queue = ctx.engine.max_queue
    if max_queue is not None and len(prompts) > max_queue:
        raise bad_request(f"{param} has {len(prompts)} prompts; this server queues at most {max_queue} "
                          "requests, so send at most that many at once", param)
    streams: list[RequestStream] = []
    try:
        for i, token_ids in enumerate(prompts):
            request_id = admission.request_id if len(prompts) == 1 else f"{admission.request_id}-{i}"
            streams.append(ctx.engine.add_request(GenerateRequest(
                request_id, token_ids, params, priority=admission.priority,
                cache_salt=admission.cache_salt, client_id=admission.client_id)))
    except Exception as error:
        cancel_all(streams)
        raise from_engine_error(error) from error
    return streams


def cancel_all(streams: Sequence[RequestStream]) -> None:
    for stream in streams:
        stream.cancel()


def raise_if_failed(output: RequestOutput) -> None:
    """A request that failed inside the engine is a 500 for this request only; one that failed by
    its own fault (its grammar broke a limit once tokens came) a 400."""
    if output.error is not None:
        raise APIError(400 if output.is_client_error else 500, output.error)


async def final_outputs(streams: Sequence[RequestStream]) -> list[RequestOutput]:
    """Each stream's finished output, consumed concurrently; streams are cancelled on any exit.
    The streams are marked final-only: the engine thread skips their outputs before the last
    (outputs carry their cumulative text and ids), which spared the Qwen3-0.6B burst of 256 requests
    on the H200 256 event-loop wake-ups a step, each taking the GIL from the engine thread."""
    for stream in streams:
        stream.final_only = True

    async def last(stream: RequestStream) -> RequestOutput:
        output = None
        async for output in stream:
            pass
        if output is None:
            raise APIError(500, "the engine ended the request without an output")
        raise_if_failed(output)
        return output

    tasks = [asyncio.ensure_future(last(s)) for s in streams]
    try:
        return list(await asyncio.gather(*tasks))
    except Exception as error:
        raise from_engine_error(error) from error
    finally:
        for task in tasks:  # gather leaves the others running when one fails
            task.cancel()
        cancel_all(streams)


async def merged(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) from all streams as they arrive; each stream's own order is kept."""
    pending = {asyncio.ensure_future(anext(stream)): i for i, stream in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                index = pending.pop(task)
                try:
                    output = task.result()
                except StopAsyncIteration:
                    continue
                yield index, output
                pending[asyncio.ensure_future(anext(streams[index]))] = index
    finally:
        for task in pending:
            task.cancel()


def right_truncated(token_ids: list[int], req: SamplingFields) -> list[int]:
    """The prompt cut to its first `truncate_prompt_tokens` tokens under vLLM's truncation_side "right";
    otherwise as it is, the engine keeping the last ones (the "left" side, vLLM's default for generation)."""
    k = req.truncate_prompt_tokens
    return token_ids[:k] if k is not None and req.truncation_side == "right" else token_ids


def num_prompt_tokens(token_ids: Sequence[int], params: SamplingParams) -> int:
    """The prompt tokens the engine keeps: the last `truncate_prompt_tokens` of them, or all."""
    k = params.truncate_prompt_tokens
    return len(token_ids) if k is None else min(k, len(token_ids))


def running_usage(num_prompt_tokens: int, num_output_tokens: int) -> Usage:
    """One chunk's usage under `stream_options.continuous_usage_stats`, as vLLM counts it: its own
    prompt's tokens and its own choice's tokens so far (never the cached-token details)."""
    return Usage(prompt_tokens=num_prompt_tokens, completion_tokens=num_output_tokens,
                 total_tokens=num_prompt_tokens + num_output_tokens)


def make_usage(outputs: Sequence[RequestOutput], with_details: bool = False) -> Usage:
    """Prompt tokens count once per prompt; completion tokens once per returned choice. The prompt
    tokens the prefix cache served are shown `with_details` (--enable-prompt-tokens-details)."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    details = PromptTokensDetails(cached_tokens=sum(o.num_cached_tokens for o in outputs)) if with_details else None
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=details)


def sse_event(payload: Any) -> str:
    """One server-sent event: `data: {json}\\n\\n` (a pydantic model or a plain object)."""
    if hasattr(payload, "model_dump_json"):
        return f"data: {payload.model_dump_json()}\n\n"
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def sse_stream(events: AsyncIterator[str], streams: Sequence[RequestStream],
                     error_event: Callable[[APIError], str] = APIError.sse_event,
                     done_event: bytes | None = DONE_EVENT) -> AsyncIterator[bytes]:
    """`events`, encoded, then `done_event` (chat's `data: [DONE]`; the Responses API sends none); a
    failure mid-stream becomes `error_event(error)` before it. However the stream ends (finished,
    failed, client gone or too slow), the engine requests are cancelled."""
    try:
        async for event in events:
            yield event.encode()
    except Exception as error:
        yield error_event(from_engine_error(error)).encode()
    finally:
        cancel_all(streams)
    if done_event is not None:
        yield done_event


def clamp_logprob(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def top_items(position: PositionLogprobs, num_top: int) -> list[tuple[int, Logprob]]:
    """(token id, Logprob) of the `num_top` most likely entries of one position, best first: they
    lead its dict."""
    return list(position.items())[:num_top]


def logprob_token(text: str, token_id: int, as_token_ids: bool) -> str:
    """A token as logprobs show it: its text, or `token_id:123` (vLLM's return_tokens_as_token_ids)."""
    return f"token_id:{token_id}" if as_token_ids else text


def prompt_logprobs_payload(output: RequestOutput, num_top: int | None) -> PromptLogprobs | None:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then per token its `num_top` most
    likely tokens and itself, `{token_id: {logprob, rank, decoded_token}}` (the engine may have
    scored more candidates, for echo's logprobs: the extra ones are left out)."""
    if num_top is None or output.prompt_logprobs is None:
        return None
    payload: PromptLogprobs = []
    for token_id, position in zip(output.prompt_token_ids, output.prompt_logprobs):
        if position is None:
            payload.append(None)
            continue
        kept = dict(top_items(position, num_top))
        kept.setdefault(token_id, position[token_id])
        payload.append({i: PromptLogprob(logprob=clamp_logprob(p.logprob), rank=p.rank,
                                         decoded_token=p.decoded_token) for i, p in kept.items()})
    return payload


def token_bytes(token_text: str) -> list[int]:
    """The bytes of a token as `Tokenizer.token_text` spells it (`bytes:\\xe2\\x80` when not UTF-8).

    >>> token_bytes("hi"), token_bytes("bytes:\\\\xe2\\\\x80")
    ([104, 105], [226, 128])
    """
    if token_text.startswith("bytes:") and re.fullmatch(r"(\\x[0-9a-f]{2})+", token_text[6:]):
        return list(bytes.fromhex(token_text[6:].replace("\\x", "")))
    return list(token_text.encode("utf-8"))
