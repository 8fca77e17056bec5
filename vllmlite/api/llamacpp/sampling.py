"""llama-server's sampling fields -> SamplingParams, and the `generation_settings` a result reports.

Owns llama-server's spellings: temperature <= 0 is greedy, top_k <= 0 and repeat_last_n 0 turn a
filter off, seed -1 is a random seed, `logit_bias` as [id or text, bias] pairs or an object, `false`
for never, and `grammar` (GBNF) or `json_schema`. Whatever cannot be honoured is a 400 naming the
field. Knows nothing of routes or response shapes.
"""

from __future__ import annotations

import math
from typing import Any

from vllmlite.api.errors import bad_request
from vllmlite.api.llamacpp.protocol import (
    MAX_LOGIT_BIAS,
    MAX_STOP_CHARS,
    REFUSED_FIELDS,
    GenerationSettings,
    LlamaCompletionRequest,
    LogitBiasEntry,
)
from vllmlite.api.openai.constraints import make_constraint
from vllmlite.api.openai.serving import reject_unsupported
from vllmlite.sampling_params import LOGIT_BIAS_BOUND, SamplingParams
from vllmlite.structured_output_params import StructuredOutputsParams
from vllmlite.tokenizer import Tokenizer

LLAMA_DEFAULT_SEED = 0xFFFFFFFF  # what llama-server reports for "a random seed"
RANDOM_SEEDS = (-1, LLAMA_DEFAULT_SEED)
# SamplingParams' name in an error message -> the request field it came from
_FIELD_NAMES = {"repetition_penalty": "repeat_penalty", "max_tokens": "n_predict", "logprobs": "n_probs"}


def sampling_params(req: LlamaCompletionRequest, tokenizer: Tokenizer, max_tokens: int | None) -> SamplingParams:
    """The engine's parameters for `req`; a 400 naming the field for anything it cannot honour."""
    reject_unsupported(req, REFUSED_FIELDS)  # type: ignore[arg-type]  (it reads the fields by name)
    try:
        return SamplingParams(
            temperature=max(req.temperature, 0.0), top_k=req.top_k if req.top_k > 0 else None, top_p=req.top_p,
            min_p=req.min_p, seed=None if req.seed in RANDOM_SEEDS else req.seed, stop=req.stop,
            ignore_eos=req.ignore_eos, max_tokens=max_tokens, logprobs=req.n_probs or None,
            logit_bias=logit_bias(req.logit_bias, tokenizer), structured_outputs=_constraint(req), **_penalties(req))
    except ValueError as error:
        message = str(error)
        name = message.split(" ", 1)[0].rstrip(":")
        field = _FIELD_NAMES.get(name, name if name in LlamaCompletionRequest.model_fields else None)
        raise bad_request(message, field) from error


def _penalties(req: LlamaCompletionRequest) -> dict[str, float]:
    """The penalties apply as vLLM's do, over the whole prompt and output: llama-server's window of
    the last repeat_last_n tokens is honoured only as "all" (-1) or "off" (0)."""
    if req.repeat_last_n == 0:
        return {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
    is_active = req.repeat_penalty != 1.0 or req.presence_penalty != 0.0 or req.frequency_penalty != 0.0
    if is_active and req.repeat_last_n not in (None, -1):
        raise bad_request("repeat_last_n: penalties here count the whole prompt and output, not a window of "
                          "the last tokens; send -1 (or leave it out), or 0 to turn the penalties off",
                          "repeat_last_n")
    return {"repetition_penalty": req.repeat_penalty, "presence_penalty": req.presence_penalty,
            "frequency_penalty": req.frequency_penalty}


def _constraint(req: LlamaCompletionRequest) -> StructuredOutputsParams | None:
    grammar = req.grammar or None  # llama-server's default grammar is ""
    if grammar is not None and req.json_schema is not None:
        raise bad_request("grammar and json_schema each constrain the output; use one of them", "json_schema")
    if grammar is not None:
        return make_constraint("grammar", grammar=grammar)
    if req.json_schema is not None:
        return make_constraint("json_schema", json=req.json_schema)
    return None


def logit_bias(value: Any, tokenizer: Tokenizer) -> dict[int, float] | None:
    """llama-server's `logit_bias`: [[id or text, bias], ...] or {"id or text": bias}; a text adds the
    bias to each of its tokens, biases of one token add up, and `false` means never.

    Byte tokenizer: [["ab", -1], [97, false]] -> {97: -100.0, 98: -1.0}.
    """
    if value is None:
        return None
    if isinstance(value, dict):
        if any(not 0 < len(key) <= MAX_STOP_CHARS for key in value):
            raise bad_request(f"logit_bias keys must have 1 to {MAX_STOP_CHARS} characters", "logit_bias")
        pairs = [(int(key) if key.isascii() and key.isdigit() else key, bias) for key, bias in value.items()]
    elif isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 for p in value):
        pairs = [(key, bias) for key, bias in value]
    else:
        raise bad_request("logit_bias must be a list of [token id or text, bias] pairs or an object "
                          "of token id or text to bias", "logit_bias")
    if len(pairs) > MAX_LOGIT_BIAS:
        raise bad_request(f"logit_bias has {len(pairs)} entries; at most {MAX_LOGIT_BIAS} are accepted", "logit_bias")
    biases: dict[int, float] = {}
    for key, bias in pairs:
        amount = _bias_amount(bias)
        for token_id in _bias_tokens(key, tokenizer):
            total = biases.get(token_id, 0.0) + amount
            biases[token_id] = max(-LOGIT_BIAS_BOUND, min(LOGIT_BIAS_BOUND, total))
    return biases or None


def _bias_amount(bias: Any) -> float:
    if bias is False:
        return -LOGIT_BIAS_BOUND  # the strongest bias there is: the token is never sampled
    if isinstance(bias, (int, float)) and not isinstance(bias, bool) and math.isfinite(bias) \
            and abs(bias) <= LOGIT_BIAS_BOUND:
        return float(bias)
    raise bad_request(f"logit_bias values must be numbers in [-{LOGIT_BIAS_BOUND:g}, {LOGIT_BIAS_BOUND:g}] "
                      f"or false, got {bias!r}"[:200], "logit_bias")


def _bias_tokens(key: Any, tokenizer: Tokenizer) -> list[int]:
    if isinstance(key, int) and not isinstance(key, bool) and key >= 0:
        return [key]
    if isinstance(key, str) and 0 < len(key) <= MAX_STOP_CHARS:
        return tokenizer.encode(key, add_special_tokens=False)
    raise bad_request(f"logit_bias keys must be token ids or texts of 1 to {MAX_STOP_CHARS} characters", "logit_bias")


def generation_settings(req: LlamaCompletionRequest, params: SamplingParams) -> GenerationSettings:
    """The settings `req` runs with, as llama-server reports them."""
    return GenerationSettings(
        n_predict=req.num_predict, max_tokens=req.num_predict,
        seed=LLAMA_DEFAULT_SEED if req.seed in RANDOM_SEEDS else req.seed, temperature=req.temperature,
        top_k=req.top_k, top_p=req.top_p, min_p=req.min_p,
        repeat_last_n=-1 if req.repeat_last_n is None else req.repeat_last_n, repeat_penalty=req.repeat_penalty,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty, stop=req.stop,
        ignore_eos=req.ignore_eos, stream=req.stream, n_probs=req.n_probs, grammar=req.grammar or "",
        logit_bias=[LogitBiasEntry(bias=bias, token=token) for token, bias in (params.logit_bias or {}).items()])


def default_settings() -> GenerationSettings:
    """What a /completion request that sends only its prompt runs with (/props shows it)."""
    return generation_settings(LlamaCompletionRequest.model_validate({"prompt": ""}), SamplingParams())
