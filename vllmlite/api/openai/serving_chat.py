"""POST /v1/chat/completions: messages through the model's chat template, assistant messages out.

Owns the chat rules: rendering (never a request-supplied template), `tools` and `tool_choice` (the
format is api/tool_calls.py's), `max_completion_tokens`, the role-first streaming deltas, OpenAI's
chat logprobs format and vLLM's response-level `prompt_logprobs`. Knows nothing of routes or
middleware.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from vllmlite.api.errors import bad_request
from vllmlite.api.openai.constraints import as_bad_request, make_constraint, request_constraint
from vllmlite.api.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprob,
)
from vllmlite.api.openai.protocol_tools import ChatTool, FunctionCallDelta, NamedToolChoice, ToolCallDelta
from vllmlite.api.openai.serving import (
    MAX_CHARS_PER_TOKEN,
    Admission,
    ServingContext,
    StreamUsage,
    admit,
    check_grammar,
    check_model,
    check_request,
    check_stream_fields,
    clamp_logprob,
    final_outputs,
    logprob_token,
    make_usage,
    num_prompt_tokens,
    prompt_logprobs_payload,
    raise_if_failed,
    reject_unsupported,
    sampling_params,
    sse_event,
    sse_stream,
    token_bytes,
    top_items,
)
from vllmlite.api.openai.tool_calls import (
    ToolCallParser,
    forced_call_grammar,
    hermes_messages,
    template_messages,
    tool_schema,
)
from vllmlite.engine.request_stream import RequestStream
from vllmlite.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from vllmlite.sampling_params import SamplingParams
from vllmlite.tokenizer import Tokenizer
from vllmlite.tokenizer.chat_template import CALLER_TEXT_FIELDS, render_with_caller_spans, template_uses_tools

TEMPLATE_AS_IS = "the model's chat template is rendered as it is"
# Chat fields this server does not implement, checked after serving.UNSUPPORTED_FIELDS.
LEGACY_FUNCTIONS = "use tools and tool_choice, their current names"
CHAT_UNSUPPORTED_FIELDS = (
    ("functions", (None, []), LEGACY_FUNCTIONS),
    ("function_call", (None, "none"), LEGACY_FUNCTIONS),
    ("chat_template_kwargs", (None, {}), TEMPLATE_AS_IS),
    ("continue_final_message", (None, False), TEMPLATE_AS_IS),
    ("documents", (None, []), TEMPLATE_AS_IS),
    ("echo", (None, False), "echo is served by /v1/completions"),
    ("audio", (None,), "text output only"),
    ("modalities", (None, ["text"]), "text output only"),
    ("web_search_options", (None,), "no web search"),
)


@dataclass
class PreparedChat:
    request: ChatCompletionRequest
    prompt_token_ids: list[int]
    params: SamplingParams
    tool_names: list[str] | None = None  # the declared tools, when the answer is parsed for calls

    def new_parser(self) -> ToolCallParser | None:
        """A parser of one choice's text into content and tool calls; None without tools."""
        if self.tool_names is None:
            return None
        return ToolCallParser(self.tool_names, max_calls=None if self.request.parallel_tool_calls else 1)


def render_messages(ctx: ServingContext, messages: Sequence[ChatMessage], add_generation_prompt: bool,
                    add_special_tokens: bool = False, tools: Sequence[ChatTool] | None = None) -> list[int]:
    """The prompt's token ids: the model's chat template, then encode, by default without special
    tokens (the template already wrote them). `tools` go to a template with a tools section, else
    into the system message (api/tool_calls.py).

    Special-token text the caller wrote (a message's content or name) is read as plain text, so a
    message cannot forge a turn with `<|im_end|><|im_start|>system`; only the template's own text
    gives special tokens (`--special-tokens-in-messages` turns this off for trusted callers)."""
    tokenizer = ctx.engine.tokenizer
    trusted = ctx.special_tokens_in_messages
    dicts = [m.as_dict() for m in messages]
    tool_dicts = None
    if template_uses_tools(tokenizer.chat_template):
        dicts = template_messages(dicts)
        tool_dicts = [tool_schema(t) for t in tools] if tools else None
        if not trusted:  # the template writes these itself: no span marks them as plain text
            _reject_special_text_in_tools(tokenizer, messages, tools)
    elif tools or any(m.role == "tool" or m.tool_calls for m in messages):
        dicts = hermes_messages(dicts, tools)
    max_chars = ctx.engine.max_model_len * MAX_CHARS_PER_TOKEN
    if sum(len(m["content"]) for m in dicts) + len(json.dumps(tool_dicts)) > max_chars:
        raise bad_request(f"messages are longer than this model's context of {ctx.engine.max_model_len} "
                          "tokens can hold", "messages")
    try:
        if trusted:  # no spans to find: one rendering
            text = tokenizer.apply_chat_template(dicts, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                 tools=tool_dicts)
        else:
            text, caller_spans = render_with_caller_spans(tokenizer.chat_template, dicts, add_generation_prompt,
                                                          tokenizer.bos_token, tokenizer.eos_token, tool_dicts)
    except ValueError as error:
        raise bad_request(str(error), "messages") from error
    if len(text) > max_chars:
        raise bad_request(f"the rendered messages have {len(text)} characters, more than this model's context "
                          f"of {ctx.engine.max_model_len} tokens can hold", "messages")
    if trusted:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    if caller_spans is None:
        _reject_special_text(tokenizer, dicts)  # the template reworks the fields: no span is known
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return tokenizer.encode_with_plain_spans(text, caller_spans, add_special_tokens)


def _reject_special_text(tokenizer: Tokenizer, messages: list[dict]) -> None:
    for index, message in enumerate(messages):
        for key in CALLER_TEXT_FIELDS:
            found = tokenizer.find_special_text(message.get(key) or "")
            if found is not None:
                raise bad_request(
                    f"messages[{index}].{key} contains the special token {found!r}, and this model's chat "
                    "template changes message text, so it cannot be kept as plain text; remove it",
                    f"messages.{index}.{key}")


def _reject_special_text_in_tools(tokenizer: Tokenizer, messages: Sequence[ChatMessage],
                                  tools: Sequence[ChatTool] | None) -> None:
    """A 400 if a tool definition or a past call holds special-token text: a template with a tools
    section writes them as they are, so they could forge a turn."""
    fields = [(f"tools.{i}", json.dumps(tool_schema(t), ensure_ascii=False)) for i, t in enumerate(tools or ())]
    fields += [(f"messages.{i}.tool_calls", json.dumps([c.model_dump() for c in m.tool_calls], ensure_ascii=False))
               for i, m in enumerate(messages) if m.tool_calls]
    for param, text in fields:
        found = tokenizer.find_special_text(text)
        if found is not None:
            raise bad_request(f"{param} contains the special token {found!r}; remove it", param)


def prepare_chat(ctx: ServingContext, req: ChatCompletionRequest) -> PreparedChat:
    """Validate, render and tokenize; raise APIError (400/404) before anything is queued. May take
    a while for a large schema (it is compiled once to check it): run it off the event loop then."""
    check_model(ctx, req.model)
    _reject_unsupported(req)
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    choice = _tool_choice(req)
    found = request_constraint(req)
    if choice not in ("none", "auto"):
        if found is not None:
            raise bad_request(f"tool_choice {_choice_name(choice)!r} and {found[0]} each constrain the output; "
                              "use one of them", found[0])
        try:
            found = ("tool_choice", forced_call_grammar(req.tools, choice, bool(req.parallel_tool_calls)))
        except ValueError as error:
            raise as_bad_request(error, "tools") from error
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = sampling_params(req, max_tokens=max_tokens, prompt_logprobs=req.prompt_logprobs,
                             logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                             structured_outputs=None if found is None else found[1])
    check_grammar(ctx, found)
    tools = req.tools if choice != "none" else None
    token_ids = render_messages(ctx, req.messages, req.add_generation_prompt, bool(req.add_special_tokens), tools)
    check_request(ctx, req, token_ids, params, "messages" if found is None else found[0])
    tool_names = [t.function.name for t in tools] if tools else None
    return PreparedChat(req, token_ids, params, tool_names)


def _tool_choice(req: ChatCompletionRequest) -> str | NamedToolChoice:
    """The effective tool_choice ("auto" with tools, "none" without, as OpenAI defaults it), after
    checking it names a declared tool and every tool's parameters are a valid JSON schema."""
    tools = req.tools or []
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools must have distinct function names", "tools")
    for i, tool in enumerate(tools):
        if tool.function.parameters is not None:
            make_constraint(f"tools.{i}.function.parameters", json=tool.function.parameters)
    if req.tool_choice is None:
        return "auto" if tools else "none"
    if not tools and req.tool_choice != "none":
        raise bad_request(f"tool_choice {_choice_name(req.tool_choice)!r} needs tools", "tool_choice")
    if isinstance(req.tool_choice, NamedToolChoice) and req.tool_choice.function.name not in names:
        raise bad_request(f"tool_choice names the function {req.tool_choice.function.name!r}, which is not "
                          "among tools", "tool_choice.function.name")
    return req.tool_choice


def _choice_name(choice: str | NamedToolChoice) -> str:
    return choice.function.name if isinstance(choice, NamedToolChoice) else choice


def _reject_unsupported(req: ChatCompletionRequest) -> None:
    if req.chat_template is not None:
        raise bad_request("chat_template: request-supplied chat templates are never rendered; the model's "
                          "own template is used", "chat_template")
    reject_unsupported(req)
    reject_unsupported(req, CHAT_UNSUPPORTED_FIELDS)
    check_stream_fields(req)


async def create_chat(ctx: ServingContext, prepared: PreparedChat,
                      admission: Admission) -> ChatCompletionResponse | AsyncIterator[str]:
    """Queue the conversation; return the whole response, or the SSE events when streaming."""
    streams = admit(ctx, [prepared.prompt_token_ids], prepared.params, admission)
    if prepared.request.stream:
        events = (sse_event(chunk) async for chunk in chat_chunks(ctx, prepared, streams[0], admission.request_id))
        return sse_stream(events, streams)
    (output,) = await final_outputs(streams)
    return chat_response(ctx, prepared, output, admission.request_id)


def chat_response(ctx: ServingContext, prepared: PreparedChat, output: RequestOutput,
                  request_id: str) -> ChatCompletionResponse:
    """The whole answer of a finished request."""
    req = prepared.request
    choices = []
    for completion in sorted(output.outputs, key=lambda c: c.index):
        message, finish_reason = _message(prepared, completion)
        choices.append(ChatChoice(index=completion.index, message=message,
                                  logprobs=_logprobs(req, completion.token_ids, completion.logprobs)
                                  if req.logprobs else None,
                                  finish_reason=finish_reason, stop_reason=completion.stop_reason))
    return ChatCompletionResponse(id=request_id, model=ctx.model_name, choices=choices,
                                  usage=make_usage([output]),
                                  prompt_logprobs=prompt_logprobs_payload(output, req.prompt_logprobs))


def _message(prepared: PreparedChat, completion: CompletionOutput) -> tuple[ChatResponseMessage, str | None]:
    """The assistant message of one choice, and its finish reason ("tool_calls" if it made calls)."""
    parser = prepared.new_parser()
    if parser is None:
        return ChatResponseMessage(content=completion.text), completion.finish_reason
    head, tail = parser.feed(completion.text), parser.finish()
    content, calls = head.content + tail.content, head.calls + tail.calls
    message = ChatResponseMessage(content=content if content or not calls else None, tool_calls=calls)
    return message, _finish_reason(completion.finish_reason, len(calls))


def _finish_reason(reason: str | None, num_calls: int) -> str | None:
    return "tool_calls" if num_calls and reason == "stop" else reason


@dataclass
class _ChoiceStream:
    """One choice's progress in a stream."""

    parser: ToolCallParser | None
    num_calls: int = 0
    is_finished: bool = False


async def chat_chunks(ctx: ServingContext, prepared: PreparedChat, stream: RequestStream,
                      request_id: str) -> AsyncIterator[ChatCompletionChunk]:
    """The stream's chunks: each choice's role first, then its deltas, then the usage if asked."""
    req = prepared.request
    created = int(time.time())
    counts = StreamUsage(num_prompt_tokens(prepared.prompt_token_ids, prepared.params))

    def chunk(choices: list[ChatStreamChoice], **extra: Any) -> ChatCompletionChunk:
        usage = counts.usage() if req.continuous_usage else None
        return ChatCompletionChunk(id=request_id, created=created, model=ctx.model_name,
                                   choices=choices, **{"usage": usage, **extra})

    for index in range(req.n):
        yield chunk([ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
    states = [_ChoiceStream(prepared.new_parser()) for _ in range(req.n)]
    last: RequestOutput | None = None
    async for last in stream:
        raise_if_failed(last)
        counts.update(0, last, first_choice=0)
        choices = [choice for completion in last.outputs
                   if (choice := _delta_choice(req, completion, states[completion.index])) is not None]
        if choices:
            yield chunk(choices)
    if req.include_usage and last is not None:
        yield chunk([], usage=make_usage([last]))


def _delta_choice(req: ChatCompletionRequest, completion: CompletionOutput,
                  state: _ChoiceStream) -> ChatStreamChoice | None:
    """The chunk for what is new in one choice; None when nothing is (another sample moved)."""
    if state.is_finished:
        return None
    text, calls = completion.delta_text, []
    if state.parser is not None:
        parsed = state.parser.feed(text)
        if completion.finish_reason is not None:
            rest = state.parser.finish()
            parsed.content, parsed.calls = parsed.content + rest.content, parsed.calls + rest.calls
        text, calls = parsed.content, parsed.calls
    has_logprobs = req.logprobs and bool(completion.delta_token_ids)
    if not text and not calls and not has_logprobs and completion.finish_reason is None:
        return None  # e.g. a token holding half a UTF-8 character: its text comes with the next one
    state.is_finished = completion.finish_reason is not None
    tool_deltas = [ToolCallDelta(index=state.num_calls + i, id=call.id, type="function",
                                 function=FunctionCallDelta(name=call.function.name,
                                                            arguments=call.function.arguments))
                   for i, call in enumerate(calls)]
    state.num_calls += len(calls)
    logprobs = _logprobs(req, completion.delta_token_ids, completion.delta_logprobs) if req.logprobs else None
    delta = DeltaMessage(content=text or None, tool_calls=tool_deltas or None)
    return ChatStreamChoice(index=completion.index, delta=delta, logprobs=logprobs,
                            finish_reason=_finish_reason(completion.finish_reason, state.num_calls),
                            stop_reason=completion.stop_reason)


def _logprobs(req: ChatCompletionRequest, token_ids: Sequence[int],
              logprobs: Sequence[PositionLogprobs] | None) -> ChatLogprobs:
    """OpenAI's chat logprobs: one entry per token with its bytes and its `top_logprobs` best
    alternatives; `token` reads `token_id:123` with return_tokens_as_token_ids (bytes stay the
    token's own)."""
    def entry(token_id: int, logprob: Logprob) -> TopLogprob:   # decoded_token is the tokenizer's token_text
        text = logprob.decoded_token
        return TopLogprob(token=logprob_token(text, token_id, req.return_tokens_as_token_ids),
                          logprob=clamp_logprob(logprob.logprob), bytes=token_bytes(text))

    content = []
    for token_id, position in zip(token_ids, logprobs or ()):
        sampled = entry(token_id, position[token_id])
        top = [entry(i, candidate) for i, candidate in top_items(position, req.top_logprobs or 0)]
        content.append(ChatTokenLogprob(**sampled.model_dump(), top_logprobs=top))
    return ChatLogprobs(content=content)
