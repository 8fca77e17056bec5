"""Tool calling and structured output over HTTP with the official `openai` client, on the tiny random
model: it writes random bytes, so a valid call or document can only come from the grammar."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from server_util import running_server

MODEL = "random"
USER = [{"role": "user", "content": "What is the weather in Oslo?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 3}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "clock", "parameters": {
             "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
             "additionalProperties": False}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
GREEDY = {"temperature": 0, "max_tokens": 200}


@pytest.fixture(scope="module")
def server(tiny_model):
    with running_server(tiny_model, max_body_bytes=1 << 20) as live:
        yield live


def assert_valid_calls(calls, names=tuple(SCHEMAS)) -> list[tuple[str, dict]]:
    """Each call names a declared tool and its arguments validate; returns (name, arguments)."""
    result = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        result.append((call.function.name, arguments))
    return result


def streamed(client, **kwargs) -> tuple[str | None, list[tuple[str, dict]], str]:
    """(content, calls, finish_reason) assembled from a stream, as an agent framework does."""
    content, calls, finish = None, {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                content = (content or "") + delta.content
            for call in delta.tool_calls or ():
                entry = calls.setdefault(call.index, {"id": call.id, "name": call.function.name, "arguments": ""})
                entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    pairs = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
    for name, arguments in pairs:
        jsonschema.validate(arguments, SCHEMAS[name])
    return content, pairs, finish


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_required_tool_choice_yields_a_valid_call_streamed_or_not(client, temperature):
    kwargs = dict(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required", max_tokens=200,
                  temperature=temperature, seed=7)
    result = client.chat.completions.create(**kwargs)
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = assert_valid_calls(choice.message.tool_calls)
    assert len(calls) == 1  # parallel_tool_calls not asked: one call
    content, streamed_calls, finish = streamed(client, **kwargs)
    assert (content, streamed_calls, finish) == (None, calls, "tool_calls")


def test_a_named_tool_choice_calls_that_tool(client):
    result = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, **GREEDY,
                                            tool_choice={"type": "function", "function": {"name": "clock"}})
    assert [name for name, _ in assert_valid_calls(result.choices[0].message.tool_calls)] == ["clock"]


def test_parallel_tool_calls_may_give_several_valid_calls(client):
    result = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=True, temperature=1.0, seed=3, max_tokens=400, n=4)
    # A random model seldom ends after a call when it may go on: choices may run to max_tokens, their
    # complete calls still parsed (the one cut short stays text).
    counts = [len(assert_valid_calls(choice.message.tool_calls)) for choice in result.choices]
    assert min(counts) >= 1 and max(counts) >= 2, counts


def test_auto_parses_a_call_the_model_writes_between_text(client):
    # The random model never writes a call by itself; a regex makes it write text, then a call.
    regex = r'Let me check\.\n<tool_call>\n\{"name": "clock", "arguments": \{"tz": "(UTC|CET)"\}\}\n</tool_call>'
    kwargs = dict(model=MODEL, messages=USER, tools=TOOLS, **GREEDY, extra_body={"guided_regex": regex})
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.message.content == "Let me check."
    calls = assert_valid_calls(choice.message.tool_calls)
    assert calls[0][0] == "clock" and choice.finish_reason == "tool_calls"
    assert streamed(client, **kwargs) == ("Let me check.", calls, "tool_calls")


def test_auto_without_a_call_is_plain_text_and_none_leaves_tools_out(client):
    plain = client.chat.completions.create(model=MODEL, messages=USER, **GREEDY)
    auto = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, **GREEDY)
    none = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="none", **GREEDY)
    assert auto.choices[0].message.tool_calls in (None, []) and auto.choices[0].finish_reason in ("stop", "length")
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens  # the tools are in the prompt
    assert (none.choices[0].message.content, none.usage.prompt_tokens) == (
        plain.choices[0].message.content, plain.usage.prompt_tokens)


def test_a_tool_result_goes_back_into_the_conversation(client):
    first = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required", **GREEDY)
    message = first.choices[0].message
    history = [*USER, message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "-3 C and snow"}]
    second = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, **GREEDY)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    longer = [*history[:-1], {**history[-1], "content": "-3 C and snow, wind from the north at 40 km/h"}]
    third = client.chat.completions.create(model=MODEL, messages=longer, tools=TOOLS, **GREEDY)
    assert third.usage.prompt_tokens - second.usage.prompt_tokens == len(", wind from the north at 40 km/h")


def test_a_tool_message_needs_no_tools_in_the_request(client):
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "clock", "arguments": '{"tz": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]
    assert client.chat.completions.create(model=MODEL, messages=history, max_tokens=4).choices


JSON_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n"],
               "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}}}


@pytest.mark.parametrize("field, value, check", [
    ("structured_outputs", {"json": JSON_SCHEMA, "disable_any_whitespace": True},
     lambda text: jsonschema.validate(json.loads(text), JSON_SCHEMA)),
    ("guided_regex", r"[a-c]{2}-[0-9]{2}", lambda text: re.fullmatch(r"[a-c]{2}-[0-9]{2}", text) or pytest.fail(text)),
    ("guided_choice", ["alpha", "beta"], lambda text: text in ("alpha", "beta") or pytest.fail(text)),
    ("guided_grammar", 'start: "x" ("y" | "z")', lambda text: text in ("xy", "xz") or pytest.fail(text)),
])
def test_each_constraint_field_holds_on_both_endpoints_streamed_or_not(client, field, value, check):
    for stream in (False, True):
        chat = client.chat.completions.create(model=MODEL, messages=USER, **GREEDY, extra_body={field: value},
                                              stream=stream)
        text = "".join(c.choices[0].delta.content or "" for c in chat) if stream else chat.choices[0].message.content
        check(text)
        completion = client.completions.create(model=MODEL, prompt="x", **GREEDY, extra_body={field: value},
                                               stream=stream)
        text = "".join(c.choices[0].text for c in completion) if stream else completion.choices[0].text
        check(text)


def test_unconstrained_requests_keep_their_output_beside_constrained_ones(client):
    def plain(i: int) -> str:
        return client.completions.create(model=MODEL, prompt=f"prompt {i}", **GREEDY).choices[0].text

    def constrained(i: int) -> str:
        return client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required",
                                              temperature=1.0, seed=i, max_tokens=200).choices[0].finish_reason

    alone = [plain(i) for i in range(4)]
    with ThreadPoolExecutor(8) as pool:
        mixed = [pool.submit(plain, i) for i in range(4)]
        reasons = [pool.submit(constrained, i) for i in range(4)]
        assert [f.result() for f in mixed] == alone
        assert [f.result() for f in reasons] == ["tool_calls"] * 4


def test_bad_constraints_are_400s_and_the_server_keeps_serving(client):
    bad = [dict(messages=USER, tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]),
           dict(messages=USER, response_format={"type": "json_schema", "json_schema": {
               "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}),
           dict(messages=USER, extra_body={"guided_decoding_backend": "xgrammar"})]
    for kwargs in bad:
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL, max_tokens=4, **kwargs)
    assert client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4).choices


def deep_array(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema, "maxItems": 2}
    return schema


HOSTILE = [  # the grammar ReDoS class: each is checked and compiled in bounded time, or refused
    {"guided_regex": "(a+)+$"}, {"guided_regex": "(a|aa)*b"}, {"guided_regex": "(a{1,1000}){1,1000}"},
    {"guided_regex": "(.*a.{20}b)*"}, {"guided_regex": "(x|y)*" + "a" * 5000},
    {"guided_json": {"enum": [f"value-{i}" for i in range(2000)]}},
    {"guided_json": {"anyOf": [{"type": "string", "pattern": f"^[a-z]{{{i}}}$"} for i in range(1, 300)]}},
    {"guided_json": deep_array(40)}, {"guided_json": deep_array(400)},
    {"guided_json": {"type": "string", "pattern": "^(a+)+$"}},
    {"guided_grammar": "start: a\na: \"x\" a | \"y\""},
    {"guided_choice": [f"option {i}" for i in range(1024)]},
]


def test_hostile_grammars_are_bounded_and_leave_the_server_healthy(server):
    import httpx

    def send(extra: dict) -> int:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 16, "temperature": 1.0, "seed": 1, **extra}
        response = httpx.post(server.base_url + "/completions", json=body, timeout=120)
        assert response.status_code in (200, 400), response.text
        return response.status_code

    with ThreadPoolExecutor(4) as pool:
        statuses = list(pool.map(send, HOSTILE))
    assert 200 in statuses  # most are legal, just large: they must run, not only be refused
    assert send({}) == 200 and httpx.get(server.url + "/health").status_code == 200
