"""`use_beam_search` on /v1/completions (vLLM's field): each prompt's beams searched through the engine
client, one one-token request per live beam and step (vllmlite/beam_search.py), the best `n` becoming
the prompt's choices, in the same RequestOutput shape a sampled request ends with.

Owns which request fields a beam search takes (the sampling-only ones are a 400 naming them, never
ignored) and how its sequences become an output. Knows nothing of routes or of the response format.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from vllmlite.api.errors import bad_request
from vllmlite.api.openai.protocol import CompletionRequest
from vllmlite.api.openai.serving import Admission, ServingContext, admit, final_outputs
from vllmlite.beam_search import BeamSearch, BeamSearchSequence, step_sampling_params
from vllmlite.engine.request_stream import RequestStream
from vllmlite.outputs import CompletionOutput, RequestOutput
from vllmlite.sampling_params import BeamSearchParams
from vllmlite.tokenizer import Tokenizer

# Fields that steer sampling, which a beam search does not do: any value but their default is a 400.
SAMPLING_ONLY_FIELDS = (
    "best_of", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "logit_bias", "seed", "stop", "stop_token_ids", "min_tokens", "bad_words", "allowed_token_ids",
    "truncate_prompt_tokens", "response_format", "structured_outputs", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar",
)


@dataclass(frozen=True)
class BeamSearchRequest:
    """A completions request's beam search: vLLM's params (beam_width is `n`) and what its output shows."""

    params: BeamSearchParams
    num_logprobs: int | None          # the request's `logprobs`
    num_prompt_logprobs: int | None   # scored for each prompt token (prompt_logprobs, echo with logprobs)
    skip_special_tokens: bool


def beam_search_request(req: CompletionRequest, num_prompt_logprobs: int | None) -> BeamSearchRequest | None:
    """None for a request without `use_beam_search`; 400 for `length_penalty` without it, or for a field
    a beam search cannot honour."""
    if not req.use_beam_search:
        if req.length_penalty != 1.0:
            raise bad_request("length_penalty only applies with use_beam_search", "length_penalty")
        return None
    for name in SAMPLING_ONLY_FIELDS:
        if getattr(req, name) not in (None, type(req).model_fields[name].default):
            raise bad_request(f"{name} cannot be used with use_beam_search", name)
    try:
        params = BeamSearchParams(
            beam_width=req.n, max_tokens=16 if req.max_tokens is None else req.max_tokens, ignore_eos=req.ignore_eos,
            temperature=1.0 if req.temperature is None else req.temperature, length_penalty=req.length_penalty,
            include_stop_str_in_output=req.include_stop_str_in_output)
    except ValueError as error:
        message = str(error)
        if message.startswith("beam_width"):
            raise bad_request(f"n is the beam width with use_beam_search: {message}", "n") from error
        raise bad_request(message, "length_penalty") from error
    return BeamSearchRequest(params, req.logprobs, num_prompt_logprobs, req.skip_special_tokens)


async def beam_search_streams(ctx: ServingContext, prompts: Sequence[list[int]], beam: BeamSearchRequest,
                              admission: Admission) -> list[RequestStream]:
    """Search every prompt's beams concurrently; each result as a stream that has ended with its one
    output, which the completions code reads as it reads a sampled request's. Raises APIError."""
    tasks = [asyncio.ensure_future(_search(ctx, prompt, beam, dataclasses.replace(
        admission, request_id=f"{admission.request_id}-{i}"))) for i, prompt in enumerate(prompts)]
    try:
        outputs = await asyncio.gather(*tasks)
    finally:
        for task in tasks:  # gather leaves the others running when one fails
            task.cancel()
    loop = asyncio.get_running_loop()
    streams = []
    for output in outputs:
        stream = RequestStream(output.request_id, loop, abort=lambda *_: None, timeout=None)
        stream.put_nowait(output)
        streams.append(stream)
    return streams


async def _search(ctx: ServingContext, prompt: list[int], beam: BeamSearchRequest,
                  admission: Admission) -> RequestOutput:
    """One prompt's search, a step at a time: the live beams go to the engine as one request each."""
    tokenizer = ctx.engine.tokenizer
    search = BeamSearch(prompt, beam.params, tokenizer.eos_token_id, ctx.engine.max_model_len)
    step_params = step_sampling_params(beam.params, beam.num_logprobs or 0)
    first: RequestOutput | None = None  # the first step scores the prompt itself, when asked
    while not search.is_done:
        params = step_params
        if first is None and beam.num_prompt_logprobs is not None:
            params = dataclasses.replace(step_params, prompt_logprobs=beam.num_prompt_logprobs)
        step = dataclasses.replace(admission, request_id=f"{admission.request_id}-step{search.num_steps}")
        outputs = await final_outputs(admit(ctx, [b.tokens for b in search.live], params, step))
        if first is None:
            first = outputs[0]
        search.advance([output.outputs[0].logprobs[0] for output in outputs])
    completions = [_completion(i, b, len(prompt), tokenizer, beam) for i, b in enumerate(search.best())]
    return RequestOutput(admission.request_id, None, list(prompt), completions, finished=True,
                         num_cached_tokens=first.num_cached_tokens if first is not None else 0,
                         prompt_logprobs=first.prompt_logprobs if first is not None else None)


def _completion(index: int, sequence: BeamSearchSequence, num_prompt_tokens: int, tokenizer: Tokenizer,
                beam: BeamSearchRequest) -> CompletionOutput:
    """A returned beam as a finished choice: its output tokens (EOS only with include_stop_str_in_output),
    their text, its cumulative logprob and, when asked, its logprobs (the EOS step's too)."""
    token_ids = sequence.tokens[num_prompt_tokens:]
    text = tokenizer.decode(token_ids, skip_special_tokens=beam.skip_special_tokens)
    logprobs = sequence.logprobs if beam.num_logprobs is not None else None
    return CompletionOutput(index=index, text=text, token_ids=token_ids, cumulative_logprob=sequence.cum_logprob,
                            logprobs=logprobs, finish_reason=sequence.finish_reason, stop_reason=sequence.stop_reason,
                            delta_text=text, delta_token_ids=list(token_ids), delta_logprobs=logprobs)
