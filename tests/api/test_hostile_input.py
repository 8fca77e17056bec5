"""Hostile input to every field that takes JSON text or a grammar, over HTTP: text nested thousands
of levels deep, keys given twice, specs past the size bound, and grammars that pass validation but
break one of llguidance's limits once tokens arrive. Every answer is a 4xx in OpenAI's shape, never
a 5xx, and the engine is left alive and idle."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from property_util import examples
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


# --- grammars -------------------------------------------------------------------------------------

EXPLODING_REGEX = "a{1000}{1000}"  # passes validation; its lexer has too many states once 'a' comes
WIDE_LARK = "start: " + " | ".join(f'"w{i}"' for i in range(6000))  # a row of 6,001 items; llguidance's max is 2,000
HUGE_REGEX = "a" * 70_000  # past the 65,536-character bound on a spec
DEEP_SCHEMA = {"type": "array", "items": {}}
for _ in range(120):
    DEEP_SCHEMA = {"type": "array", "items": DEEP_SCHEMA}
HOSTILE_GRAMMARS = {"exploding-regex": ("regex", EXPLODING_REGEX), "wide-lark": ("grammar", WIDE_LARK),
                    "huge-regex": ("regex", HUGE_REGEX), "bad-regex": ("regex", "a(b"),
                    "bad-lark": ("grammar", "start: ???"), "deep-schema": ("json", DEEP_SCHEMA),
                    "huge-schema": ("json", {"enum": ["x" * 70_000]}),
                    "bad-schema": ("json", {"type": "object", "required": 3})}
USER = [{"role": "user", "content": "hi"}]


def grammar_fields(kind: str, spec) -> list[tuple[str, dict, str]]:
    """(route, body, the param the 400 names) for every field that takes a constraint of `kind`."""
    fields = []
    if kind != "json":
        guided = {"regex": "guided_regex", "grammar": "guided_grammar"}[kind]
        for route, base in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": USER})):
            fields += [(route, {**base, guided: spec}, guided),
                       (route, {**base, "structured_outputs": {kind: spec}}, "structured_outputs")]
        return fields
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": spec}}}}
    for route, base in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": USER})):
        fields += [(route, {**base, "guided_json": spec}, "guided_json"),
                   (route, {**base, "structured_outputs": {"json": json.dumps(spec)}}, "structured_outputs"),
                   (route, {**base, "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": spec}}},
                    "response_format.json_schema.schema")]
    # a tool's schema is checked where it is declared (tools.0...) and again as the forced call's grammar
    fields += [("/v1/chat/completions", {"messages": USER, "tools": [tool], "tool_choice": "required"}, "tool"),
               ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "r", "schema": spec}}},
                "text.format.schema"),
               ("/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": "f", **tool["function"]}],
                                  "tool_choice": "required"}, "tool")]
    return fields


GRAMMAR_CASES = [pytest.param(kind, spec, i, id=f"{name}-{i}") for name, (kind, spec) in HOSTILE_GRAMMARS.items()
                 for i in range(len(grammar_fields(kind, spec)))]


@pytest.mark.parametrize("kind, spec, index", GRAMMAR_CASES)
@pytest.mark.parametrize("stream", [False, True])
def test_hostile_grammars_in_any_field_are_a_400_before_queueing(live, kind, spec, index, stream):
    """Including grammars that pass llguidance's validation and break a limit only once tokens
    arrive: the first tokens are walked at admission, so nothing is queued and nothing streams."""
    route, body, param = grammar_fields(kind, spec)[index]
    tokens_field = "max_output_tokens" if route == "/v1/responses" else "max_tokens"
    error = assert_4xx(post(live, route, {**body, tokens_field: 8, "stream": stream}))
    if spec is DEEP_SCHEMA:  # a schema in the body makes the body too deep; as JSON text, the text
        assert "levels deep; at most 100 are accepted" in error["message"], error
    else:
        assert (error["param"] or "").startswith(param), error
    assert live.engine.get_stats().scheduler.num_waiting == 0
    assert wait_until(live.is_idle, 10) and not live.engine.is_dead


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_breaking_a_limit_while_running_ends_its_request_as_a_400(live, monkeypatch, stream):
    """Past the tokens walked at admission (none here), a limit broken mid-generation ends that
    request alone: a 400 in one line (no llguidance state dump), or an error event with code 400."""
    from vllmlite.worker import structured_output

    monkeypatch.setattr(structured_output, "NUM_PROBE_TOKENS", 0, raising=False)
    body = {"prompt": "hi", "max_tokens": 8, "guided_regex": f"{'cd'[stream]}{{1000}}{{1000}}", "stream": stream}
    response = post(live, "/v1/completions", body)
    if stream:
        assert response.status_code == 200
        events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
        error = json.loads(events[-2])["error"]
        assert error["code"] == 400 and events[-1] == "[DONE]"
    else:
        error = assert_4xx(response)
    assert error["message"] == (f"the output constraint failed at token {ord('cd'[stream])}: lexer error: too many "
                                "expressions constructed")
    assert wait_until(live.is_idle, 10) and not live.engine.is_dead
    ok = post(live, "/v1/completions", {"prompt": "hi", "max_tokens": 4, "guided_regex": "[ab]{4}"})
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["text"]) == 4


# --- random hostile input -------------------------------------------------------------------------

def nested_text(depth: int, opener: str) -> str:
    """JSON text `depth` levels deep, by arrays, objects or both in turn."""
    openers = {"[": ("[", "]"), "{": ('{"k": ', "}")}
    if opener == "mixed":
        parts = [openers["[" if i % 2 else "{"] for i in range(depth)]
    else:
        parts = [openers[opener]] * depth
    return "".join(o for o, _ in parts) + "1" + "".join(c for _, c in reversed(parts))


JSON_TEXT = st.one_of(
    st.builds(nested_text, st.integers(0, 6000), st.sampled_from(["[", "{", "mixed"])),
    st.builds(lambda key, n: "{" + ", ".join(f'"{key}": {i}' for i in range(n)) + "}", st.text(max_size=3), st.integers(2, 4)),
    st.text(alphabet='[]{}":,\\ 0a', max_size=200),  # mostly not JSON
    st.builds(lambda n: json.dumps({"type": "string", "enum": ["x" * n]}), st.integers(60_000, 70_000)),
)
REGEX_ATOM = st.sampled_from(["a", "[ab]", "(a|b)", ".", "\\d", "(a+)+", "x?"])
REGEX = st.one_of(
    st.builds(lambda atom, counts: atom + "".join(f"{{{n}}}" for n in counts), REGEX_ATOM,
              st.lists(st.integers(1, 1200), min_size=1, max_size=3)),
    st.builds(lambda atom, n: "(" * n + atom + ")*" * n, REGEX_ATOM, st.integers(1, 300)),
    st.builds(lambda n: "a" * n, st.integers(60_000, 70_000)),
)
LARK = st.builds(lambda n, prefix: f'start: "{prefix}" (' + " | ".join(f'"w{i}"' for i in range(n)) + ")",
                 st.integers(1, 7000), st.text(alphabet="bc", min_size=1, max_size=12))


@settings(max_examples=examples(60), deadline=None, suppress_health_check=list(HealthCheck))
@given(st.one_of(st.tuples(st.just("json"), JSON_TEXT), st.tuples(st.just("regex"), REGEX),
                 st.tuples(st.just("grammar"), LARK)), st.data())
def test_random_hostile_specs_in_any_field_never_get_a_5xx(live, kind_and_spec, data):
    """Nested, huge, ambiguous or limit-breaking input, in a field drawn from every one that takes
    it: any 4xx is fine, a 2xx too (llguidance may accept it), a 5xx never, and the engine stays up."""
    kind, spec = kind_and_spec
    fields = json_text_fields(spec) if kind == "json" else grammar_fields(kind, spec)
    route, body, _ = data.draw(st.sampled_from(fields))
    tokens_field = "max_output_tokens" if route == "/v1/responses" else "max_tokens"
    body = {**body, "stream": data.draw(st.booleans())} if route != "/tokenize" else body
    response = post(live, route, {**body, tokens_field: 4} if route != "/tokenize" else body)
    event(f"{kind} -> {response.status_code}")
    assert response.status_code < 500, response.text[:500]
    if response.status_code >= 400:
        assert_4xx(response, response.status_code)
    elif body.get("stream"):
        assert '"code": 5' not in response.text and '"code":5' not in response.text, response.text[-500:]
    assert wait_until(live.is_idle, 30) and not live.engine.is_dead
