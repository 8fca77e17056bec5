"""Request, response and stream-event models of OpenAI's Responses API (`POST /v1/responses`), text
and function tools only, with every request field bounded as in protocol_fields.py.

Owns the shapes: input items (messages, function calls and their outputs), flat function tools,
`text.format`, the Response object and its server-sent events. Turning a request into a chat
request is api/serving_responses.py's. Knows nothing of the engine or of HTTP routing.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from vllmlite.api.openai.protocol_fields import (
    MAX_MESSAGES,
    MAX_NAME_CHARS,
    MAX_PROMPT_CHARS,
    MAX_TOKENS_BOUND,
    check_text,
)
from vllmlite.api.openai.protocol_tools import (
    FUNCTION_NAME,
    MAX_CALL_ID_CHARS,
    MAX_DESCRIPTION_CHARS,
    MAX_TOOLS,
    ArgumentsText,
)
from vllmlite.sampling_params import MAX_TEMPERATURE

MAX_METADATA_KEYS = 16          # OpenAI's bounds on metadata
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_ANNOTATIONS = 64            # annotations sent back with an output_text part (ignored)
ItemStatus = Literal["in_progress", "completed", "incomplete"]


class _Strict(BaseModel):
    """Nested request objects: strict JSON, and an unknown key is a 400 (a typo must not pass)."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class InputText(_Strict):
    """A text part of an input message: `input_text`, or `output_text` in an assistant message
    sent back (its annotations are accepted and ignored)."""

    type: Literal["input_text", "output_text"]
    text: str = Field(..., max_length=MAX_PROMPT_CHARS)
    annotations: list[dict[str, Any]] | None = Field(None, max_length=MAX_ANNOTATIONS)

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        """An image, audio or file part is rejected by its type first (not by its unknown keys)."""
        part_type = value.get("type") if isinstance(value, dict) else None
        if isinstance(part_type, str) and part_type not in ("input_text", "output_text"):
            raise ValueError(f"content part type {part_type!r} is not supported (only 'input_text' and 'output_text')")
        return value


class InputMessage(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Annotated[list[InputText], Field(max_length=MAX_MESSAGES)] | Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]
    id: str | None = Field(None, max_length=MAX_CALL_ID_CHARS)
    status: ItemStatus | None = None


class InputFunctionCall(_Strict):
    """A call the model made earlier (an output item sent back)."""

    type: Literal["function_call"]
    call_id: str = Field(..., min_length=1, max_length=MAX_CALL_ID_CHARS)
    name: str = Field(..., pattern=FUNCTION_NAME)
    arguments: ArgumentsText
    id: str | None = Field(None, max_length=MAX_CALL_ID_CHARS)
    status: ItemStatus | None = None


class InputFunctionCallOutput(_Strict):
    """The caller's result of a call, matched to it by `call_id`."""

    type: Literal["function_call_output"]
    call_id: str = Field(..., min_length=1, max_length=MAX_CALL_ID_CHARS)
    output: str = Field(..., max_length=MAX_PROMPT_CHARS)
    id: str | None = Field(None, max_length=MAX_CALL_ID_CHARS)
    status: ItemStatus | None = None


_ITEM_TAGS = {"message": "message item", "function_call": "function_call item",
              "function_call_output": "function_call_output item"}


def _item_tag(value: Any) -> str | None:
    """An input item's union tag: by its `type`, "message" when it has none. The tags hold a space,
    so errors.param_path leaves them out of a 400's `param` (`input.0.content`)."""
    item_type = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)
    return _ITEM_TAGS.get(item_type) if isinstance(item_type, str) else None


InputItem = Annotated[
    Annotated[InputMessage, Tag("message item")] | Annotated[InputFunctionCall, Tag("function_call item")]
    | Annotated[InputFunctionCallOutput, Tag("function_call_output item")],
    Discriminator(_item_tag, custom_error_type="invalid_item_type",
                  custom_error_message="an input item's type must be 'message', 'function_call' or "
                                       "'function_call_output'")]


class FunctionTool(_Strict):
    """A function tool in the Responses API's flat form (chat nests it under `function`)."""

    type: Literal["function"]
    name: str = Field(..., pattern=FUNCTION_NAME)
    description: str | None = Field(None, max_length=MAX_DESCRIPTION_CHARS)
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None                # accepted: the schema is enforced whenever calls are forced


class ToolChoiceFunction(_Strict):
    type: Literal["function"]
    name: str = Field(..., pattern=FUNCTION_NAME)


ToolChoice = Literal["none", "auto", "required"] | ToolChoiceFunction


class FormatText(_Strict):
    type: Literal["text"]


class FormatJsonObject(_Strict):
    type: Literal["json_object"]


class FormatJsonSchema(_Strict):
    # `schema` is a BaseModel attribute: the field is schema_, read and written as "schema"
    model_config = ConfigDict(validate_by_name=True, validate_by_alias=True, serialize_by_alias=True)

    type: Literal["json_schema"]
    name: str = Field(..., pattern=FUNCTION_NAME)
    schema_: dict[str, Any] = Field(..., alias="schema")
    description: str | None = Field(None, max_length=MAX_DESCRIPTION_CHARS)
    strict: bool | None = None  # accepted: the schema is always enforced


TextFormat = Annotated[FormatText | FormatJsonObject | FormatJsonSchema, Field(discriminator="type")]


class TextConfig(_Strict):
    format: TextFormat = Field(default_factory=lambda: FormatText(type="text"))


def _metadata_schema() -> dict[str, Any]:
    return {"maxProperties": MAX_METADATA_KEYS, "propertyNames": {"maxLength": MAX_METADATA_KEY_CHARS},
            "additionalProperties": {"type": "string", "maxLength": MAX_METADATA_VALUE_CHARS}}


Metadata = Annotated[dict[Annotated[str, Field(max_length=MAX_METADATA_KEY_CHARS)],
                          Annotated[str, Field(max_length=MAX_METADATA_VALUE_CHARS)]],
                     Field(max_length=MAX_METADATA_KEYS, json_schema_extra=_metadata_schema())]


class ResponsesRequest(BaseModel):
    # Unknown top-level fields are kept (model_extra) so the server can name them in a 400.
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    model: str | None = Field(None, max_length=MAX_NAME_CHARS)
    input: Annotated[list[InputItem], Field(min_length=1, max_length=MAX_MESSAGES)] | Annotated[
        str, Field(max_length=MAX_PROMPT_CHARS)]
    instructions: str | None = Field(None, max_length=MAX_PROMPT_CHARS)  # a system message before input
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, "none" without
    parallel_tool_calls: bool | None = None  # None: one call per answer, as chat
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_BOUND)
    temperature: float | None = Field(None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    text: TextConfig | None = None
    user: str | None = Field(None, max_length=MAX_NAME_CHARS)
    metadata: Metadata | None = None  # echoed in the response, never stored
    store: bool | None = None         # accepted: nothing is stored
    # Accepted only to be rejected with a 400 naming them (serving_responses.RESPONSES_UNSUPPORTED_FIELDS).
    previous_response_id: Any = None
    background: Any = None
    reasoning: Any = None
    include: Any = None
    truncation: Any = None
    conversation: Any = None
    prompt: Any = None

    @field_validator("input", mode="before")
    @classmethod
    def _bound_text_input(cls, value: Any) -> Any:
        """A string past the bound is a length error, not the list member's "Input should be a valid
        array" (pydantic reports the union's last failure)."""
        return check_text(value, "input") if isinstance(value, str) else value


# --- responses ----------------------------------------------------------------------------------

class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class OutputText(_Response):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list)


class OutputMessage(_Response):
    id: str
    type: Literal["message"] = "message"
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class OutputFunctionCall(_Response):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


class ReasoningText(_Response):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(_Response):
    """The model's reasoning, split off by --reasoning-parser; before the message it led to."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[dict[str, Any]] = Field(default_factory=list, max_length=0)  # no summaries are written
    content: list[ReasoningText]
    status: ItemStatus


OutputItem = Annotated[OutputReasoning | OutputMessage | OutputFunctionCall, Field(discriminator="type")]


class InputTokensDetails(_Response):
    cached_tokens: int = 0      # prompt tokens found in the prefix cache
    cache_write_tokens: int = 0  # OpenAI's explicit (billed) cache writes: there are none here


class OutputTokensDetails(_Response):
    reasoning_tokens: int = 0


class ResponseUsage(_Response):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(_Response):
    reason: Literal["max_output_tokens"]


class ResponsesResponse(_Response):
    """OpenAI's Response object; the request's settings are echoed as the answer was made."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete"]
    incomplete_details: IncompleteDetails | None = None
    error: None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None  # None until the answer is done (the first stream events)
    instructions: str | None = None
    max_output_tokens: int | None = None
    parallel_tool_calls: bool
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction
    tools: list[FunctionTool] = Field(default_factory=list)
    text: TextConfig
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    store: Literal[False] = False  # nothing is stored
    background: Literal[False] = False
    previous_response_id: None = None
    truncation: Literal["disabled"] = "disabled"


# --- stream events: `event: <type>` then `data: <json>`, sequence_number counting from 0 ---------

class _Event(_Response):
    sequence_number: int


class ResponseLifecycleEvent(_Event):
    type: Literal["response.created", "response.in_progress", "response.completed", "response.incomplete"]
    response: ResponsesResponse


class OutputItemEvent(_Event):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class ContentPartEvent(_Event):
    type: Literal["response.content_part.added", "response.content_part.done"]
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class OutputTextDeltaEvent(_Event):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[dict[str, Any]] = Field(default_factory=list, max_length=0)


class OutputTextDoneEvent(_Event):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[dict[str, Any]] = Field(default_factory=list, max_length=0)


class ReasoningTextDeltaEvent(_Event):
    type: Literal["response.reasoning_text.delta"] = "response.reasoning_text.delta"
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningTextDoneEvent(_Event):
    type: Literal["response.reasoning_text.done"] = "response.reasoning_text.done"
    item_id: str
    output_index: int
    content_index: int
    text: str


class ArgumentsDeltaEvent(_Event):
    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(_Event):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    item_id: str
    output_index: int
    arguments: str


class ResponseErrorEvent(_Event):
    """A failure after the stream started (the request's output is lost)."""

    type: Literal["error"] = "error"
    code: str | None
    message: str
    param: str | None


STREAM_EVENTS = (ResponseLifecycleEvent, OutputItemEvent, ContentPartEvent, OutputTextDeltaEvent,
                 OutputTextDoneEvent, ReasoningTextDeltaEvent, ReasoningTextDoneEvent, ArgumentsDeltaEvent,
                 ArgumentsDoneEvent, ResponseErrorEvent)
