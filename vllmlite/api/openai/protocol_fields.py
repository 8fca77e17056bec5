"""The bounds every request field is held to, the validators the request models share, and
SamplingFields (the fields completions and chat share).

Requests are parsed strictly from JSON (no "1" for 1, no 1.0 for an int, no NaN); an unknown
top-level field is a 400 (serving.reject_unknown_fields). Every size a client controls is capped here,
before anything is tokenized or allocated; the bounds SamplingParams enforces too (temperature,
penalties, logit bias, seed, stop strings, logprobs) are read from vllmlite/sampling_params.py, so
both layers hold a request to one rule. Knows nothing of the engine, tokenizers or HTTP routing.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, WithJsonSchema, field_validator, model_validator

from vllmlite.api.openai.protocol_tools import (
    MAX_CHOICES,
    MAX_SPEC_CHARS,
    ResponseFormat,
    StructuredOutputs,
)
from vllmlite.sampling_params import (
    LOGIT_BIAS_BOUND,
    MAX_LOGPROBS,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    PENALTY_BOUND,
    SEED_MAX,
    SEED_MIN,
)

# The API's own bounds: sizes only a request over HTTP has, and n and best_of, which it holds
# tighter than SamplingParams' MAX_N (each forks a sequence; a server caps a client harder).
MAX_N = 16                     # n and best_of
MAX_PROMPTS = 64               # prompts in one completions request
MAX_EMBEDDING_INPUTS = 256     # inputs in one embeddings request (the queue bound applies too)
MAX_PROMPT_CHARS = 1 << 21     # one prompt string or message content
MAX_PROMPT_TOKEN_IDS = 1 << 18 # one token-id prompt (the engine then checks the context length)
MAX_MESSAGES = 1024
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300
MAX_BAD_WORDS = 64
MAX_TOKENS_BOUND = 1 << 20     # the engine then checks prompt + max_tokens against the context
MAX_NAME_CHARS = 256           # model, user, cache_salt, message name
PRIORITY_BOUND = 2**31

_STOP_STRING_SCHEMA = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
_STOP_SCHEMA = {"anyOf": [_STOP_STRING_SCHEMA, {"type": "null"},
                          {"type": "array", "maxItems": MAX_STOP_STRINGS, "items": _STOP_STRING_SCHEMA}]}
_LOGIT_BIAS_SCHEMA = {"propertyNames": {"pattern": "^[0-9]{1,10}$"},
                      "additionalProperties": {"type": "number", "minimum": -int(LOGIT_BIAS_BOUND),
                                                 "maximum": int(LOGIT_BIAS_BOUND)}}
_NON_NEGATIVE_ITEMS = {"items": {"type": "integer", "minimum": 0}}


def name_field() -> Any:
    return Field(None, min_length=1, max_length=MAX_NAME_CHARS)


class RequestModel(BaseModel):
    # Unknown fields are kept (in model_extra) so that the server can name them in a 400: at the top
    # level only a few harmless ones pass (serving.NO_OP_FIELDS); inside messages they are ignored.
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


def _check_token_ids(value: list, where: str) -> list[int]:
    if not value:
        raise ValueError(f"{where} must not be empty")
    if len(value) > MAX_PROMPT_TOKEN_IDS:
        raise ValueError(f"{where} has {len(value)} token ids; at most {MAX_PROMPT_TOKEN_IDS} are accepted")
    if not _all_ints(value) or min(value) < 0:
        raise ValueError(f"{where} must contain only non-negative integer token ids")
    return value


def _all_ints(values: list) -> bool:
    """Every value a plain int (not a bool, whose type is its own). Built-in loops, not a generator
    over the values: a request's thousands of token ids cost microseconds on the event loop."""
    return set(map(type, values)) == {int}


def check_text(value: str, where: str) -> str:
    if len(value) > MAX_PROMPT_CHARS:
        raise ValueError(f"{where} has {len(value)} characters; at most {MAX_PROMPT_CHARS} are accepted")
    return value


def parse_prompt(value: Any, name: str = "prompt", max_prompts: int = MAX_PROMPTS) -> list[str | list[int]]:
    """A completions `prompt` (or embeddings `input`) as a list: str, [str], [int] or [[int]].
    Raises ValueError naming `name`.

    >>> parse_prompt("hi"), parse_prompt([1, 2]), parse_prompt([[1], [2]])
    (['hi'], [[1, 2]], [[1], [2]])
    """
    forms = "a string, a list of strings, a list of token ids or a list of token id lists"
    if isinstance(value, str):
        return [check_text(value, name)]
    if not isinstance(value, list) or not value:
        raise ValueError(f"{name} must be {forms}, and must not be empty")
    if _all_ints(value):
        return [_check_token_ids(value, name)]
    if len(value) > max_prompts:
        raise ValueError(f"{name} has {len(value)} prompts; at most {max_prompts} are accepted per request")
    if all(isinstance(v, str) for v in value):
        return [check_text(v, f"{name}[{i}]") for i, v in enumerate(value)]
    if all(isinstance(v, list) for v in value):
        return [_check_token_ids(v, f"{name}[{i}]") for i, v in enumerate(value)]
    raise ValueError(f"{name} must be {forms} (not a mix)")


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(RequestModel):
    """Fields shared by completions and chat: OpenAI's, then vLLM's extensions."""

    model: str | None = Field(None, max_length=MAX_NAME_CHARS)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_BOUND)
    temperature: float | None = Field(None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Annotated[str | list[str] | None, WithJsonSchema(_STOP_SCHEMA)] = None
    presence_penalty: float | None = Field(None, ge=-PENALTY_BOUND, le=PENALTY_BOUND)
    frequency_penalty: float | None = Field(None, ge=-PENALTY_BOUND, le=PENALTY_BOUND)
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS, json_schema_extra=_LOGIT_BIAS_SCHEMA)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    user: str | None = Field(None, max_length=MAX_NAME_CHARS)
    # vLLM's extensions
    top_k: int | None = Field(None, ge=-1, le=1 << 20)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=MAX_TOKENS_BOUND)
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS,
                                             json_schema_extra=_NON_NEGATIVE_ITEMS)
    allowed_token_ids: list[int] | None = Field(None, max_length=MAX_PROMPT_TOKEN_IDS,
                                                json_schema_extra=_NON_NEGATIVE_ITEMS)
    bad_words: list[str] | None = Field(None, max_length=MAX_BAD_WORDS, json_schema_extra={
        "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS, "pattern": r"\S"}})
    truncate_prompt_tokens: int | None = Field(None, ge=1, le=MAX_PROMPT_TOKEN_IDS)
    # vLLM's: which end truncate_prompt_tokens keeps; "right" the first tokens, "left" (the default) the last
    truncation_side: Literal["left", "right"] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = Field(0, ge=-PRIORITY_BOUND, le=PRIORITY_BOUND)
    cache_salt: str | None = name_field()
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    return_tokens_as_token_ids: bool = False  # logprob tokens read "token_id:123"
    return_token_ids: bool | None = None      # each choice's token ids (and the prompt's) beside its text
    add_special_tokens: bool | None = None    # None: vLLM's default, True for a prompt, False for messages
    # Structured output (api/constraints.py): at most one of these
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = Field(None, max_length=MAX_SPEC_CHARS)
    guided_choice: list[str] | None = Field(None, max_length=MAX_CHOICES)
    guided_grammar: str | None = Field(None, max_length=MAX_SPEC_CHARS)
    # llama-server's names (docs/compatibility.md): a GBNF (or Lark) grammar, a JSON schema, the top
    # n_probs tokens' logprobs of each token, and cache_prompt, accepted (prefix caching is automatic).
    grammar: str | None = Field(None, max_length=MAX_SPEC_CHARS)
    json_schema: dict[str, Any] | None = None
    n_probs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    cache_prompt: bool | None = None
    # vLLM extensions not implemented here: declared only to be rejected (serving.UNSUPPORTED_FIELDS).
    use_beam_search: Any = None
    logits_processors: Any = None
    spaces_between_special_tokens: Any = None

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, value: str | list[str] | None) -> list[str] | None:
        strings = [value] if isinstance(value, str) else value
        if strings is None:
            return None
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are accepted, got {len(strings)}")
        if any(not s or len(s) > MAX_STOP_CHARS for s in strings):
            raise ValueError(f"each stop string must have 1 to {MAX_STOP_CHARS} characters")
        return strings

    @field_validator("stop_token_ids", "allowed_token_ids")
    @classmethod
    def _non_negative_ids(cls, value: list[int] | None, info: ValidationInfo) -> list[int] | None:
        if value is not None and any(t < 0 for t in value):
            raise ValueError(f"{info.field_name} must be non-negative token ids")
        return value

    @field_validator("bad_words")
    @classmethod
    def _bounded_bad_words(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(not s.strip() or len(s) > MAX_STOP_CHARS for s in value):
            raise ValueError(f"each bad word must have 1 to {MAX_STOP_CHARS} characters, not all blank")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not (key.isascii() and key.isdigit() and len(key) <= 10):
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -LOGIT_BIAS_BOUND <= bias <= LOGIT_BIAS_BOUND:
                raise ValueError(f"logit_bias values must be in [-{LOGIT_BIAS_BOUND:g}, {LOGIT_BIAS_BOUND:g}], got {bias}")
        return value

    @model_validator(mode="after")
    def _n_probs_as_logprobs(self) -> SamplingFields:
        """llama-server's `n_probs`, when the endpoint's own logprobs fields are not sent: completions'
        `logprobs`, chat's `logprobs` with `top_logprobs`."""
        fields = type(self).model_fields
        if not self.n_probs or "logprobs" not in fields or getattr(self, "logprobs") not in (None, False):
            return self
        if "top_logprobs" not in fields:
            self.logprobs = self.n_probs
        elif self.top_logprobs is None:
            self.logprobs, self.top_logprobs = True, self.n_probs
        return self

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Whether every chunk of a stream carries its choice's usage so far: as in vLLM, only
        together with include_usage."""
        return self.include_usage and self.stream_options.continuous_usage_stats
