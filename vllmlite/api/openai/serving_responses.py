"""POST /v1/responses: OpenAI's Responses API (text and function tools), served by the chat path.

Owns the translation both ways: a ResponsesRequest becomes a ChatCompletionRequest, validated and
prepared as any chat request (its 400s renamed to the Responses fields), and the chat answer or its
chunks become a Response object or the Responses server-sent events. Adds no engine logic and knows
nothing of routes or middleware.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from pydantic import ValidationError

from vllmlite.api.errors import APIError, from_validation_error
from vllmlite.api.openai.protocol import ChatCompletionRequest, Usage
from vllmlite.api.openai.protocol_responses import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    FormatJsonObject,
    FormatText,
    IncompleteDetails,
    InputFunctionCall,
    InputFunctionCallOutput,
    InputText,
    InputTokensDetails,
    OutputFunctionCall,
    OutputItem,
    OutputItemEvent,
    OutputMessage,
    OutputReasoning,
    OutputText,
    OutputTextDeltaEvent,
    OutputTextDoneEvent,
    ReasoningText,
    ReasoningTextDeltaEvent,
    ReasoningTextDoneEvent,
    ResponseErrorEvent,
    ResponseLifecycleEvent,
    ResponsesRequest,
    ResponsesResponse,
    ResponseUsage,
    TextConfig,
    TextFormat,
)
from vllmlite.api.openai.serving import Admission, ServingContext, admit, final_outputs, reject_unsupported, sse_stream
from vllmlite.api.openai.serving_chat import PreparedChat, chat_chunks, chat_response, prepare_chat
from vllmlite.engine.request_stream import RequestStream

RESPONSES_UNSUPPORTED_FIELDS = (
    ("previous_response_id", (None,), "no response is stored; send the whole conversation as input"),
    ("background", (None, False), "responses run in the foreground"),
    ("reasoning", (None,), "no reasoning effort or summary is applied; --reasoning-parser returns the reasoning"),
    ("include", (None, []), "no extra output data is available"),
    ("truncation", (None, "disabled"), "an input longer than the context is a 400"),
    ("conversation", (None,), "no conversation is stored"),
    ("prompt", (None,), "no prompt template is stored"),
)
# The chat fields whose Responses names differ, for the chat checks' 400s: (chat name, Responses name).
RENAMED_FIELDS = (
    (r"messages(\[\d+\]|\.\d+)?(\.\w+)*", "input"),
    (r"max_completion_tokens|max_tokens", "max_output_tokens"),
    (r"response_format\.json_schema\.schema", "text.format.schema"),
    (r"response_format(\.json_schema)?", "text.format"),
    (r"tools\.(\d+)\.function", r"tools.\1"),
    (r"tool_choice\.function", "tool_choice"),
)


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def _new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# --- request ------------------------------------------------------------------------------------

def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that answers `req` (one choice), validated as any chat request body is;
    400 naming the Responses field for anything either API rejects."""
    reject_unsupported(req, RESPONSES_UNSUPPORTED_FIELDS)
    body: dict[str, Any] = {"messages": _messages(req), "n": 1, "stream": req.stream}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    for name in ("model", "temperature", "top_p", "user", "parallel_tool_calls"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    if req.tools is not None:
        body["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                         for tool in req.tools]
    if req.tool_choice is not None:
        body["tool_choice"] = (req.tool_choice if isinstance(req.tool_choice, str)
                               else {"type": "function", "function": {"name": req.tool_choice.name}})
    if req.text is not None:
        body["response_format"] = _response_format(req.text.format)
    with responses_names():
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as error:
            raise from_validation_error(error) from error


def _messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """Chat messages: the instructions as a system message, then the input items in order; calls
    join the assistant message before them, and each call's output is a tool message.

    [user, message(assistant), function_call, function_call_output] -> [user, assistant(text, calls), tool]
    """
    messages: list[dict[str, Any]] = [] if req.instructions is None else [
        {"role": "system", "content": req.instructions}]
    if isinstance(req.input, str):
        return [*messages, {"role": "user", "content": req.input}]
    for item in req.input:
        if isinstance(item, InputFunctionCall):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, InputFunctionCallOutput):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        else:
            messages.append({"role": item.role, "content": _text(item.content)})
    return messages


def _text(content: str | list[InputText]) -> str:
    """A message's text; parts are joined by newlines, as chat joins its text parts."""
    return content if isinstance(content, str) else "\n".join(part.text for part in content)


def _response_format(text_format: TextFormat) -> dict[str, Any]:
    if isinstance(text_format, (FormatText, FormatJsonObject)):
        return {"type": text_format.type}
    json_schema = text_format.model_dump(exclude={"type"}, exclude_none=True, by_alias=True)
    return {"type": "json_schema", "json_schema": json_schema}


@contextmanager
def responses_names() -> Iterator[None]:
    """Re-raise a chat check's APIError with the Responses names of the fields it names."""
    try:
        yield
    except APIError as error:
        param = None if error.param is None else _renamed(error.param)
        raise APIError(error.status, _renamed(error.message), param, error.headers) from error


def _renamed(text: str) -> str:
    """
    >>> _renamed("messages.2.content"), _renamed("tools.0.function.parameters: bad")
    ('input', 'tools.0.parameters: bad')
    """
    for chat_name, name in RENAMED_FIELDS:
        text = re.sub(rf"\b(?:{chat_name})(?!\w)", name, text)
    return text


def prepare_response(ctx: ServingContext, req: ChatCompletionRequest) -> PreparedChat:
    """prepare_chat (render, tokenize, check; may compile a grammar), its 400s in Responses names."""
    with responses_names():
        return prepare_chat(ctx, req)


# --- response -----------------------------------------------------------------------------------

async def create_response(ctx: ServingContext, req: ResponsesRequest, prepared: PreparedChat,
                          admission: Admission) -> ResponsesResponse | AsyncIterator[bytes]:
    """Queue the request; return the Response object, or its server-sent events when streaming."""
    created_at = int(time.time())
    streams = admit(ctx, [prepared.prompt_token_ids], prepared.params, admission)
    if req.stream:
        writer = _EventWriter(ctx, req, admission.request_id)
        return sse_stream(writer.events(prepared, streams[0]), streams, error_event=writer.error, done_event=None)
    (output,) = await final_outputs(streams)
    chat = chat_response(_with_cached_tokens(ctx), prepared, output, admission.request_id)
    (choice,) = chat.choices
    message = choice.message
    status = _item_status(choice.finish_reason)
    items: list[OutputItem] = []
    if message.reasoning is not None:
        items.append(_reasoning_item(_new_item_id("rs"), message.reasoning, status))
    if message.content:
        items.append(_message_item(_new_item_id("msg"), message.content, status))
    items += [_call_item(_new_item_id("fc"), call.id, call.function.name, call.function.arguments)
              for call in message.tool_calls]
    return response_object(ctx, req, admission.request_id, created_at, items, choice.finish_reason, chat.usage)


def response_object(ctx: ServingContext, req: ResponsesRequest, response_id: str, created_at: int,
                    items: Sequence[OutputItem], finish_reason: str | None,
                    usage: Usage | None) -> ResponsesResponse:
    """The Response: in progress until `usage` is known, then completed, or incomplete when the
    answer was cut by max_output_tokens; the request's settings echoed."""
    status = "in_progress" if usage is None else "incomplete" if finish_reason == "length" else "completed"
    return ResponsesResponse(
        id=response_id, created_at=created_at, status=status, model=ctx.model_name, output=list(items),
        incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
        usage=None if usage is None else _usage(usage), instructions=req.instructions,
        max_output_tokens=req.max_output_tokens, parallel_tool_calls=bool(req.parallel_tool_calls),
        temperature=req.temperature, top_p=req.top_p,
        tool_choice=req.tool_choice if req.tool_choice is not None else "auto" if req.tools else "none",
        tools=req.tools or [], text=req.text or TextConfig(), metadata=req.metadata or {}, user=req.user)


def _with_cached_tokens(ctx: ServingContext) -> ServingContext:
    """The Responses API always reports the cached input tokens (as vLLM's does): the chat usage it
    is built from must carry them, whatever --enable-prompt-tokens-details says for chat."""
    return replace(ctx, with_prompt_tokens_details=True)


def _usage(usage: Usage) -> ResponseUsage:
    return ResponseUsage(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                         total_tokens=usage.total_tokens,
                         input_tokens_details=InputTokensDetails(cached_tokens=usage.prompt_tokens_details.cached_tokens))


def _item_status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _message_item(item_id: str, text: str | None, status: str) -> OutputMessage:
    """The assistant message; `text` None gives it no content part yet (a stream's first event)."""
    return OutputMessage(id=item_id, status=status, content=[] if text is None else [OutputText(text=text)])


def _reasoning_item(item_id: str, text: str | None, status: str) -> OutputReasoning:
    """The reasoning; `text` None gives it no content yet (a stream's first event)."""
    return OutputReasoning(id=item_id, status=status, content=[] if text is None else [ReasoningText(text=text)])


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> OutputFunctionCall:
    return OutputFunctionCall(id=item_id, call_id=call_id, name=name, arguments=arguments, status=status)


class _EventWriter:
    """The server-sent events of one streamed response, numbered from 0 in the order sent.

    created, in_progress, then the reasoning item (added, a reasoning text delta per chunk, text
    done, item done) if --reasoning-parser found reasoning, then the message item (added, content
    part added, a text delta per chunk, text done, part done, item done) if there is text, then
    each call's item (added, arguments delta, arguments done, item done), then completed or
    incomplete with the whole Response. Calls arrive whole from the chat path and are sent after
    the text, in the order the non-streamed output lists them."""

    def __init__(self, ctx: ServingContext, req: ResponsesRequest, response_id: str) -> None:
        self.ctx, self.req, self.response_id = ctx, req, response_id
        self.created_at = int(time.time())
        self.sequence_number = 0

    def event(self, event_type: type, **fields: Any) -> str:
        event = event_type(sequence_number=self.sequence_number, **fields)
        self.sequence_number += 1
        return f"event: {event.type}\ndata: {event.model_dump_json()}\n\n"

    def error(self, error: APIError) -> str:
        """A failure mid-stream: an `error` event (the chat error's type is its code)."""
        body = error.body()["error"]
        return self.event(ResponseErrorEvent, code=body["type"], message=body["message"], param=body["param"])

    def lifecycle(self, event_type: str, items: Sequence[Any] = (), finish_reason: str | None = None,
                  usage: Usage | None = None) -> str:
        response = response_object(self.ctx, self.req, self.response_id, self.created_at, items, finish_reason, usage)
        return self.event(ResponseLifecycleEvent, type=event_type, response=response)

    async def events(self, prepared: PreparedChat, stream: RequestStream) -> AsyncIterator[str]:
        yield self.lifecycle("response.created")
        yield self.lifecycle("response.in_progress")
        items: list[OutputItem] = []
        reasoning: OutputReasoning | None = None  # open while its text streams
        message: OutputMessage | None = None
        calls, finish_reason, usage = [], None, None
        async for chunk in chat_chunks(_with_cached_tokens(self.ctx), prepared, stream, self.response_id):
            usage = chunk.usage or usage
            for choice in chunk.choices:
                finish_reason = choice.finish_reason or finish_reason
                calls += choice.delta.tool_calls or []
                if choice.delta.reasoning:  # reasoning comes first: content only after its end tag
                    if reasoning is None:
                        reasoning = _reasoning_item(_new_item_id("rs"), "", "in_progress")
                        yield self.event(OutputItemEvent, type="response.output_item.added", output_index=0,
                                         item=_reasoning_item(reasoning.id, None, "in_progress"))
                    reasoning.content[0].text += choice.delta.reasoning
                    yield self.event(ReasoningTextDeltaEvent, item_id=reasoning.id, output_index=0,
                                     content_index=0, delta=choice.delta.reasoning)
                if not choice.delta.content:
                    continue
                if message is None:
                    if reasoning is not None and not items:
                        items.append(reasoning)
                        for event in self._reasoning_done(reasoning, "completed"):
                            yield event
                    message = _message_item(_new_item_id("msg"), "", "in_progress")
                    index = len(items)
                    yield self.event(OutputItemEvent, type="response.output_item.added", output_index=index,
                                     item=_message_item(message.id, None, "in_progress"))
                    yield self.event(ContentPartEvent, type="response.content_part.added", item_id=message.id,
                                     output_index=index, content_index=0, part=OutputText(text=""))
                message.content[0].text += choice.delta.content
                yield self.event(OutputTextDeltaEvent, item_id=message.id, output_index=len(items), content_index=0,
                                 delta=choice.delta.content)
        if usage is None:
            raise APIError(500, "the engine ended the request without an output")
        status = _item_status(finish_reason)
        if reasoning is not None and not items:
            items.append(reasoning)
            for event in self._reasoning_done(reasoning, status):
                yield event
        if message is not None:
            items.append(message.model_copy(update={"status": status}))
            for event in self._message_done(len(items) - 1, items[-1]):
                yield event
        for call in calls:
            items.append(_call_item(_new_item_id("fc"), call.id, call.function.name, call.function.arguments))
            for event in self._call_events(len(items) - 1, items[-1]):
                yield event
        done = "response.incomplete" if finish_reason == "length" else "response.completed"
        yield self.lifecycle(done, items, finish_reason, usage)

    def _reasoning_done(self, reasoning: OutputReasoning, status: str) -> Iterator[str]:
        reasoning.status = status
        yield self.event(ReasoningTextDoneEvent, item_id=reasoning.id, output_index=0, content_index=0,
                         text=reasoning.content[0].text)
        yield self.event(OutputItemEvent, type="response.output_item.done", output_index=0, item=reasoning)

    def _message_done(self, index: int, message: OutputMessage) -> Iterator[str]:
        part = message.content[0]
        yield self.event(OutputTextDoneEvent, item_id=message.id, output_index=index, content_index=0, text=part.text)
        yield self.event(ContentPartEvent, type="response.content_part.done", item_id=message.id,
                         output_index=index, content_index=0, part=part)
        yield self.event(OutputItemEvent, type="response.output_item.done", output_index=index, item=message)

    def _call_events(self, index: int, call: OutputFunctionCall) -> Iterator[str]:
        added = call.model_copy(update={"arguments": "", "status": "in_progress"})
        yield self.event(OutputItemEvent, type="response.output_item.added", output_index=index, item=added)
        yield self.event(ArgumentsDeltaEvent, item_id=call.id, output_index=index, delta=call.arguments)
        yield self.event(ArgumentsDoneEvent, item_id=call.id, output_index=index, arguments=call.arguments)
        yield self.event(OutputItemEvent, type="response.output_item.done", output_index=index, item=call)
