"""Chat templates: validate OpenAI-style messages and render a model's jinja template to a prompt.

Renders exactly as HF `apply_chat_template(..., tokenize=False)` does, inside jinja2's immutable
sandbox. Knows nothing of tokenizers or models: the caller passes the template and token strings.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Used when a model ships no template (vLLM and HF fall back to ChatML too).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

VALID_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
# The names a message's reasoning goes by (vLLM's `reasoning`, DeepSeek's `reasoning_content`,
# gpt-oss's `thinking`); the first one set wins, as in transformers.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# What the renderer itself gives every template: extra variables (a request's chat_template_kwargs,
# HF's **kwargs) may not replace them.
RESERVED_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                                "chat_template", "tokenize"})


def normalize_messages(messages: Any) -> list[dict]:
    """Validated copies of `messages` whose `content` is always a string.

    Content may be a string, a list of `{"type": "text", "text": ...}` parts (joined with "\\n"),
    or None/absent for an assistant message (e.g. one carrying tool_calls), which becomes "".
    Other keys (name, tool_calls, tool_call_id, reasoning, ...) pass through. Raises ValueError
    naming the message index and the problem: unknown role, non-text part type, non-string content.

    >>> parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    >>> normalize_messages([{"role": "user", "content": parts}])
    [{'role': 'user', 'content': 'a\\nb'}]
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    return [_normalize_message(index, message) for index, message in enumerate(messages)]


def _normalize_message(index: int, message: Any) -> dict:
    if not isinstance(message, dict):
        raise ValueError(f"messages[{index}] must be an object, got {type(message).__name__}")
    role = message.get("role")
    if role not in VALID_ROLES:
        raise ValueError(f"messages[{index}].role {role!r} is not one of {sorted(VALID_ROLES)}")
    content = message.get("content")
    if content is None and role == "assistant":
        content = ""
    elif isinstance(content, list):
        content = "\n".join(_part_text(index, part) for part in content)
    elif not isinstance(content, str):
        raise ValueError(
            f"messages[{index}].content must be a string or a list of text parts, got {type(content).__name__}"
        )
    return {**message, "content": content}


def _with_reasoning_aliases(message: dict) -> dict:
    """An assistant's reasoning, given under any of REASONING_FIELDS, also under `reasoning_content`
    and `thinking`, the names templates read (as transformers does)."""
    reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _part_text(index: int, part: Any) -> str:
    part_type = part.get("type") if isinstance(part, dict) else type(part).__name__
    if part_type != "text":
        raise ValueError(f"messages[{index}].content part type {part_type!r} is not supported (only 'text')")
    text = part.get("text")
    if not isinstance(text, str):
        raise ValueError(f"messages[{index}].content text part must have a string 'text'")
    return text


def render_chat_template(
    template: str | None,
    messages: list[dict],
    add_generation_prompt: bool,
    bos_token: str | None,
    eos_token: str | None,
    tools: list[dict] | None = None,
    variables: Mapping[str, Any] | None = None,
) -> str:
    """The prompt text for `messages` (and `tools`, for a template with a tools section) under
    `template` (ChatML when None); `variables` are extra ones the template may read (Qwen3's
    `enable_thinking`), never one of RESERVED_VARIABLES.

    Messages are normalized first (see `normalize_messages`). Raises ValueError when the template
    is not valid jinja, calls `raise_exception`, or is stopped by the sandbox.
    """
    variables = dict(variables or {})
    reserved = sorted(RESERVED_VARIABLES & variables.keys())
    if reserved:
        raise ValueError(f"the chat template variable {reserved[0]!r} is set by the renderer; it cannot be given")
    compiled = _compile(template if template is not None else CHATML_TEMPLATE)
    try:
        return compiled.render(
            **variables,
            messages=[_with_reasoning_aliases(m) for m in normalize_messages(messages)],
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token or "",
            eos_token=eos_token or "",
        )
    except (jinja2.TemplateError, TypeError, KeyError, IndexError, ValueError) as error:
        # TemplateError covers raise_exception, SecurityError and UndefinedError; the others come
        # from template expressions on unexpected message data, such as `'a' + 1`.
        raise ValueError(f"chat template failed to render: {error}") from error


# The message fields a template may write into the prompt that come from the caller.
CALLER_TEXT_FIELDS = ("content", "name", *REASONING_FIELDS)


def render_with_caller_spans(
    template: str | None,
    messages: list[dict],
    add_generation_prompt: bool,
    bos_token: str | None,
    eos_token: str | None,
    tools: list[dict] | None = None,
    variables: Mapping[str, Any] | None = None,
) -> tuple[str, list[tuple[int, int]] | None]:
    """The prompt text, as `render_chat_template` gives it, and the (start, end) spans in it of every
    caller-written field (`CALLER_TEXT_FIELDS`), so a tokenizer can read them as plain text.

    Found by rendering a second time with a unique marker in place of each field: the spans are
    exact when putting the fields back into that rendering gives the prompt itself. A template that
    changes what it writes (trims it, splits it, branches on it) gives None: the spans are unknown.
    """
    text = render_chat_template(template, messages, add_generation_prompt, bos_token, eos_token, tools, variables)
    nonce = uuid.uuid4().hex
    marked, values = [], {}
    for index, message in enumerate(normalize_messages(messages)):
        copy = dict(message)
        for key in CALLER_TEXT_FIELDS:
            if isinstance(copy.get(key), str) and copy[key]:
                marker = f"\ue000{nonce}:{index}:{key}\ue001"
                values[marker] = copy[key]
                copy[key] = marker
        marked.append(copy)
    if not values:
        return text, []
    skeleton = render_chat_template(template, marked, add_generation_prompt, bos_token, eos_token, tools, variables)
    pattern = "|".join(re.escape(marker) for marker in values)
    pieces, spans, position, last = [], [], 0, 0
    for match in re.finditer(pattern, skeleton):
        literal = skeleton[last:match.start()]
        value = values[match.group()]
        pieces += [literal, value]
        position += len(literal)
        spans.append((position, position + len(value)))
        position += len(value)
        last = match.end()
    pieces.append(skeleton[last:])
    return text, (spans if "".join(pieces) == text else None)


def template_uses_tools(template: str | None) -> bool:
    """Whether `template` reads a `tools` variable (it has a tools section of its own)."""
    return "tools" in template_variables(template)


@lru_cache(maxsize=32)
def template_variables(template: str | None) -> frozenset[str]:
    """The variables `template` (ChatML when None) reads from its caller.

    >>> sorted(template_variables("{{ bos_token }}{% if enable_thinking %}<think>{% endif %}"))
    ['bos_token', 'enable_thinking']
    """
    text = template if template is not None else CHATML_TEMPLATE
    env = _compile(text).environment
    return frozenset(jinja2.meta.find_undeclared_variables(env.parse(text)))


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    """Compile once per distinct template string, with the environment HF uses."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(f"chat template is not valid jinja (line {error.lineno}): {error.message}") from error


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters; HF's does not, so neither do we.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)` without the dict type itself, whose attributes would
    reach Python internals (transformers gives templates the same)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict:
        return dict.fromkeys(*args)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's `namespace`, refusing underscore-prefixed names, so `{% set ns.__class__ = ... %}`
    cannot shadow its internals (transformers' rule)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's signature trick: `namespace(self=1)` works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_namespace_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"a template may not store {name!r} on a namespace")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (HF uses it to mark assistant
    tokens for training masks; generation needs only the text)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()
