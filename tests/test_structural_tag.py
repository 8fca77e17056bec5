"""Structural tags (vLLM's `structural_tag`, xgrammar's format) as llguidance grammars: which texts each
format accepts, checked byte by byte with llguidance's matcher over the byte vocabulary, and the
ValueErrors for what is malformed or not supported."""

from __future__ import annotations

import json

import llguidance
import pytest

from vllmlite.structural_tag import structural_tag_grammar
from vllmlite.structured_output_params import StructuredOutputsParams
from vllmlite.tokenizer import ByteTokenizer
from vllmlite.worker.structured_output import make_llg_tokenizer

LLG_TOKENIZER = make_llg_tokenizer(ByteTokenizer(), ByteTokenizer().vocab_size)
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "tag", "begin": "<function=get_weather>", "content": {"type": "json_schema", "json_schema": CITY},
           "end": "</function>"}
TIME = {"type": "tag", "begin": "<function=get_time>", "content": {"type": "json_schema", "json_schema": {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}}, "end": "</function>"}
# vLLM's structured-outputs example, as it sends it (the legacy shape)
LEGACY = {"type": "structural_tag", "triggers": ["<function="], "structures": [
    {"begin": "<function=get_weather>", "schema": CITY, "end": "</function>"}]}


def accepts(spec: dict, text: str, flexible_whitespace: bool = True) -> bool:
    """Whether the grammar takes all of `text` and may end there."""
    grammar = structural_tag_grammar(spec, flexible_whitespace)
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""
    matcher = llguidance.LLMatcher(LLG_TOKENIZER, grammar, log_level=0)
    return matcher.consume_tokens(list(text.encode())) and not matcher.is_error() and matcher.is_accepting()


def tagged(fmt: dict) -> dict:
    return {"type": "structural_tag", "format": fmt}


@pytest.mark.parametrize("text, ok", [
    ("no call at all", True),
    ('It is <function=get_weather>{"city": "Paris"}</function> and then text', True),
    ('<function=get_weather>{"city": "Paris"}</function><function=get_weather>{"city":"Rome"}</function>', True),
    ('<function=get_weather>{"town": "Paris"}</function>', False),   # the schema holds inside the tag
    ("<function=get_time>", False),                                  # a trigger must lead to a declared tag
    ('<function=get_weather>{"city": "Paris"}', False),              # the tag must end
])
def test_the_legacy_shape_is_free_text_with_triggered_tags(text, ok):
    assert accepts(LEGACY, text) is ok
    assert accepts(LEGACY, text) == accepts(json.dumps(LEGACY), text)  # JSON text or its dict


def test_triggered_tags_at_least_one_and_stop_after_first():
    call = '<function=get_time>{"tz": "UTC"}</function>'
    base = {"type": "triggered_tags", "triggers": ["<function="], "tags": [WEATHER, TIME]}
    assert accepts(tagged(base), f"text {call} more")
    first = tagged({**base, "at_least_one": True})
    assert accepts(first, f"{call} more") and not accepts(first, f"text {call}") and not accepts(first, "text")
    once = tagged({**base, "stop_after_first": True})
    assert accepts(once, f"text {call}") and accepts(once, "text") and not accepts(once, f"text {call} more")
    exactly_one = tagged({**base, "at_least_one": True, "stop_after_first": True})
    assert accepts(exactly_one, call) and not accepts(exactly_one, "") and not accepts(exactly_one, call + call)


def test_tags_with_separator_allow_only_tags_and_separators():
    calls = ['<function=get_time>{"tz": "CET"}</function>', '<function=get_weather>{"city": "Oslo"}</function>']
    fmt = {"type": "tags_with_separator", "tags": [WEATHER, TIME], "separator": ", "}
    assert accepts(tagged(fmt), ", ".join(calls)) and accepts(tagged(fmt), "")
    assert not accepts(tagged(fmt), "".join(calls)) and not accepts(tagged(fmt), "text " + calls[0])
    assert not accepts(tagged({**fmt, "at_least_one": True}), "")
    assert not accepts(tagged({**fmt, "stop_after_first": True}), ", ".join(calls))


def test_a_think_tag_then_calls_as_xgrammar_documents_it():
    fmt = {"type": "sequence", "elements": [
        {"type": "tag", "begin": "<think>", "content": {"type": "any_text"}, "end": "</think>"},
        {"type": "triggered_tags", "triggers": ["<function="], "tags": [TIME]}]}
    assert accepts(tagged(fmt), '<think>hmm, time</think>sure <function=get_time>{"tz": "UTC"}</function>')
    assert not accepts(tagged(fmt), "no thinking first")
    assert not accepts(tagged(fmt), '<think>a</think><function=get_time>{"tz": "EST"}</function>')
    # a tag's free text ends at the first end: it cannot swallow one and go on
    then_x = tagged({"type": "sequence", "elements": [fmt["elements"][0], {"type": "const_string", "value": "X"}]})
    assert accepts(then_x, "<think>a</think>X") and not accepts(then_x, "<think>a</think>b</think>X")


@pytest.mark.parametrize("fmt, good, bad", [
    ({"type": "const_string", "value": 'say "hi"\n'}, 'say "hi"\n', "say hi"),
    ({"type": "regex", "pattern": r"\w+@\w+\.com/x"}, "alan@enigma.com/x", "alan@enigma.org/x"),
    ({"type": "grammar", "grammar": 'root ::= "SELECT " col\ncol ::= "a" | "b"'}, "SELECT b", "SELECT c"),
    ({"type": "grammar", "grammar": 'start: "x" NUM\nNUM: /[0-9]+/'}, "x42", "x"),  # Lark too
    ({"type": "or", "elements": [{"type": "const_string", "value": "yes"},
                                 {"type": "json_schema", "json_schema": {"type": "integer"}}]}, "17", "maybe"),
    ({"type": "tag", "begin": "[", "content": {"type": "any_text"}, "end": ["]", ")"]}, "[any)", "[a]b"),
    ({"type": "any_text"}, "anything\nat all", None),
])
def test_each_format_type_accepts_its_texts(fmt, good, bad):
    assert accepts(tagged(fmt), good)
    if bad is not None:
        assert not accepts(tagged(fmt), bad)


def test_disable_any_whitespace_reaches_the_json_schemas():
    spec = tagged({"type": "json_schema", "json_schema": CITY})
    assert accepts(spec, '{ "city" : "x" }') and not accepts(spec, '{ "city" : "x" }', flexible_whitespace=False)
    assert accepts(spec, '{"city":"x"}', flexible_whitespace=False)


@pytest.mark.parametrize("spec, message", [
    ("{not json", "not valid JSON"),
    ({"type": "json_object"}, "must be 'structural_tag'"),
    ({"type": "structural_tag"}, "format type"),
    (tagged({"type": "qwen_xml_parameter", "json_schema": CITY}), "'qwen_xml_parameter' is not supported"),
    (tagged({"type": "sequence", "elements": [{"type": "any_text"}, {"type": "const_string", "value": "x"}]}),
     "any_text is supported as a tag's content"),
    (tagged({"type": "any_text", "excludes": ["x"]}), "excludes"),
    (tagged({"type": "triggered_tags", "triggers": ["<f="], "tags": [WEATHER]}), "starts with none of the triggers"),
    ({**LEGACY, "triggers": ["<call>"]}, "starts with none of the triggers"),
    ({"type": "structural_tag", "structures": [], "triggers": ["<"]}, "structures must be a non-empty list"),
    (tagged({"type": "tag", "begin": "<a>", "content": {"type": "const_string", "value": "x"}, "end": 5}),
     "end must be a string or a list"),
    (tagged({"type": "json_schema", "json_schema": CITY, "style": "qwen_xml"}), "style 'json'"),
    (tagged(json.loads('{"type": "or", "elements": [' * 40 + '{"type": "any_text"}' + ']}' * 40)), "deeper"),
])
def test_malformed_or_unsupported_specs_are_value_errors_that_say_where(spec, message):
    with pytest.raises(ValueError, match=message):
        structural_tag_grammar(spec)


def test_structured_outputs_params_take_a_structural_tag():
    params = StructuredOutputsParams(structural_tag=json.dumps(LEGACY))
    assert params.kind == "structural_tag"
    params.verify()
    with pytest.raises(ValueError, match="structured_outputs.structural_tag is invalid: .*starts with none"):
        StructuredOutputsParams(structural_tag=json.dumps({**LEGACY, "triggers": ["<x"]})).verify()
    with pytest.raises(ValueError, match="structured_outputs.structural_tag is invalid"):
        StructuredOutputsParams(structural_tag=json.dumps(tagged({"type": "regex", "pattern": "(a"}))).verify()
