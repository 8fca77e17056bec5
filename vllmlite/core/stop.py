"""When a sample stops: the conditions checked after each token it keeps (its stop tokens, EOS and
end-of-turn, a complete grammar, max_tokens, the context length), and appending a step's tokens up
to the first that stops it. Stop strings are the output processor's (they need text).

Knows requests only; never touches blocks or queues: the scheduler finishes what this says stopped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from vllmlite.core.request import FinishReason, Request


class Stop(NamedTuple):
    """Why a sample ends; the arguments of `Scheduler.finish` after the request."""

    reason: FinishReason
    stop_reason: int | str | None = None
    error: str | None = None
    is_client_error: bool = False


def append_tokens(request: Request, token_ids: Sequence[int], logprobs: list | None,
                  stop_token_ids: frozenset[int], max_model_len: int) -> Stop | None:
    """Append a step's sampled tokens (and their logprobs) to `request`, each advancing its grammar,
    up to and including the first that stops it; the stop, or None if it runs on.

    tokens [5, 2, 7] where 2 is EOS -> 5 and 2 appended, Stop(STOP); 7 is dropped.
    """
    if request.grammar is None and logprobs is None:
        return _append_plain(request, token_ids, stop_token_ids, max_model_len)
    for i, token_id in enumerate(token_ids):
        if request.grammar is not None and not request.grammar.accept(token_id):
            # The mask allowed the token, so the grammar broke one of llguidance's limits building
            # what follows it (they are built lazily): the request's own grammar failed, no invalid output.
            return Stop(FinishReason.ERROR, error=f"the output constraint failed at token {token_id}: "
                                                  f"{request.grammar.error}", is_client_error=True)
        request.append_token(token_id)
        if logprobs is not None:
            request.logprobs.append(logprobs[i])
            request.cumulative_logprob += logprobs[i].logprob
        stop = check_stop(request, token_id, stop_token_ids, max_model_len)
        if stop is not None:
            return stop
    return None


def check_stop(request: Request, token_id: int, stop_token_ids: frozenset[int], max_model_len: int) -> Stop | None:
    """Whether `token_id`, just appended, ends `request`. `stop_token_ids` are the model's EOS and
    end-of-turn tokens (ignore_eos ignores them; the request's own stop_token_ids it does not)."""
    params, num_output_tokens = request.sampling_params, request.num_output_tokens
    if num_output_tokens >= params.min_tokens:
        if token_id in (params.stop_token_ids or ()):
            return Stop(FinishReason.STOP, token_id)
        if not params.ignore_eos and token_id in stop_token_ids:
            return Stop(FinishReason.STOP)
    if request.grammar is not None and request.grammar.is_terminated:
        return Stop(FinishReason.STOP)  # complete, and nothing may follow: even with ignore_eos
    if num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        return Stop(FinishReason.LENGTH)
    return None


def _append_plain(request: Request, token_ids: Sequence[int], stop_token_ids: frozenset[int],
                  max_model_len: int) -> Stop | None:
    """append_tokens for a sample with no grammar and no logprobs, the tokens kept appended at once:
    check_stop's conditions, in its order, found by arithmetic and a scan of the stop tokens alone.
    (Multi-step decoding hands every request 8 tokens a step; at 256 requests the per-token loop
    took about a fifth of the CPU's work between a GPU's decode steps, under cProfile.)"""
    params = request.sampling_params
    num_outputs = request.num_output_tokens
    # Token i makes num_outputs + i + 1 outputs and request.num_tokens + i + 1 tokens in all.
    length_at = max(0, min(request.max_tokens - num_outputs, max_model_len - request.num_tokens) - 1)
    stops = params.stop_token_ids or ()
    eos = () if params.ignore_eos else stop_token_ids
    stop_at, stop = None, None
    if stops or eos:   # from the first token that meets min_tokens, up to the length limit
        for i in range(max(0, params.min_tokens - num_outputs - 1), min(len(token_ids), length_at + 1)):
            token_id = token_ids[i]
            if token_id in stops:
                stop_at, stop = i, Stop(FinishReason.STOP, token_id)
                break
            if token_id in eos:
                stop_at, stop = i, Stop(FinishReason.STOP)
                break
    if stop is None and length_at < len(token_ids):
        stop_at, stop = length_at, Stop(FinishReason.LENGTH)
    request.extend_tokens(token_ids if stop_at is None else token_ids[:stop_at + 1])
    return stop
