"""Structured output and tool calling with the real default model through the `openai` client: every
output must be valid, whatever the model would have written on its own."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from server_util import running_server

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"
STRING = {"type": "string", "maxLength": 24}
# Ten shapes: flat, nested, arrays, enums, bounded numbers, optional fields, unions, consts.
SCHEMAS = {
    "person": {"type": "object", "additionalProperties": False, "required": ["name", "age"],
               "properties": {"name": STRING, "age": {"type": "integer", "minimum": 0, "maximum": 120}}},
    "nested": {"type": "object", "additionalProperties": False, "required": ["city", "location"],
               "properties": {"city": STRING, "location": {
                   "type": "object", "additionalProperties": False, "required": ["lat", "lon"],
                   "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                  "lon": {"type": "number", "minimum": -180, "maximum": 180}}}}},
    "string_array": {"type": "object", "additionalProperties": False, "required": ["fruits"],
                     "properties": {"fruits": {"type": "array", "items": STRING, "minItems": 2, "maxItems": 4}}},
    "enum": {"type": "object", "additionalProperties": False, "required": ["sentiment"],
             "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]}}},
    "optional": {"type": "object", "additionalProperties": False, "required": ["title"],
                 "properties": {"title": STRING, "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                                "genre": {"enum": ["drama", "comedy", "action"]}}},
    "bounded_numbers": {"type": "object", "additionalProperties": False, "required": ["score", "ratio"],
                        "properties": {"score": {"type": "integer", "minimum": 1, "maximum": 10},
                                       "ratio": {"type": "number", "minimum": 0, "maximum": 1}}},
    "array_of_objects": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "additionalProperties": False, "required": ["item", "qty"],
        "properties": {"item": STRING, "qty": {"type": "integer", "minimum": 1, "maximum": 9}}}},
    "boolean_and_null": {"type": "object", "additionalProperties": False, "required": ["done", "note"],
                         "properties": {"done": {"type": "boolean"}, "note": {"type": ["string", "null"],
                                                                              "maxLength": 24}}},
    "any_of": {"type": "object", "additionalProperties": False, "required": ["answer"],
               "properties": {"answer": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 100},
                                                   {"enum": ["unknown"]}]}}},
    "const_and_pattern": {"type": "object", "additionalProperties": False, "required": ["version", "code"],
                          "properties": {"version": {"const": 1},
                                         "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}}},
}
PROMPTS = {
    "person": "Describe a fictional person with a name and an age.",
    "nested": "Give a city and its latitude and longitude.",
    "string_array": "List a few fruits.",
    "enum": "What is the sentiment of: 'I love this phone'?",
    "optional": "Tell me about a famous movie.",
    "bounded_numbers": "Rate the movie Titanic.",
    "array_of_objects": "Write a short shopping list.",
    "boolean_and_null": "Is the task 'buy milk' done?",
    "any_of": "How many legs does a spider have?",
    "const_and_pattern": "Give a product code.",
}
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": STRING, "unit": {"enum": ["celsius", "fahrenheit"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": {
             "type": "object", "additionalProperties": False, "required": ["a", "b"],
             "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def real_server():
    from vllmlite.models.loader import load_model
    loaded = load_model("default", "float32", 0)
    with running_server(loaded, model="default", dtype="float32", num_blocks=1024, max_num_seqs=24,
                        max_body_bytes=1 << 20) as live:
        yield live


@pytest.fixture(scope="module")
def real_client(real_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=real_server.base_url, api_key="x", max_retries=0, timeout=600)


def json_answer(client: openai.OpenAI, name: str, stream: bool) -> tuple[str, str | None]:
    """(the text, its finish reason) of a response_format json_schema request."""
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": PROMPTS[name] + " Answer in JSON."}],
                  response_format={"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name],
                                                                          "strict": True}},
                  temperature=0, max_tokens=300)
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        return choice.message.content, choice.finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        text += chunk.choices[0].delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    return text, finish


def test_ten_json_schemas_give_valid_documents_streamed_and_not(real_client):
    jobs = [(name, stream) for name in SCHEMAS for stream in (False, True)]
    with ThreadPoolExecutor(len(jobs)) as pool:  # all twenty decode together
        answers = list(pool.map(lambda job: json_answer(real_client, *job), jobs))
    for (name, stream), (text, finish) in zip(jobs, answers):
        assert finish == "stop", (name, stream, text)
        jsonschema.validate(json.loads(text), SCHEMAS[name])
    by_job = dict(zip(jobs, answers))
    assert all(by_job[(name, False)] == by_job[(name, True)] for name in SCHEMAS)  # greedy: one answer


def test_json_object_regex_and_choice(real_client):
    messages = [{"role": "user", "content": "Return a JSON object with keys city and country for Paris."}]
    obj = real_client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=200,
                                              response_format={"type": "json_object"})
    assert obj.choices[0].finish_reason == "stop" and isinstance(json.loads(obj.choices[0].message.content), dict)
    date = real_client.completions.create(model=MODEL, prompt="The first moon landing was on", temperature=0,
                                          max_tokens=20, extra_body={"guided_regex": r" [0-9]{4}-[0-9]{2}-[0-9]{2}"})
    assert re.fullmatch(r" [0-9]{4}-[0-9]{2}-[0-9]{2}", date.choices[0].text)
    pick = real_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is the sky blue? Answer yes or no."}], temperature=0,
        max_tokens=10, extra_body={"guided_choice": ["yes", "no"]})
    assert pick.choices[0].message.content in ("yes", "no") and pick.choices[0].finish_reason == "stop"


def test_required_tool_choice_calls_a_declared_tool_with_valid_arguments(real_client):
    for stream in (False, True):
        kwargs = dict(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required", temperature=0,
                      max_tokens=120)
        if stream:
            calls = {}
            for chunk in real_client.chat.completions.create(stream=True, **kwargs):
                for call in chunk.choices[0].delta.tool_calls or () if chunk.choices else ():
                    entry = calls.setdefault(call.index, {"name": call.function.name, "arguments": ""})
                    entry["arguments"] += call.function.arguments or ""
            pairs = [(c["name"], c["arguments"]) for c in calls.values()]
        else:
            message = real_client.chat.completions.create(**kwargs).choices[0].message
            pairs = [(c.function.name, c.function.arguments) for c in message.tool_calls]
        assert len(pairs) == 1
        name, arguments = pairs[0]
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)
        jsonschema.validate(json.loads(arguments), schema)


def test_a_tool_round_trip_answers_from_the_tool_result(real_client):
    first = real_client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, temperature=0,
                                                tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                                max_tokens=120)
    assert first.choices[0].finish_reason == "tool_calls"
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK_WEATHER, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 31, "sky": "sunny"}'}]
    second = real_client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                                 temperature=0, max_tokens=60)
    text = second.choices[0].message.content
    assert second.choices[0].message.tool_calls in (None, []) and text
    assert "31" in text or "sunny" in text.lower(), text


def test_constrained_requests_leave_unconstrained_greedy_outputs_unchanged(real_client):
    prompts = ["The capital of Italy is", "Once upon a time", "def fibonacci(n):"]

    def plain(prompt: str) -> str:
        return real_client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=32).choices[0].text

    alone = [plain(p) for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        constrained = [pool.submit(json_answer, real_client, name, False) for name in ("person", "nested", "enum")]
        mixed = [pool.submit(plain, p) for p in prompts]
        assert [f.result() for f in mixed] == alone
        assert all(f.result()[1] == "stop" for f in constrained)


def test_speculative_decoding_with_a_constraint_gives_the_same_valid_output(real_client):
    from vllmlite.models.loader import load_model
    loaded = load_model("default", "float32", 0)
    spec = '{"method": "self_draft", "num_draft_layers": 8, "num_speculative_tokens": 3}'
    with running_server(loaded, model="default", dtype="float32", num_blocks=512,
                        speculative_config=spec) as live:
        client = openai.OpenAI(base_url=live.base_url, api_key="x", max_retries=0, timeout=600)
        for name in ("array_of_objects",):
            text, finish = json_answer(client, name, stream=False)
            assert finish == "stop"
            jsonschema.validate(json.loads(text), SCHEMAS[name])
            assert (text, finish) == json_answer(real_client, name, stream=False)  # greedy: one answer
