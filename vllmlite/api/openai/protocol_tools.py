"""Request and response models of tool calling and structured output, in OpenAI's and vLLM's shapes.

Owns the shapes and their bounds: `tools`, `tool_choice`, a message's `tool_calls`, `response_format`
and vLLM's `structured_outputs`. Turning them into a grammar is api/constraints.py's; rendering and
parsing tool calls is api/tool_calls.py's. Knows nothing of the engine.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from vllmlite import json_text
from vllmlite.structured_output_params import MAX_CHOICES, MAX_SPEC_CHARS

MAX_TOOLS = 128                  # OpenAI's bound
MAX_TOOL_CALLS = 128             # calls in one assistant message
MAX_DESCRIPTION_CHARS = 1 << 14
MAX_ARGUMENTS_CHARS = 1 << 20
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function and schema names
MAX_CALL_ID_CHARS = 256


class _Strict(BaseModel):
    """Nested request objects: strict JSON, and an unknown key is a 400 (a typo must not pass)."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, populate_by_name=True)


class FunctionDefinition(_Strict):
    name: str = Field(..., pattern=FUNCTION_NAME)
    description: str | None = Field(None, max_length=MAX_DESCRIPTION_CHARS)
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object; None: no arguments
    strict: bool | None = None                # accepted: the schema is always enforced when calls are


class ChatTool(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str = Field(..., pattern=FUNCTION_NAME)


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def check_arguments(text: str) -> str:
    """A past call's arguments, as a client sends them back: JSON text is parsed to render it, so JSON
    nested too deep or repeating a key is refused here (text that is not JSON renders as it is).

    >>> check_arguments('{"city": "Paris"}'), check_arguments("not json")
    ('{"city": "Paris"}', 'not json')
    """
    try:
        json_text.loads(text)
    except json_text.JSONTextError as error:
        raise ValueError(f"the JSON text {error}") from None
    except ValueError:
        pass
    return text


# JSON text, as OpenAI sends it
ArgumentsText = Annotated[str, Field(max_length=MAX_ARGUMENTS_CHARS), AfterValidator(check_arguments)]


class FunctionCall(_Strict):
    name: str = Field(..., pattern=FUNCTION_NAME)
    arguments: ArgumentsText


class ToolCall(_Strict):
    """A call in an assistant message sent back to us, or in our answer."""

    id: str = Field(..., min_length=1, max_length=MAX_CALL_ID_CHARS)
    type: Literal["function"] = "function"
    function: FunctionCall


class JsonSchemaFormat(_Strict):
    name: str = Field("response", pattern=FUNCTION_NAME)
    description: str | None = Field(None, max_length=MAX_DESCRIPTION_CHARS)
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # None: any JSON object
    strict: bool | None = None  # accepted: the schema is always enforced


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    # vLLM's type "structural_tag": `structures` and `triggers` (its legacy shape), or xgrammar's `format`
    structures: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    triggers: list[str] | None = Field(None, max_length=MAX_TOOLS)
    format: dict[str, Any] | None = None
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # llama-server's: the schema at this level


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` request field (the fields of its StructuredOutputsParams)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = Field(None, max_length=MAX_SPEC_CHARS)
    choice: list[str] | None = Field(None, max_length=MAX_CHOICES)
    grammar: str | None = Field(None, max_length=MAX_SPEC_CHARS)
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = Field(None, max_length=256)
    structural_tag: str | None = Field(None, max_length=MAX_SPEC_CHARS)


# --- responses ----------------------------------------------------------------------------------

class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionCallOut(_Response):
    name: str
    arguments: str


class ToolCallOut(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class FunctionCallDelta(_Response):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Response):
    """One call in a streamed chunk: the first delta of a call carries its id, type and name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta
