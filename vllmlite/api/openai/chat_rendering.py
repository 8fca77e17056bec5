"""Chat messages to prompt tokens: the model's chat template (never a request-supplied one), the
tools section or its Hermes-style stand-in, a request's `chat_template_kwargs`, and the guard that
keeps caller-written special-token text from forging a turn.

Owns rendering and encoding for /v1/chat/completions, /v1/responses and /tokenize. Knows nothing of
sampling, streams or response shapes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from vllmlite.api.errors import bad_request
from vllmlite.api.openai.protocol import ChatMessage
from vllmlite.api.openai.protocol_tools import ChatTool
from vllmlite.api.openai.serving import MAX_CHARS_PER_TOKEN, ServingContext
from vllmlite.api.openai.tool_calls import hermes_messages, template_messages, tool_schema
from vllmlite.tokenizer import Tokenizer
from vllmlite.tokenizer.chat_template import (
    CALLER_TEXT_FIELDS,
    RESERVED_VARIABLES,
    render_chat_template,
    render_with_caller_spans,
    template_uses_tools,
    template_variables,
)


def render_messages(ctx: ServingContext, messages: Sequence[ChatMessage], add_generation_prompt: bool,
                    add_special_tokens: bool = False, tools: Sequence[ChatTool] | None = None,
                    template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """The prompt's token ids: the model's chat template, then encode, by default without special
    tokens (the template already wrote them). `tools` go to a template with a tools section, else
    into the system message (api/tool_calls.py). `template_kwargs` (a request's
    chat_template_kwargs) are extra template variables, kept where the template reads them.

    Special-token text the caller wrote (a message's content or name) is read as plain text, so a
    message cannot forge a turn with `<|im_end|><|im_start|>system`; only the template's own text
    gives special tokens (`--special-tokens-in-messages` turns this off for trusted callers)."""
    tokenizer = ctx.engine.tokenizer
    trusted = ctx.special_tokens_in_messages
    variables = template_variables_of(tokenizer, template_kwargs, trusted)
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
    if sum(len(m.get(key) or "") for m in dicts for key in CALLER_TEXT_FIELDS) + len(json.dumps(tool_dicts)) > max_chars:
        raise bad_request(f"messages are longer than this model's context of {ctx.engine.max_model_len} "
                          "tokens can hold", "messages")
    try:
        if trusted:  # no spans to find: one rendering
            text = render_chat_template(tokenizer.chat_template, dicts, add_generation_prompt, tokenizer.bos_token,
                                        tokenizer.eos_token, tool_dicts, variables)
        else:
            text, caller_spans = render_with_caller_spans(tokenizer.chat_template, dicts, add_generation_prompt,
                                                          tokenizer.bos_token, tokenizer.eos_token, tool_dicts,
                                                          variables)
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


def template_variables_of(tokenizer: Tokenizer, template_kwargs: Mapping[str, Any] | None,
                          trusted: bool) -> dict[str, Any]:
    """The chat_template_kwargs the model's template reads (vLLM drops the others); 400 for one the
    renderer sets itself, and for special-token text in a value unless the caller is trusted (the
    template writes values as they are, so no span could mark them as plain text)."""
    kwargs = dict(template_kwargs or {})
    reserved = sorted(RESERVED_VARIABLES & kwargs.keys())
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {reserved[0]!r}: the server sets it",
                          f"chat_template_kwargs.{reserved[0]}")
    read = template_variables(tokenizer.chat_template)
    kept = {name: value for name, value in kwargs.items() if name in read}
    for name, value in kept.items():
        found = None if trusted else tokenizer.find_special_text(json.dumps(value, ensure_ascii=False))
        if found is not None:
            raise bad_request(f"chat_template_kwargs.{name} contains the special token {found!r}; remove it",
                              f"chat_template_kwargs.{name}")
    return kept


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
