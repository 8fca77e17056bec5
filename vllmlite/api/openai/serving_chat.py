"""POST /v1/chat/completions: messages through the model's chat template, assistant messages out.

Owns the chat rules: `tools` and `tool_choice` (the format is api/tool_calls.py's, rendering
chat_rendering.py's), `max_completion_tokens`, the role-first streaming deltas (one choice per
chunk), OpenAI's chat logprobs format and vLLM's `prompt_logprobs` and `return_token_ids`. Knows
nothing of routes or middleware.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from vllmlite.api.errors import bad_request
from vllmlite.api.openai.chat_rendering import render_messages
from vllmlite.api.openai.constraints import as_bad_request, make_constraint, request_constraint
from vllmlite.api.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprob,
    Usage,
)
from vllmlite.api.openai.protocol_tools import FunctionCallDelta, NamedToolChoice, ToolCallDelta
from vllmlite.api.openai.reasoning import ReasoningFormat, ReasoningParser, split_reasoning
from vllmlite.api.openai.serving import (
    Admission,
    ServingContext,
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
    right_truncated,
    running_usage,
    sampling_params,
    sse_event,
    sse_stream,
    token_bytes,
    top_items,
)
from vllmlite.api.openai.tool_calls import ToolCallParser, forced_call_grammar
from vllmlite.engine.request_stream import RequestStream
from vllmlite.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from vllmlite.sampling_params import SamplingParams

TEMPLATE_AS_IS = "the model's chat template is rendered as it is"
# Chat fields this server does not implement, checked after serving.UNSUPPORTED_FIELDS.
LEGACY_FUNCTIONS = "use tools and tool_choice, their current names"
CHAT_UNSUPPORTED_FIELDS = (
    ("use_beam_search", (None, False), "beam search is served by /v1/completions"),
    ("functions", (None, []), LEGACY_FUNCTIONS),
    ("function_call", (None, "none"), LEGACY_FUNCTIONS),
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
    reasoning: ReasoningFormat | None = None  # --reasoning-parser's format, when the answer is split

    def new_parser(self) -> ToolCallParser | None:
        """A parser of one choice's content into text and tool calls; None without tools."""
        if self.tool_names is None:
            return None
        return ToolCallParser(self.tool_names, max_calls=None if self.request.parallel_tool_calls else 1)

    def new_reasoning_parser(self) -> ReasoningParser | None:
        """A parser of one choice's text into reasoning and content; None without --reasoning-parser."""
        if self.reasoning is None:
            return None
        return ReasoningParser(self.reasoning, self.request.chat_template_kwargs)


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
    token_ids = render_messages(ctx, req.messages, req.add_generation_prompt, bool(req.add_special_tokens), tools,
                                req.chat_template_kwargs)
    token_ids = right_truncated(token_ids, req)
    check_request(ctx, req, token_ids, params, "messages" if found is None else found[0])
    tool_names = [t.function.name for t in tools] if tools else None
    if ctx.reasoning is not None and ctx.reasoning.is_special_in(ctx.engine.tokenizer):
        params.skip_special_tokens = False
    return PreparedChat(req, token_ids, params, tool_names, ctx.reasoning)


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
                                  finish_reason=finish_reason, stop_reason=completion.stop_reason,
                                  token_ids=list(completion.token_ids) if req.return_token_ids else None))
    return ChatCompletionResponse(id=request_id, model=ctx.model_name, choices=choices,
                                  usage=make_usage([output], ctx.with_prompt_tokens_details),
                                  prompt_logprobs=prompt_logprobs_payload(output, req.prompt_logprobs),
                                  prompt_token_ids=list(output.prompt_token_ids) if req.return_token_ids else None)


def _message(prepared: PreparedChat, completion: CompletionOutput) -> tuple[ChatResponseMessage, str | None]:
    """The assistant message of one choice, and its finish reason ("tool_calls" if it made calls).
    Content is null when the answer is only calls, or only reasoning (as vLLM sends it)."""
    reasoning, text = None, completion.text
    if prepared.reasoning is not None:
        reasoning, text = split_reasoning(prepared.reasoning, text, prepared.request.chat_template_kwargs)
    parser = prepared.new_parser()
    content, calls = text, []
    if parser is not None:
        head, tail = parser.feed(text), parser.finish()
        content, calls = head.content + tail.content, head.calls + tail.calls
    has_other = bool(calls) or reasoning is not None
    message = ChatResponseMessage(content=content if content or not has_other else None, tool_calls=calls,
                                  reasoning=reasoning)
    return message, _finish_reason(completion.finish_reason, len(calls))


def _finish_reason(reason: str | None, num_calls: int) -> str | None:
    return "tool_calls" if num_calls and reason == "stop" else reason


@dataclass
class _ChoiceStream:
    """One choice's progress in a stream."""

    parser: ToolCallParser | None
    reasoning: ReasoningParser | None
    num_calls: int = 0
    is_finished: bool = False


async def chat_chunks(ctx: ServingContext, prepared: PreparedChat, stream: RequestStream,
                      request_id: str) -> AsyncIterator[ChatCompletionChunk]:
    """The stream's chunks, one choice in each (as OpenAI and vLLM send them): each choice's role
    first (with the prompt's token ids under return_token_ids), then its deltas, then the usage if
    asked. Under continuous_usage_stats a chunk carries its choice's usage so far."""
    req = prepared.request
    created = int(time.time())

    def chunk(choice: ChatStreamChoice | None, usage: Usage | None = None, **extra: Any) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=request_id, created=created, model=ctx.model_name,
                                   choices=[] if choice is None else [choice], usage=usage, **extra)

    num_prompt = num_prompt_tokens(prepared.prompt_token_ids, prepared.params)
    prompt_ids = prepared.prompt_token_ids[len(prepared.prompt_token_ids) - num_prompt:]
    for index in range(req.n):
        yield chunk(ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content="")),
                    running_usage(num_prompt, 0) if req.continuous_usage else None,
                    prompt_token_ids=prompt_ids if req.return_token_ids else None)
    states = [_ChoiceStream(prepared.new_parser(), prepared.new_reasoning_parser()) for _ in range(req.n)]
    last: RequestOutput | None = None
    async for last in stream:
        raise_if_failed(last)
        for completion in last.outputs:
            choice = _delta_choice(req, completion, states[completion.index])
            if choice is not None:
                yield chunk(choice, running_usage(len(last.prompt_token_ids), len(completion.token_ids))
                            if req.continuous_usage else None)
    if req.include_usage and last is not None:
        yield chunk(None, make_usage([last], ctx.with_prompt_tokens_details))


def _delta_choice(req: ChatCompletionRequest, completion: CompletionOutput,
                  state: _ChoiceStream) -> ChatStreamChoice | None:
    """The chunk for what is new in one choice; None when nothing is (another sample moved)."""
    if state.is_finished:
        return None
    text, calls, reasoning = completion.delta_text, [], ""
    if state.reasoning is not None:  # the reasoning parser first: calls are read in the content only
        split = state.reasoning.feed(text)
        if completion.finish_reason is not None:
            rest = state.reasoning.finish()
            split.reasoning, split.content = split.reasoning + rest.reasoning, split.content + rest.content
        reasoning, text = split.reasoning, split.content
    if state.parser is not None:
        parsed = state.parser.feed(text)
        if completion.finish_reason is not None:
            rest = state.parser.finish()
            parsed.content, parsed.calls = parsed.content + rest.content, parsed.calls + rest.calls
        text, calls = parsed.content, parsed.calls
    has_tokens = (req.logprobs or bool(req.return_token_ids)) and bool(completion.delta_token_ids)
    if not text and not calls and not reasoning and not has_tokens and completion.finish_reason is None:
        return None  # e.g. a token holding half a UTF-8 character: its text comes with the next one
    state.is_finished = completion.finish_reason is not None
    tool_deltas = [ToolCallDelta(index=state.num_calls + i, id=call.id, type="function",
                                 function=FunctionCallDelta(name=call.function.name,
                                                            arguments=call.function.arguments))
                   for i, call in enumerate(calls)]
    state.num_calls += len(calls)
    logprobs = _logprobs(req, completion.delta_token_ids, completion.delta_logprobs) if req.logprobs else None
    delta = DeltaMessage(content=text or None, reasoning=reasoning or None, tool_calls=tool_deltas or None)
    return ChatStreamChoice(index=completion.index, delta=delta, logprobs=logprobs,
                            finish_reason=_finish_reason(completion.finish_reason, state.num_calls),
                            stop_reason=completion.stop_reason,
                            token_ids=list(completion.delta_token_ids) if req.return_token_ids else None)


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
