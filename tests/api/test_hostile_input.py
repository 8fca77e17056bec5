"""Hostile input to every field that takes JSON text or a grammar, over HTTP: text nested thousands
of levels deep, keys given twice, specs past the size bound, and grammars that pass validation but
break one of llguidance's limits once tokens arrive. Every answer is a 4xx in OpenAI's shape, never
a 5xx, and the engine is left alive and idle."""

from __future__ import annotations

import json

import httpx
import pytest
from server_util import running_server, wait_until

DEEP = "[" * 5000 + "]" * 5000          # deep enough to overflow a recursive parser
JUST_TOO_DEEP = "[" * 101 + "]" * 101   # one level past json_text's bound
TWICE = '{"type": "object", "type": "string"}'


@pytest.fixture(scope="module")
def live(tiny_model):
    with running_server(tiny_model) as server:
        yield server


def post(live, route: str, body: dict) -> httpx.Response:
    return httpx.post(live.url + route, json=body, timeout=120)


def assert_4xx(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert "<state>" not in error["message"] and len(response.content) < 16 << 10
    return error


def chat_with_past_call(arguments: str) -> dict:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "c1", "content": "ok"}], "max_tokens": 2}


def json_text_fields(text: str) -> list[tuple[str, dict, str]]:
    """(route, body, the param the 400 names) for every field that takes JSON text from a client."""
    responses_call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": text}
    return [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "guided_json": text}, "guided_json"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "structured_outputs": {"json": text}},
         "structured_outputs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                  "guided_json": text}, "guided_json"),
        ("/v1/chat/completions", chat_with_past_call(text), "messages.1.tool_calls.0.function.arguments"),
        ("/tokenize", {"messages": chat_with_past_call(text)["messages"]}, "messages.1.tool_calls.0.function.arguments"),
        ("/v1/responses", {"input": [responses_call, {"type": "function_call_output", "call_id": "c1",
                                                      "output": "ok"}], "max_output_tokens": 2},
         "input.0.arguments"),
    ]


@pytest.mark.parametrize("text", [DEEP, JUST_TOO_DEEP, TWICE], ids=["5000-deep", "101-deep", "key-twice"])
@pytest.mark.parametrize("index", range(6))
def test_json_text_in_any_field_is_parsed_with_a_depth_bound_and_unique_keys(live, text, index):
    route, body, param = json_text_fields(text)[index]
    error = assert_4xx(post(live, route, body))
    assert error["param"] == param
    assert ("twice in one object" if text is TWICE else "levels deep; at most 100 are accepted") in error["message"]
    assert wait_until(live.is_idle, 10) and not live.engine.is_dead


@pytest.mark.parametrize("route, body", [
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi", "role": "system"}], "max_tokens": 1}'),
    ("/v1/completions", '{"prompt": "a", "max_tokens": 1, "prompt": "b"}'),
    ("/v1/completions", '{"prompt": "a", "max_tokens": 1, "response_format": ' + '{"a": ' * 120 + "1" + "}" * 121),
])
def test_a_body_with_a_key_twice_or_nested_too_deep_is_a_400(live, route, body):
    """The last value would otherwise win: a user message would render as a system turn."""
    response = httpx.post(live.url + route, content=body, headers={"Content-Type": "application/json"})
    message = assert_4xx(response)["message"]
    assert message.startswith("the request body ") and ("twice" in message or "levels deep" in message)


def test_json_text_within_the_bounds_still_works(live):
    call_args = json.dumps({"a": [[[1]]]})
    assert post(live, "/v1/chat/completions", chat_with_past_call(call_args)).status_code == 200
    schema = json.dumps({"type": "array", "items": {"type": "array", "items": {"type": "integer"}}})
    assert post(live, "/v1/completions", {"prompt": "hi", "max_tokens": 4, "guided_json": schema}).status_code == 200
