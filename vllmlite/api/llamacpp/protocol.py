"""Request and response models of llama-server's own endpoints: /completion, /tokenize with `content`,
/apply-template and /props, with llama-server's field names, defaults and shapes (pydantic 2).

Owns the fields, their bounds and the tables of llama-server fields that are accepted only at the
value that means "off" (REFUSED_FIELDS). Turning a request into sampling parameters is sampling.py's.
Knows nothing of the engine, tokenizers or HTTP routing.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator, model_serializer

from vllmlite.api.openai.protocol import ChatMessage
from vllmlite.api.openai.protocol_fields import (
    MAX_MESSAGES,
    MAX_NAME_CHARS,
    MAX_PROMPT_CHARS,
    MAX_PROMPT_TOKEN_IDS,
    MAX_PROMPTS,
    MAX_STOP_CHARS,
    MAX_TOKENS_BOUND,
    RequestModel,
    check_text,
)
from vllmlite.api.openai.protocol_tools import MAX_TOOLS, ChatTool
from vllmlite.sampling_params import LOGIT_BIAS_BOUND, MAX_LOGPROBS, MAX_STOP_STRINGS, MAX_TEMPERATURE, PENALTY_BOUND
from vllmlite.sampling_params import SEED_MAX as _SEED_MAX
from vllmlite.structured_output_params import MAX_SPEC_CHARS

MAX_LOGIT_BIAS = 300
MAX_RESPONSE_FIELDS = 64

# llama-server's request fields this server does not implement: (name, the values that mean "off",
# why). Any other value is a 400 naming the field, never ignored.
REFUSED_FIELDS = (
    ("mirostat", (None, 0), "no mirostat sampler"),
    ("dynatemp_range", (None, 0, 0.0), "no dynamic temperature"),
    ("typical_p", (None, 1, 1.0), "no locally typical sampling"),
    ("xtc_probability", (None, 0, 0.0), "no XTC sampler"),
    ("dry_multiplier", (None, 0, 0.0), "no DRY sampler"),
    ("top_n_sigma", (None, -1, -1.0), "no top-n-sigma sampler"),
    ("min_keep", (None, 0), "no min_keep"),
    ("n_indent", (None, 0), "no indentation stop"),
    ("t_max_predict_ms", (None, 0), "no time limit on prediction"),
    ("id_slot", (None, -1), "no slots: the engine schedules every request"),
    ("n_cmpl", (None, 1), "one completion per prompt here; /v1/completions has n"),
    ("n", (None, 1), "one completion per prompt here; /v1/completions has n"),
    ("post_sampling_probs", (None, False), "n_probs gives the model's probabilities before sampling"),
    ("samplers", (None,), "the sampler chain is fixed"),
    ("lora", (None, []), "no LoRA adapters"),
    ("return_progress", (None, False), "no prompt-progress events"),
    ("n_cache_reuse", (None, 0), "no KV shifting; prefix caching is automatic"),
)

_TEXT = {"type": "string", "maxLength": MAX_PROMPT_CHARS}
_PIECE = {"anyOf": [{"type": "integer", "minimum": 0}, _TEXT]}
_SEQUENCE = {"type": "array", "minItems": 1, "maxItems": MAX_PROMPT_TOKEN_IDS, "items": _PIECE}
# A string, a sequence of token ids and strings (one prompt), or several of those (a result each).
PROMPT_SCHEMA = {"anyOf": [_TEXT, _SEQUENCE, {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS,
                                              "items": {"anyOf": [_TEXT, _SEQUENCE]}}]}
_BIAS = {"anyOf": [{"type": "number", "minimum": -LOGIT_BIAS_BOUND, "maximum": LOGIT_BIAS_BOUND},
                   {"const": False}]}
LOGIT_BIAS_SCHEMA = {"anyOf": [
    {"type": "array", "maxItems": MAX_LOGIT_BIAS, "items": {
        "type": "array", "minItems": 2, "maxItems": 2,
        "prefixItems": [{"anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "minLength": 1,
                                                                       "maxLength": MAX_STOP_CHARS}]}, _BIAS]}},
    {"type": "object", "maxProperties": MAX_LOGIT_BIAS,
     "propertyNames": {"minLength": 1, "maxLength": MAX_STOP_CHARS}, "additionalProperties": _BIAS},
    {"type": "null"}]}
_STOP_STRING = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
STOP_SCHEMA = {"anyOf": [_STOP_STRING, {"type": "array", "maxItems": MAX_STOP_STRINGS, "items": _STOP_STRING},
                        {"type": "null"}]}

Prompt = list[int | str]  # one prompt: token ids and text, in order


def _is_piece(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)


def parse_prompt(value: Any) -> list[Prompt]:
    """llama-server's `prompt` forms, as a list of prompts (one result each), each a list of token
    ids and strings. Raises ValueError.

    >>> parse_prompt("hi"), parse_prompt([1, "a", 2]), parse_prompt(["a", [1, 2]])
    ([['hi']], [[1, 'a', 2]], [['a'], [1, 2]])
    """
    if isinstance(value, str):
        return [[check_text(value, "prompt")]]
    if isinstance(value, dict):
        raise ValueError("multimodal prompts (prompt_string, multimodal_data) are not supported: text only")
    if not isinstance(value, list) or not value:
        raise ValueError("prompt must be a string, a list of token ids and strings, or a list of those")
    if all(isinstance(v, str) for v in value):
        prompts: list[Any] = value
    elif all(_is_piece(v) for v in value):
        prompts = [value]
    elif all(isinstance(v, (str, list)) for v in value):
        prompts = value
    else:
        raise ValueError("prompt must contain only non-negative token ids, strings, or lists of those")
    if len(prompts) > MAX_PROMPTS:
        raise ValueError(f"prompt has {len(prompts)} prompts; at most {MAX_PROMPTS} are accepted per request")
    return [_one_prompt(p, i) for i, p in enumerate(prompts)]


def _one_prompt(value: str | list, index: int) -> Prompt:
    where = f"prompt[{index}]"
    if isinstance(value, str):
        return [check_text(value, where)]
    if not value or len(value) > MAX_PROMPT_TOKEN_IDS or not all(_is_piece(v) for v in value):
        raise ValueError(f"{where} must be 1 to {MAX_PROMPT_TOKEN_IDS} non-negative token ids and strings")
    return [check_text(v, where) if isinstance(v, str) else v for v in value]


class LlamaCompletionRequest(RequestModel):
    """POST /completion (and /completions): llama-server's fields with llama-server's defaults."""

    prompt: Annotated[Any, WithJsonSchema(PROMPT_SCHEMA)]
    model: str | None = Field(None, max_length=MAX_NAME_CHARS)
    n_predict: int | None = Field(None, ge=-1, le=MAX_TOKENS_BOUND)  # -1: until EOS or the context is full
    max_tokens: int | None = Field(None, ge=-1, le=MAX_TOKENS_BOUND)  # n_predict's other name
    temperature: float = Field(0.8, le=MAX_TEMPERATURE)  # <= 0: greedy
    top_k: int = Field(40, ge=-1, le=1 << 20)             # <= 0: off
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    min_p: float = Field(0.05, ge=0.0, le=1.0)
    seed: int = Field(-1, ge=-1, le=_SEED_MAX)            # -1 (or 4294967295): a random seed
    stop: Annotated[str | list[str] | None, WithJsonSchema(STOP_SCHEMA)] = Field(None, validate_default=True)
    stream: bool = False
    n_probs: int = Field(0, ge=0, le=MAX_LOGPROBS)
    grammar: str | None = Field(None, max_length=MAX_SPEC_CHARS)  # GBNF (or Lark); "" is none
    json_schema: dict[str, Any] | None = None
    ignore_eos: bool = False
    repeat_penalty: float = Field(1.0, gt=0.0, le=10.0)
    repeat_last_n: int | None = Field(None, ge=-1, le=MAX_PROMPT_TOKEN_IDS)  # None, -1: the whole context
    presence_penalty: float = Field(0.0, ge=-PENALTY_BOUND, le=PENALTY_BOUND)
    frequency_penalty: float = Field(0.0, ge=-PENALTY_BOUND, le=PENALTY_BOUND)
    logit_bias: Annotated[Any, WithJsonSchema(LOGIT_BIAS_SCHEMA)] = None
    return_tokens: bool = False
    timings_per_token: bool = False
    response_fields: list[Annotated[str, Field(max_length=MAX_NAME_CHARS)]] | None = Field(
        None, max_length=MAX_RESPONSE_FIELDS)
    cache_prompt: bool = True  # accepted: prefix caching is automatic
    # Accepted and moot: they tune a sampler or a context shift this server never runs.
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    dynatemp_exponent: float | None = None
    xtc_threshold: float | None = None
    dry_base: float | None = None
    dry_allowed_length: int | None = None
    dry_penalty_last_n: int | None = None
    dry_sequence_breakers: list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]] | None = Field(None, max_length=64)
    n_keep: int | None = None
    n_discard: int | None = None
    # Declared only to be rejected unless "off" (REFUSED_FIELDS).
    mirostat: Any = None
    dynatemp_range: Any = None
    typical_p: Any = None
    xtc_probability: Any = None
    dry_multiplier: Any = None
    top_n_sigma: Any = None
    min_keep: Any = None
    n_indent: Any = None
    t_max_predict_ms: Any = None
    id_slot: Any = None
    n_cmpl: Any = None
    n: Any = None
    post_sampling_probs: Any = None
    samplers: Any = None
    lora: Any = None
    return_progress: Any = None
    n_cache_reuse: Any = None

    @field_validator("prompt")
    @classmethod
    def _parse_prompt(cls, value: Any) -> list[Prompt]:
        return parse_prompt(value)

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, value: str | list[str] | None) -> list[str]:
        strings = [value] if isinstance(value, str) else value or []
        if len(strings) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_CHARS for s in strings):
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings of 1 to {MAX_STOP_CHARS} characters")
        return strings

    @property
    def num_predict(self) -> int:
        """n_predict, else max_tokens, else -1 (no limit but the context)."""
        return next((n for n in (self.n_predict, self.max_tokens) if n is not None), -1)


class ApplyTemplateRequest(RequestModel):
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    model: str | None = Field(None, max_length=MAX_NAME_CHARS)
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS)


# --- responses ----------------------------------------------------------------------------------

class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TokenProb(_Response):
    id: int
    token: str          # the token's text, cut before an incomplete UTF-8 character
    bytes: list[int]
    logprob: float


class TokenProbs(TokenProb):
    """One generated token and the n_probs most likely ones at its position."""

    top_logprobs: list[TokenProb]


class Timings(_Response):
    cache_n: int        # prompt tokens served from the prefix cache
    prompt_n: int       # prompt tokens computed
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float


class LogitBiasEntry(_Response):
    bias: float
    token: int


class GenerationSettings(_Response):
    """The settings a completion ran with (llama-server's names; -1 for no limit or a random seed)."""

    n_predict: int
    max_tokens: int
    seed: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repeat_last_n: int
    repeat_penalty: float
    presence_penalty: float
    frequency_penalty: float
    stop: list[str]
    ignore_eos: bool
    stream: bool
    n_probs: int
    grammar: str
    logit_bias: list[LogitBiasEntry]


class LlamaCompletionResponse(_Response):
    """One result of /completion, or one event of its stream: `stop` false for a piece of text, true
    for the result (in a stream its text was already sent, so `content` is empty). Fields that a
    piece does not carry are left out, never null."""

    index: int
    content: str
    tokens: list[int]
    stop: bool
    tokens_predicted: int
    tokens_evaluated: int
    timings: Timings | None = None
    completion_probabilities: list[TokenProbs] | None = None
    model: str | None = None
    generation_settings: GenerationSettings | None = None
    prompt: str | None = None
    has_new_line: bool | None = None
    truncated: bool | None = None
    stop_type: Literal["none", "eos", "limit", "word"] | None = None
    stopping_word: str | None = None
    tokens_cached: int | None = None

    @model_serializer(mode="wrap")
    def _without_absent_fields(self, handler: Any) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class TokenPiece(_Response):
    id: int
    piece: str | list[int]  # the token's text, or its bytes when they are not valid UTF-8 alone


class LlamaTokenizeResponse(_Response):
    tokens: list[int] | list[TokenPiece]


class ApplyTemplateResponse(_Response):
    prompt: str


class DefaultGenerationSettings(_Response):
    n_ctx: int
    params: GenerationSettings


class Modalities(_Response):
    vision: bool = False
    audio: bool = False


class PropsResponse(_Response):
    default_generation_settings: DefaultGenerationSettings
    total_slots: int        # requests the engine runs at once
    model_alias: str
    model_path: str         # the served model's name: no filesystem path leaves the server
    chat_template: str
    modalities: Modalities = Field(default_factory=Modalities)
    bos_token: str
    eos_token: str
    build_info: str
    is_sleeping: bool = False


# The single-result answer, several results (a list prompt), or the fields `response_fields` named.
COMPLETION_ANSWER_SCHEMA = {"anyOf": [
    {"$ref": "#/components/schemas/LlamaCompletionResponse"},
    {"type": "array", "items": {"$ref": "#/components/schemas/LlamaCompletionResponse"}},
    {"type": "object", "description": "With response_fields: only those fields, a/b read as b inside a"},
]}
REQUEST_MODELS = (LlamaCompletionRequest, ApplyTemplateRequest)
RESPONSE_MODELS = (LlamaCompletionResponse, LlamaTokenizeResponse, ApplyTemplateResponse, PropsResponse)
