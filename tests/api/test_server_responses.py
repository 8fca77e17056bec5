"""POST /v1/responses: OpenAI's Responses API over the chat path. The tiny random model emits random
bytes, so these check shapes, counts, the order of stream events, and that a Responses request gives
the very prompt and greedy text of its chat equivalent; valid JSON or calls can only come from the
constraint. The official `openai` client must parse every answer."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from server_util import fault_on, running_server, wait_until

from vllmlite.api.openai.protocol_fields import MAX_PROMPT_CHARS

MODEL = "random"
MARKER = "@@FAULT@@"
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
              "required": ["city"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": PARAMETERS}
# The random model pads JSON with whitespace forever when it may: llguidance's option forbids it.
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False,
          "x-guidance": {"whitespace_flexible": False}}
PERSON_FORMAT = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
MESSAGE_EVENTS = ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
                  "response.output_text.done", "response.content_part.done", "response.output_item.done"]
STREAM_EVENT = TypeAdapter(ResponseStreamEvent)
CALL_EVENTS = ["response.output_item.added", "response.function_call_arguments.delta",
               "response.function_call_arguments.done", "response.output_item.done"]


def post(server, body: dict, path: str = "/responses") -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=120)


def create(server, **body) -> dict:
    response = post(server, {"model": MODEL, "temperature": 0, **body})
    assert response.status_code == 200, response.text
    Response.model_validate(response.json())  # the openai package's own types, validated (not constructed)
    return response.json()


def stream_events(server, **body) -> list[tuple[str, dict]]:
    """(event name, data) of each server-sent event, checked to be numbered 0, 1, 2, ... with the
    name equal to the data's type, and not ended by [DONE]."""
    response = post(server, {"model": MODEL, "temperature": 0, "stream": True, **body})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = []
    for block in response.text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n") if not line.startswith(":"))
        data = json.loads(lines["data"])
        assert lines["event"] == data["type"], block
        STREAM_EVENT.validate_python(data)
        events.append((lines["event"], data))
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    return events


def output_text(response: dict) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"])


def test_the_response_is_the_chat_answer_in_responses_shape(server):
    """Same prompt tokens and greedy text as the chat request it maps to; cut by max_output_tokens,
    the response is incomplete and says why."""
    response = create(server, input="Hello there", instructions="Be brief.", max_output_tokens=7,
                      metadata={"k": "v"})
    chat = post(server, {"model": MODEL, "temperature": 0, "max_completion_tokens": 7, "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]},
        "/chat/completions").json()
    assert response["id"].startswith("resp_") and response["object"] == "response"
    assert response["status"] == "incomplete" and response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["error"] is None and response["model"] == MODEL
    (message,) = response["output"]
    assert message["id"].startswith("msg_") and message["role"] == "assistant" and message["status"] == "incomplete"
    assert message["content"][0]["annotations"] == [] and output_text(response) == chat["choices"][0]["message"]["content"]
    usage = response["usage"]
    assert usage["input_tokens"] == chat["usage"]["prompt_tokens"] and usage["output_tokens"] == 7
    assert usage["total_tokens"] == usage["input_tokens"] + 7 and usage["output_tokens_details"] == {"reasoning_tokens": 0}
    assert 0 <= usage["input_tokens_details"]["cached_tokens"] <= usage["input_tokens"]
    assert (response["instructions"], response["max_output_tokens"], response["metadata"]) == ("Be brief.", 7, {"k": "v"})
    assert response["tool_choice"] == "none" and response["tools"] == [] and response["text"] == {"format": {"type": "text"}}


def test_streamed_deltas_join_to_the_greedy_text_in_openai_event_order(server):
    whole = create(server, input="Stream this", max_output_tokens=9)
    events = stream_events(server, input="Stream this", max_output_tokens=9)
    names = [name for name, _ in events]
    num_deltas = names.count("response.output_text.delta")
    assert names == ["response.created", "response.in_progress", *MESSAGE_EVENTS[:2],
                     *["response.output_text.delta"] * num_deltas, *MESSAGE_EVENTS[3:], "response.incomplete"]
    assert events[0][1]["response"]["status"] == "in_progress" and events[0][1]["response"]["usage"] is None
    item_id = events[2][1]["item"]["id"]
    deltas = [data for name, data in events if name == "response.output_text.delta"]
    assert all((d["item_id"], d["output_index"], d["content_index"], d["logprobs"]) == (item_id, 0, 0, []) for d in deltas)
    text = "".join(d["delta"] for d in deltas)
    assert text == output_text(whole) and events[-4][1]["text"] == text
    final = events[-1][1]["response"]
    assert final["output"][0]["id"] == item_id and output_text(final) == text
    assert final["usage"] == whole["usage"] | {"input_tokens_details": final["usage"]["input_tokens_details"]}
    assert final["status"] == "incomplete" and final["id"] == events[0][1]["response"]["id"]


def test_text_format_json_schema_gives_a_valid_document(server):
    response = create(server, input="Describe a person", text=PERSON_FORMAT, max_output_tokens=100)
    assert response["status"] == "completed" and response["incomplete_details"] is None
    jsonschema.validate(json.loads(output_text(response)), PERSON)
    assert response["text"]["format"]["schema"] == PERSON  # echoed under its own name


def test_required_tool_choice_gives_a_call_whose_arguments_fit_the_schema(server):
    response = create(server, input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
                      max_output_tokens=200)
    assert response["status"] == "completed" and response["tool_choice"] == "required"
    (call,) = response["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather" and call["status"] == "completed"
    assert call["id"].startswith("fc_") and call["call_id"].startswith("call_")
    jsonschema.validate(json.loads(call["arguments"]), PARAMETERS)
    assert response["tools"][0]["parameters"] == PARAMETERS


def test_a_streamed_call_is_sent_whole_after_the_text(server):
    events = stream_events(server, input="Weather in Paris?", tools=[WEATHER],
                           tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=200)
    names = [name for name, _ in events]
    assert names == ["response.created", "response.in_progress", *CALL_EVENTS, "response.completed"]
    added, delta, done, item_done = (data for _, data in events[2:6])
    assert added["item"]["arguments"] == "" and added["item"]["status"] == "in_progress"
    assert delta["delta"] == done["arguments"] == item_done["item"]["arguments"]
    assert {added["item"]["id"], delta["item_id"], done["item_id"]} == {item_done["item"]["id"]}
    jsonschema.validate(json.loads(done["arguments"]), PARAMETERS)
    assert events[-1][1]["response"]["output"] == [item_done["item"]]


def test_function_call_items_and_their_outputs_make_the_chat_prompt(server):
    """A call sent back and its output become an assistant message with tool_calls and a tool
    message: the prompt is token for token the chat request's."""
    arguments = json.dumps({"city": "Paris"})
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
             {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
              "arguments": arguments, "status": "completed"},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"}]
    response = create(server, input=items, tools=[WEATHER], max_output_tokens=3)
    chat_tool = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "Let me look.", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    chat = post(server, {"model": MODEL, "temperature": 0, "max_completion_tokens": 3, "messages": messages,
                         "tools": [chat_tool]}, "/chat/completions").json()
    assert response["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert output_text(response) == (chat["choices"][0]["message"]["content"] or "")


BAD_REQUESTS = [
    ({"input": "x", "foo": 1}, "foo"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "reasoning": {"effort": "low"}}, "reasoning"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input.0.content.0"),
    ({"input": [{"type": "web_search_call"}]}, "input.0"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
    ({"input": []}, "input"),
    ({}, "input"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"type": 5}}]}, "tools.0.parameters"),
    ({"input": "x", "tools": [{"type": "function", "name": "a b"}]}, "tools.0.name"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "g"}}, "tool_choice.name"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 1 << 19}, "input"),  # past the context: the prompt's 400, as chat
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "p", "schema": {"type": "nope"}}}},
     "text.format.schema"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
     "text.format"),
    ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": "x", "model": "gpt-5"}, "model"),
    ({"input": "x" * (MAX_PROMPT_CHARS + 1)}, "input"),
]


@pytest.mark.parametrize("body,param", BAD_REQUESTS)
def test_bad_requests_are_openai_errors_naming_the_responses_field(server, body, param):
    response = post(server, body)
    assert response.status_code == (404 if param == "model" else 400), response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]
    assert "messages" not in error["message"] and "max_completion_tokens" not in error["message"]


def test_an_input_string_past_the_bound_is_a_length_error(server):
    """Not the list form's "Input should be a valid array" (pydantic reports a union's last failure)."""
    error = post(server, {"input": "x" * (MAX_PROMPT_CHARS + 1)}).json()["error"]
    assert error["message"] == f"input: input has {MAX_PROMPT_CHARS + 1} characters; at most {MAX_PROMPT_CHARS} " \
                               "are accepted"


def test_the_openapi_document_declares_the_route_and_its_events_without_done(server):
    document = httpx.get(server.url + "/openapi.json").json()
    operation = document["paths"]["/v1/responses"]["post"]
    assert operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/ResponsesRequest")
    content = operation["responses"]["200"]["content"]
    assert content["application/json"]["schema"]["$ref"].endswith("/ResponsesResponse")
    data = content["text/event-stream"]["itemSchema"]["properties"]["data"]
    events = {ref["$ref"].rsplit("/", 1)[1] for ref in data["contentSchema"]["anyOf"]}
    assert {"ResponseLifecycleEvent", "OutputTextDeltaEvent", "ResponseErrorEvent"} <= events and "if" not in data
    request = document["components"]["schemas"]["ResponsesRequest"]
    assert request["additionalProperties"] is False and request["properties"]["previous_response_id"]["enum"] == [None]


def test_the_openai_client_reads_responses_and_streams(client):
    response = client.responses.create(model=MODEL, input="Hi", max_output_tokens=6, temperature=0)
    assert response.status == "incomplete" and len(response.output_text) > 0
    assert response.usage.output_tokens == 6 and response.output[0].content[0].text == response.output_text
    events = list(client.responses.create(model=MODEL, input="Hi", max_output_tokens=6, temperature=0, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == response.output_text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == response.output_text
    with client.responses.stream(model=MODEL, input="Describe a person", text=PERSON_FORMAT,
                                 max_output_tokens=100, temperature=0) as stream:
        names = [event.type for event in stream]
        final = stream.get_final_response()
    assert names[-1] == "response.completed" and final.status == "completed"
    jsonschema.validate(json.loads(final.output_text), PERSON)


def test_the_openai_client_round_trips_a_call(client):
    tool = {**WEATHER, "strict": True}
    first = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[tool], tool_choice="required",
                                    max_output_tokens=200, temperature=0)
    (call,) = first.output
    assert call.type == "function_call" and first.output_text == ""
    history = [{"role": "user", "content": "Weather in Paris?"}, *first.output,
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    second = client.responses.create(model=MODEL, input=history, tools=[tool], max_output_tokens=4, temperature=0)
    assert second.usage.input_tokens > first.usage.input_tokens and second.status == "incomplete"


def test_a_failure_mid_stream_is_an_error_event_and_nothing_leaks(server):
    server.engine.engine.runner.fault_hook = fault_on(MARKER)
    try:
        events = stream_events(server, input=f"boom {MARKER}", max_output_tokens=4)
    finally:
        server.engine.engine.runner.fault_hook = None
    name, error = events[-1]
    assert [n for n, _ in events[:2]] == ["response.created", "response.in_progress"] and name == "error"
    assert "injected fault" in error["message"] and error["code"] == "internal_server_error"
    assert wait_until(server.is_idle)


@pytest.mark.real_model
def test_real_model_answers_in_english_and_calls_a_tool():
    from vllmlite.models.loader import load_model

    loaded = load_model("default", "float32", 0)
    with running_server(loaded, model="default", dtype="float32", num_blocks=256) as live:
        client = openai.OpenAI(base_url=live.base_url, api_key="x", max_retries=0, timeout=300)
        answer = client.responses.create(model="SmolLM2-135M-Instruct", input="What is the capital of France?",
                                         max_output_tokens=24, temperature=0)
        call = client.responses.create(model="SmolLM2-135M-Instruct", input="What is the weather in Paris?",
                                       tools=[WEATHER], tool_choice="required", max_output_tokens=60, temperature=0)
    text = answer.output_text
    letters = [ch for ch in text if ch.isalpha()]
    assert len(letters) >= 5 and all(ch.isascii() for ch in letters), text
    assert len(set(text.lower().split()) & {"the", "is", "of", "paris", "a", "capital", "france"}) >= 1, text
    (item,) = call.output
    assert item.type == "function_call" and item.name == "get_weather" and call.status == "completed"
    jsonschema.validate(json.loads(item.arguments), PARAMETERS)
