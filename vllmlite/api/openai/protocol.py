"""Request and response models in OpenAI's shapes (pydantic 2), with every request field bounded.

Requests are parsed strictly from JSON (no "1" for 1, no 1.0 for an int, no NaN); an unknown
top-level field is a 400 (serving.reject_unknown_fields). Every size a client controls is capped here, before anything is
tokenized or allocated. Knows nothing of the engine, tokenizers or HTTP routing.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, WithJsonSchema, field_serializer, field_validator

from vllmlite.api.openai.protocol_tools import (
    MAX_CALL_ID_CHARS,
    MAX_CHOICES,
    MAX_SPEC_CHARS,
    MAX_TOOL_CALLS,
    MAX_TOOLS,
    ChatTool,
    ResponseFormat,
    StructuredOutputs,
    ToolCall,
    ToolCallDelta,
    ToolCallOut,
    ToolChoice,
)

MAX_N = 16                     # n and best_of
MAX_PROMPTS = 64               # prompts in one completions request
MAX_EMBEDDING_INPUTS = 256     # inputs in one embeddings request (the queue bound applies too)
MAX_PROMPT_CHARS = 1 << 21     # one prompt string or message content
MAX_PROMPT_TOKEN_IDS = 1 << 18 # one token-id prompt (the engine then checks the context length)
MAX_MESSAGES = 1024
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300
MAX_BAD_WORDS = 64
MAX_TOKENS_BOUND = 1 << 20     # the engine then checks prompt + max_tokens against the context
MAX_NAME_CHARS = 256           # model, user, cache_salt, message name
MAX_COMPLETION_LOGPROBS = 20    # vLLM's bound for completions `logprobs` and for `prompt_logprobs`
MAX_CHAT_TOP_LOGPROBS = 20
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
PRIORITY_BOUND = 2**31


# JSON schemas of the fields whose Python type is wider than what they accept (a validator narrows
# them): they document the accepted forms in /openapi.json; parsing stays the validators' job.
def _token_ids_schema(max_items: int = MAX_PROMPT_TOKEN_IDS) -> dict:
    return {"type": "array", "minItems": 1, "maxItems": max_items, "items": {"type": "integer", "minimum": 0}}


def _prompt_schema(max_prompts: int, min_chars: int = 0) -> dict:
    """str, [str], [int] or [[int]], as `parse_prompt` accepts them."""
    text = {"type": "string", "minLength": min_chars, "maxLength": MAX_PROMPT_CHARS}
    return {"anyOf": [text, {"type": "array", "minItems": 1, "maxItems": max_prompts, "items": text},
                      _token_ids_schema(),
                      {"type": "array", "minItems": 1, "maxItems": max_prompts, "items": _token_ids_schema()}]}


_STOP_STRING_SCHEMA = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
_STOP_SCHEMA = {"anyOf": [_STOP_STRING_SCHEMA, {"type": "null"},
                          {"type": "array", "maxItems": MAX_STOP_STRINGS, "items": _STOP_STRING_SCHEMA}]}
_LOGIT_BIAS_SCHEMA = {"propertyNames": {"pattern": "^[0-9]{1,10}$"},
                      "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}
_NON_NEGATIVE_ITEMS = {"items": {"type": "integer", "minimum": 0}}
_CONTENT_SCHEMA = {"anyOf": [
    {"type": "string", "maxLength": MAX_PROMPT_CHARS},
    {"type": "array", "maxItems": MAX_MESSAGES, "items": {
        "type": "object", "required": ["type", "text"],
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]}


def _message_schema(schema: dict[str, Any]) -> None:
    """A message's JSON schema, in two forms: only an assistant's content may be null or absent."""
    properties = schema.pop("properties")
    roles = [role for role in properties["role"]["enum"] if role != "assistant"]
    schema["anyOf"] = [
        {"properties": {**properties, "role": {"enum": roles}}, "required": ["role", "content"]},
        {"properties": {**properties, "role": {"const": "assistant"},
                        "content": {"anyOf": [_CONTENT_SCHEMA, {"type": "null"}]}}, "required": ["role"]},
    ]
    del schema["required"]


def _name_field() -> Any:
    return Field(None, min_length=1, max_length=MAX_NAME_CHARS)


class _Request(BaseModel):
    # Unknown fields are kept (in model_extra) so that the server can name them in a 400: at the top
    # level only a few harmless ones pass (serving.NO_OP_FIELDS); inside messages they are ignored.
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


def _check_token_ids(value: list, where: str) -> list[int]:
    if not value:
        raise ValueError(f"{where} must not be empty")
    if len(value) > MAX_PROMPT_TOKEN_IDS:
        raise ValueError(f"{where} has {len(value)} token ids; at most {MAX_PROMPT_TOKEN_IDS} are accepted")
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise ValueError(f"{where} must contain only non-negative integer token ids")
    return value


def _check_text(value: str, where: str) -> str:
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
        return [_check_text(value, name)]
    if not isinstance(value, list) or not value:
        raise ValueError(f"{name} must be {forms}, and must not be empty")
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return [_check_token_ids(value, name)]
    if len(value) > max_prompts:
        raise ValueError(f"{name} has {len(value)} prompts; at most {max_prompts} are accepted per request")
    if all(isinstance(v, str) for v in value):
        return [_check_text(v, f"{name}[{i}]") for i, v in enumerate(value)]
    if all(isinstance(v, list) for v in value):
        return [_check_token_ids(v, f"{name}[{i}]") for i, v in enumerate(value)]
    raise ValueError(f"{name} must be {forms} (not a mix)")


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(_Request):
    """Fields shared by completions and chat: OpenAI's, then vLLM's extensions."""

    model: str | None = Field(None, max_length=MAX_NAME_CHARS)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_BOUND)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Annotated[str | list[str] | None, WithJsonSchema(_STOP_SCHEMA)] = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
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
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = Field(0, ge=-PRIORITY_BOUND, le=PRIORITY_BOUND)
    cache_salt: str | None = _name_field()
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    return_tokens_as_token_ids: bool = False  # logprob tokens read "token_id:123"
    add_special_tokens: bool | None = None    # None: vLLM's default, True for a prompt, False for messages
    # Structured output (api/constraints.py): at most one of these
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = Field(None, max_length=MAX_SPEC_CHARS)
    guided_choice: list[str] | None = Field(None, max_length=MAX_CHOICES)
    guided_grammar: str | None = Field(None, max_length=MAX_SPEC_CHARS)
    # vLLM extensions not implemented here: declared only to be rejected (serving.UNSUPPORTED_FIELDS).
    use_beam_search: Any = None
    logits_processors: Any = None
    return_token_ids: Any = None
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
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        return value

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Whether every chunk of a stream carries the usage so far (vLLM asks include_usage too;
        we do not, so the flag is never silently ignored)."""
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(SamplingFields):
    prompt: Annotated[Any, WithJsonSchema(_prompt_schema(MAX_PROMPTS))]
    suffix: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    best_of: int | None = Field(None, ge=1, le=MAX_N)

    @field_validator("prompt")
    @classmethod
    def _parse_prompt(cls, value: Any) -> list[str | list[int]]:
        return parse_prompt(value)


class ChatMessage(_Request):
    """One message; `content` arrives as a string or text parts and leaves as a string."""

    model_config = ConfigDict(json_schema_extra=_message_schema)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    # validated to a str; its JSON schema is _message_schema's
    content: Annotated[Any, WithJsonSchema(_CONTENT_SCHEMA)] = Field(None, validate_default=True)
    name: str | None = _name_field()
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOL_CALLS)  # an assistant's calls
    tool_call_id: str | None = Field(None, min_length=1, max_length=MAX_CALL_ID_CHARS)  # a tool's answer

    @field_validator("content")
    @classmethod
    def _text_content(cls, value: Any, info: ValidationInfo) -> str:
        if value is None and info.data.get("role") == "assistant":
            return ""
        if isinstance(value, list):
            if len(value) > MAX_MESSAGES:
                raise ValueError(f"at most {MAX_MESSAGES} content parts are accepted")
            value = "\n".join(_part_text(part) for part in value)
        if not isinstance(value, str):
            raise ValueError("content must be a string or a list of text parts")
        return _check_text(value, "content")

    def as_dict(self) -> dict:
        """The message as the chat template sees it."""
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        return message


def _part_text(part: Any) -> str:
    """`{"type": "text", "text": "..."}` -> its text; any other part (image, audio) is rejected."""
    part_type = part.get("type") if isinstance(part, dict) else type(part).__name__
    if part_type != "text":
        raise ValueError(f"content part type {part_type!r} is not supported (only 'text')")
    text = part.get("text")
    if not isinstance(text, str):
        raise ValueError("a text content part must have a string 'text'")
    return text


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_BOUND)
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, "none" without
    parallel_tool_calls: bool | None = None  # None: one call per answer (llama.cpp's default)
    # Accepted only to be rejected with a clear message (serving.UNSUPPORTED_FIELDS, serving_chat).
    functions: Any = None
    function_call: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None
    echo: Any = None
    continue_final_message: Any = None
    documents: Any = None
    audio: Any = None
    modalities: Any = None
    web_search_options: Any = None


class TokenizeRequest(_Request):
    model: str | None = Field(None, max_length=MAX_NAME_CHARS)
    prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    model: str | None = Field(None, max_length=MAX_NAME_CHARS)
    tokens: list[int] = Field(..., max_length=MAX_PROMPT_TOKEN_IDS)


class EmbeddingRequest(_Request):
    input: Annotated[Any, WithJsonSchema(_prompt_schema(MAX_EMBEDDING_INPUTS, min_chars=1))]
    model: str | None = Field(None, max_length=MAX_NAME_CHARS)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = Field(None, max_length=MAX_NAME_CHARS)

    @field_validator("input")
    @classmethod
    def _parse_input(cls, value: Any) -> list[str | list[int]]:
        inputs = parse_prompt(value, "input", MAX_EMBEDDING_INPUTS)
        if any(text == "" for text in inputs):
            raise ValueError("input must not contain empty strings")
        return inputs


# --- responses ----------------------------------------------------------------------------------

class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class Usage(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(_Response):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(_Response):
    """One entry of vLLM's `prompt_logprobs`: `{token_id: {logprob, rank, decoded_token}}`."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, PromptLogprob] | None]  # [None, {...}, ...]: the first token has none


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = ""  # None when the answer is only tool calls
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class ChatChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = None


class DeltaMessage(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @field_serializer("delta")
    def _delta_without_nulls(self, delta: DeltaMessage) -> dict:
        return delta.model_dump(exclude_none=True)  # OpenAI's last delta is {}


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "vllmlite"
    root: str
    max_model_len: int


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(_Response):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(_Response):
    prompt: str


class EmbeddingData(_Response):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # a base64 string with encoding_format "base64"


class EmbeddingUsage(_Response):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(_Response):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


class VersionResponse(_Response):
    version: str


class ErrorDetail(_Response):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(_Response):
    """Every error's body, in OpenAI's shape (`errors.error_body` builds it)."""

    error: ErrorDetail
