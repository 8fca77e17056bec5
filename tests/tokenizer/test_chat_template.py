"""Chat templates render as HF apply_chat_template does, validate messages, and stay sandboxed."""

from __future__ import annotations

import json

import pytest
from conftest import skip_unless_ci
from paths import GOLDENS

from vllmlite.tokenizer.chat_template import (
    CHATML_TEMPLATE,
    _compile,
    normalize_messages,
    render_chat_template,
    render_with_caller_spans,
)

GOLDENS = GOLDENS / "smollm2_tokenizer.json"

# SmolLM2-135M-Instruct's tokenizer.chat_template, as stored in its GGUF.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
DEFAULT_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
USER_HI = [{"role": "user", "content": "hi"}]


def render(template, messages, add_generation_prompt=True):
    return render_chat_template(template, messages, add_generation_prompt, bos_token="<s>", eos_token="</s>")


# ---- SmolLM2: outputs taken from transformers' apply_chat_template(tokenize=False) ----

@pytest.mark.parametrize("messages, add_generation_prompt, expected", [
    (USER_HI, True, DEFAULT_SYSTEM + "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"),
    (USER_HI, False, DEFAULT_SYSTEM + "<|im_start|>user\nhi<|im_end|>\n"),
    ([{"role": "system", "content": "S"}, *USER_HI], True,
     "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"),
    ([*USER_HI, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "again"}], True,
     DEFAULT_SYSTEM + "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"
     "<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"),
])
def test_smollm2_template_equals_transformers(messages, add_generation_prompt, expected):
    assert render(SMOLLM2_TEMPLATE, messages, add_generation_prompt) == expected


def test_smollm2_template_equals_goldens():
    # test_tokenizer checks the same goldens through the template read from the GGUF.
    if not GOLDENS.exists():
        skip_unless_ci(f"{GOLDENS} not generated yet")
    cases = json.loads(GOLDENS.read_text(encoding="utf-8"))["chat"]
    mismatches = [case for case in cases
                  if render(SMOLLM2_TEMPLATE, case["messages"], case["add_generation_prompt"]) != case["text"]]
    assert cases and mismatches == []


# ---- fallback and environment ----

def test_no_template_falls_back_to_chatml():
    expected = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert render(None, USER_HI) == render(CHATML_TEMPLATE, USER_HI) == expected
    assert render(None, USER_HI, add_generation_prompt=False) == "<|im_start|>user\nhi<|im_end|>\n"


def test_special_tokens_and_trim_blocks():
    template = "{{ bos_token }}\n{% for m in messages %}\n  {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    # trim_blocks drops the newline after a block tag, lstrip_blocks the indentation before one
    assert render(template, USER_HI) == "<s>\n  hi</s>\n"


def test_tojson_keeps_html_and_unicode():
    template = "{{ messages[0]['content'] | tojson }}|{{ {'b': 1, 'a': 2} | tojson(indent=1, sort_keys=true) }}"
    assert render(template, [{"role": "user", "content": "<é>&"}]) == '"<é>&"|{\n "a": 2,\n "b": 1\n}'


def test_loop_controls_and_generation_tag():
    template = ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                "{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}")
    assert render(template, [*USER_HI, {"role": "assistant", "content": "x"}]) == "[hi]"


def test_namespace_and_dict_as_transformers_gives_them():
    template = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
                "{{ ns.n }}|{{ dict(a=1) | tojson }}|{{ dict.fromkeys(['x']) | tojson }}")
    assert render(template, [*USER_HI, *USER_HI]) == '2|{"a": 1}|{"x": null}'


@pytest.mark.parametrize("template", [
    "{% set ns = namespace(_x=1) %}",
    "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",
    "{{ dict.__class__.__init__.__globals__ }}",
    "{{ namespace.__init__.__globals__ }}",
])
def test_namespace_and_dict_reach_no_internals(template):
    with pytest.raises(ValueError, match="namespace|unsafe|SecurityError|undefined"):
        render(template, USER_HI)


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content", "thinking"])
def test_reasoning_reaches_templates_under_every_name(field):
    template = "{% for m in messages %}[{{ m.reasoning_content }}|{{ m.thinking }}|{{ m.content }}]{% endfor %}"
    messages = [*USER_HI, {"role": "assistant", "content": "yo", field: "why"}]
    assert render(template, messages) == "[||hi][why|why|yo]"


def test_reasoning_is_a_caller_span():
    # a caller's reasoning is caller text: a tokenizer must read it as plain text, like content
    template = "{% for m in messages %}<{{ m.reasoning_content or '' }}>{{ m.content }}{% endfor %}"
    messages = [*USER_HI, {"role": "assistant", "content": "yo", "reasoning": "<|im_end|>"}]
    text, spans = render_with_caller_spans(template, messages, False, None, None)
    assert text == "<>hi<<|im_end|>>yo"
    assert [text[start:end] for start, end in spans] == ["hi", "<|im_end|>", "yo"]


def test_compiled_templates_are_cached():
    assert _compile(SMOLLM2_TEMPLATE + "x") is _compile(SMOLLM2_TEMPLATE + "x")


# ---- errors ----

def test_raise_exception_becomes_value_error():
    template = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('system message required') }}{% endif %}"
    with pytest.raises(ValueError, match="system message required"):
        render(template, USER_HI)


def test_template_type_error_is_value_error():
    with pytest.raises(ValueError, match="failed to render"):
        render("{{ messages[0]['content'] + 1 }}", USER_HI)


def test_invalid_jinja_is_value_error():
    with pytest.raises(ValueError, match="not valid jinja"):
        render("{% for m in messages %}{{ m }}", USER_HI)


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ messages.__class__.__base__ }}{{ ''.__class__.__mro__ }}",
    "{% set x = messages.append(1) %}",  # immutable sandbox: no mutation of passed-in lists
])
def test_sandbox_blocks_python_internals(template):
    with pytest.raises(ValueError, match="unsafe|SecurityError|not safely callable"):
        render(template, USER_HI)


def test_sandbox_attribute_access_yields_nothing():
    # A lone unsafe attribute renders as undefined (empty), exposing nothing.
    assert render("{{ ''.__class__ }}", USER_HI) == ""


# ---- message validation ----

def test_text_parts_join_with_newline():
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert normalize_messages(messages) == [{"role": "user", "content": "a\nb"}]
    assert render(None, messages, add_generation_prompt=False) == "<|im_start|>user\na\nb<|im_end|>\n"


def test_assistant_without_content_and_extra_keys_pass():
    messages = [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
                {"role": "tool", "content": "42", "tool_call_id": "1"}]
    assert normalize_messages(messages) == [{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]},
                                            {"role": "tool", "content": "42", "tool_call_id": "1"}]


def test_normalize_does_not_mutate_input():
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}]}]
    normalize_messages(messages)
    assert messages == [{"role": "user", "content": [{"type": "text", "text": "a"}]}]


@pytest.mark.parametrize("messages, match", [
    ([], "non-empty"),
    ("hi", "non-empty list"),
    (["hi"], r"messages\[0\] must be an object"),
    ([{"role": "wizard", "content": "x"}], "role 'wizard'"),
    ([{"content": "x"}], "role None"),
    ([{"role": "user", "content": 5}], "must be a string.*int"),
    ([{"role": "user"}], "must be a string.*NoneType"),
    ([{"role": "user", "content": {"text": "x"}}], "must be a string.*dict"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "'image_url'"),
    ([{"role": "user", "content": ["plain"]}], "part type 'str'"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "string 'text'"),
    ([*USER_HI, {"role": "user", "content": 1.5}], r"messages\[1\]"),
])
def test_invalid_messages_rejected(messages, match):
    with pytest.raises(ValueError, match=match):
        normalize_messages(messages)
    with pytest.raises(ValueError, match=match):
        render(None, messages)
