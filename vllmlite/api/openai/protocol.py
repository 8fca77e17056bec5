"""Request and response models of the completions, chat, tokenize and embeddings endpoints in OpenAI's
shapes (pydantic 2).

Owns the endpoints' own fields and every response shape; the bounds, the shared validators and the
sampling fields both generating endpoints take are protocol_fields.py's. Knows nothing of the engine,
tokenizers or HTTP routing.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, WithJsonSchema, field_serializer, field_validator

from vllmlite.api.openai.protocol_fields import (
    MAX_EMBEDDING_INPUTS,
    MAX_MESSAGES,
    MAX_N,
    MAX_NAME_CHARS,
    MAX_PROMPT_CHARS,
    MAX_PROMPT_TOKEN_IDS,
    MAX_PROMPTS,
    MAX_TOKENS_BOUND,
    RequestModel,
    SamplingFields,
    check_text,
    name_field,
    parse_prompt,
)
from vllmlite.api.openai.protocol_tools import (
    MAX_CALL_ID_CHARS,
    MAX_TOOL_CALLS,
    MAX_TOOLS,
    ChatTool,
    ToolCall,
    ToolCallDelta,
    ToolCallOut,
    ToolChoice,
)
from vllmlite.sampling_params import MAX_LENGTH_PENALTY, MAX_LOGPROBS


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


class CompletionRequest(SamplingFields):
    prompt: Annotated[Any, WithJsonSchema(_prompt_schema(MAX_PROMPTS))]
    suffix: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    # vLLM's beam search (serving_beam_search.py): n is the beam width
    use_beam_search: bool = False
    length_penalty: float = Field(1.0, ge=-MAX_LENGTH_PENALTY, le=MAX_LENGTH_PENALTY)

    @field_validator("prompt")
    @classmethod
    def _parse_prompt(cls, value: Any) -> list[str | list[int]]:
        return parse_prompt(value)


class ChatMessage(RequestModel):
    """One message; `content` arrives as a string or text parts and leaves as a string."""

    model_config = ConfigDict(json_schema_extra=_message_schema)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    # validated to a str; its JSON schema is _message_schema's
    content: Annotated[Any, WithJsonSchema(_CONTENT_SCHEMA)] = Field(None, validate_default=True)
    name: str | None = name_field()
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOL_CALLS)  # an assistant's calls
    tool_call_id: str | None = Field(None, min_length=1, max_length=MAX_CALL_ID_CHARS)  # a tool's answer
    # An earlier answer's reasoning, for templates that show it (vLLM's name; DeepSeek's older one too)
    reasoning: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    reasoning_content: str | None = Field(None, max_length=MAX_PROMPT_CHARS)

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
        return check_text(value, "content")

    @field_validator("tool_calls", "reasoning", "reasoning_content")
    @classmethod
    def _only_the_assistants(cls, value: Any, info: ValidationInfo) -> Any:
        """Calls and reasoning are the model's: on any other turn a template would render them as if
        it made them."""
        role = info.data.get("role")  # absent when the role itself was invalid: that error is reported
        if value and role not in (None, "assistant"):
            raise ValueError(f"only an assistant message may carry {info.field_name}, not a {role} message")
        return value

    def as_dict(self) -> dict:
        """The message as the chat template sees it (the renderer gives the reasoning the names
        templates read)."""
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        for key in ("reasoning", "reasoning_content"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
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
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_BOUND)
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, "none" without
    parallel_tool_calls: bool | None = None  # None: one call per answer (llama.cpp's default)
    # Accepted only to be rejected with a clear message (serving.UNSUPPORTED_FIELDS, serving_chat).
    functions: Any = None
    function_call: Any = None
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the model's template
    chat_template: Any = None
    echo: Any = None
    continue_final_message: Any = None
    documents: Any = None
    audio: Any = None
    modalities: Any = None
    web_search_options: Any = None


class TokenizeRequest(RequestModel):
    model: str | None = Field(None, max_length=MAX_NAME_CHARS)
    prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    # llama-server's shape (api/llamacpp/serving_tokenize.py): the text, BOS or not, pieces or not
    content: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    add_special: bool | None = None
    parse_special: bool | None = None
    with_pieces: bool | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = Field(None, max_length=MAX_NAME_CHARS)
    tokens: list[int] = Field(..., max_length=MAX_PROMPT_TOKEN_IDS)


class EmbeddingRequest(RequestModel):
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
    prompt_tokens_details: PromptTokensDetails | None = None  # with --enable-prompt-tokens-details


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
    prompt_token_ids: list[int] | None = None  # with return_token_ids (a stream's first chunk of the choice)
    token_ids: list[int] | None = None         # with return_token_ids: the generated ids (a chunk's new ones)


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
    reasoning: str | None = None  # vLLM's field, always sent: null unless --reasoning-parser splits the output


class ChatChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids


class DeltaMessage(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None  # vLLM's field; sent only when set, as every delta field
    tool_calls: list[ToolCallDelta] | None = None


class ChatStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids: this chunk's new ids

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
    prompt_token_ids: list[int] | None = None  # with return_token_ids, on each choice's first (role) chunk


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
    content: str  # the same text under llama-server's name


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
