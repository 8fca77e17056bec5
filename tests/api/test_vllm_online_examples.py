"""vLLM's online example clients (examples/online_serving: openai_chat_completion_client.py,
openai_completion_client.py, openai_chat_completion_client_with_tools.py (and _required),
structured_outputs/structured_outputs.py, openai_responses_client.py, openai_embedding_client.py)
against a live vllmlite server on the tiny random model, with only the base URL and model name
changed: each test walks its example's requests with the official `openai` client, as the example
sends them, and checks what the example reads. (Their code is theirs; these are our own tests.)"""

from __future__ import annotations

import asyncio
import enum
import json
import re
from typing import Any

import openai
import pydantic
import pytest

API_KEY = "EMPTY"
PROPERTIES = {
    "city": {"type": "string", "description": "The city to find the weather for, e.g. 'San Francisco'"},
    "state": {"type": "string", "description": "the two-letter abbreviation for the state that the city is in"},
    "unit": {"type": "string", "description": "The unit to fetch the temperature in",
             "enum": ["celsius", "fahrenheit"]},
}
TOOLS = [{"type": "function", "function": {
    "name": "get_current_weather", "description": "Get the current weather in a given location",
    "parameters": {"type": "object", "properties": PROPERTIES, "required": ["city", "state", "unit"]}}}]
# The _required run bounds the strings, so that the random model's call ends within max_tokens.
BOUNDED_TOOLS = [{"type": "function", "function": {**TOOLS[0]["function"], "parameters": {
    **TOOLS[0]["function"]["parameters"],
    "properties": {**PROPERTIES, "city": {**PROPERTIES["city"], "maxLength": 8},
                   "state": {**PROPERTIES["state"], "maxLength": 2}}}}}]
TOOL_MESSAGES = [
    {"role": "user", "content": "Hi! How are you doing today?"},
    {"role": "assistant", "content": "I'm doing well! How can I help you?"},
    {"role": "user", "content": "Can you tell me what the temperate will be in Dallas, in fahrenheit?"},
]


@pytest.fixture
def example_client(server) -> openai.OpenAI:
    return openai.OpenAI(api_key=API_KEY, base_url=server.base_url)


def first_model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_chat_completion_client(example_client):
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Who won the world series in 2020?"},
                {"role": "assistant", "content": "The Los Angeles Dodgers won the World Series in 2020."},
                {"role": "user", "content": "Where was it played?"}]
    chat = example_client.chat.completions.create(messages=messages, model=first_model(example_client))
    print(chat)
    assert isinstance(chat.choices[0].message.content, str) and chat.choices[0].message.reasoning is None


def test_completion_client_streams(example_client):
    stream = example_client.completions.create(model=first_model(example_client),
                                               prompt="A robot may not injure a human being", echo=False, stream=True)
    chunks = list(stream)
    for chunk in chunks:
        print(chunk)
    # Not a chunk count: when the engine runs ahead of a slow reader (a loaded machine), the request
    # stream coalesces the outputs the reader has not taken, down to one chunk (request_stream.py).
    assert chunks and all(len(c.choices) == 1 for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) and chunks[-1].choices[0].finish_reason in ("stop", "length")


def get_current_weather(city: str, state: str, unit: str) -> str:
    return "The weather in Dallas, Texas is 85 degrees fahrenheit. It is partly cloudly, with highs in the 90's."


def stream_tool_call_arguments(client: openai.OpenAI, messages: list, model: str, tools: list,
                               **extra: Any) -> list[str]:
    """The example's streamed half: print each chunk's first tool call (or its delta), then join
    each call's argument fragments by the call's index."""
    arguments: list[str] = []
    call_index = -1
    for chunk in client.chat.completions.create(messages=messages, model=model, tools=tools, stream=True, **extra):
        delta = chunk.choices[0].delta
        print(delta.tool_calls[0] if delta.tool_calls else delta)
        if delta.tool_calls:
            call = delta.tool_calls[0]
            if call.index != call_index:
                call_index = call.index
                arguments.append("")
            if call.function and call.function.arguments:
                arguments[call_index] += call.function.arguments
    return arguments


@pytest.mark.parametrize("tool_choice", [None, "required"])
def test_chat_completion_client_with_tools(example_client, tool_choice):
    """openai_chat_completion_client_with_tools.py (tool_choice left out: the random model answers
    in text), and its _required sibling (the model must call, and the call goes round)."""
    client, messages = example_client, [dict(m) for m in TOOL_MESSAGES]
    model = first_model(client)
    tools = TOOLS if tool_choice is None else BOUNDED_TOOLS
    extra = {} if tool_choice is None else {"tool_choice": tool_choice, "max_tokens": 300}
    chat = client.chat.completions.create(messages=messages, model=model, tools=tools, **extra)
    arguments = stream_tool_call_arguments(client, messages, model, tools, **extra)
    message = chat.choices[0].message
    messages.append({"role": "assistant", "tool_calls": message.tool_calls, "reasoning": message.reasoning})
    for call in message.tool_calls:
        result = {"get_current_weather": get_current_weather}[call.function.name](**json.loads(call.function.arguments))
        messages.append({"role": "tool", "content": result, "tool_call_id": call.id, "name": call.function.name})
    second = client.chat.completions.create(messages=messages, model=model, tools=tools, stream=False)
    assert second.choices[0].message.reasoning is None
    if tool_choice == "required":
        assert [c.function.name for c in message.tool_calls] == ["get_current_weather"]
        assert [json.loads(a) for a in arguments] and all(set(json.loads(a)) == set(PROPERTIES) for a in arguments)
        assert messages[-1]["role"] == "tool"


class CarType(str, enum.Enum):
    SEDAN = "SEDAN"
    SUV = "SUV"
    TRUCK = "TRUCK"
    COUPE = "COUPE"


class CarDescription(pydantic.BaseModel):
    brand: str
    model: str
    car_type: CarType


SQL = """
root ::= select_statement

select_statement ::= "SELECT " column " from " table " where " condition

column ::= "col_1 " | "col_2 "

table ::= "table_1 " | "table_2 "

condition ::= column "= " number

number ::= "1 " | "2 "
"""
FUNCTION_PROMPT = """You have access to the following function to retrieve the weather in a city: get_weather.
If you choose to call a function ONLY reply in the following format:
<function=example_function_name>{"example_name": "example_value"}</function>
Given the previous instructions, what is the weather in New York City, Boston, and San Francisco?"""
# structured_outputs.py's requests: every constraint kind, sent together by its default run
CONSTRAINTS: dict[str, dict[str, Any]] = {
    "choice": {"messages": [{"role": "user", "content": "Classify this sentiment: vLLM is wonderful!"}],
               "extra_body": {"structured_outputs": {"choice": ["positive", "negative"]}}},
    "regex": {"messages": [{"role": "user", "content": "Generate an email address for Alan Turing, who works in "
                                                       "Enigma. End in .com and new line."}],
              "extra_body": {"structured_outputs": {"regex": r"[a-z0-9.]{1,20}@\w{6,10}\.com\n"}}},
    "json": {"messages": [{"role": "user", "content": "Generate a JSON with the brand, model and car_type of the "
                                                      "most iconic car from the 90's"}],
             "response_format": {"type": "json_schema", "json_schema": {
                 "name": "car-description", "schema": CarDescription.model_json_schema()}}},
    "grammar": {"messages": [{"role": "user", "content": "Generate an SQL query."}],
                "extra_body": {"structured_outputs": {"grammar": SQL}}},
    "structural_tag": {"messages": [{"role": "user", "content": FUNCTION_PROMPT}],
                       "response_format": {"type": "structural_tag", "triggers": ["<function="], "structures": [
                           {"begin": "<function=get_weather>", "end": "</function>",
                            "schema": {"type": "object", "properties": {"city": {"type": "string"}},
                                       "required": ["city"]}}]}},
}
# the older guided_* spelling of the same requests (vLLM's earlier example)
GUIDED = {"choice": {"guided_choice": ["positive", "negative"]},
          "regex": {"guided_regex": r"[a-z0-9.]{1,20}@\w{6,10}\.com\n"}, "grammar": {"guided_grammar": SQL}}


def check_constraint(name: str, content: str, finish_reason: str) -> None:
    if name == "choice":
        assert content in ("positive", "negative")
    elif name == "grammar":
        assert re.fullmatch(r"SELECT col_[12]  from table_[12]  where col_[12] = [12] ", content)
    elif name == "regex" and finish_reason == "stop":
        assert re.fullmatch(r"[a-z0-9.]{1,20}@\S{6,10}\.com\n", content)
    elif name == "json" and finish_reason == "stop":
        CarDescription.model_validate_json(content)


@pytest.mark.parametrize("stream", [False, True])
def test_structured_outputs_client_runs_every_constraint_at_once(server, stream):
    async def run() -> dict[str, tuple[str, str]]:
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY)
        model = (await client.models.list()).data[0].id
        requests = [client.chat.completions.create(model=model, max_tokens=1024, stream=stream, **params)
                    for params in CONSTRAINTS.values()]
        results = await asyncio.gather(*requests)
        answers = {}
        for name, result in zip(CONSTRAINTS, results):
            if stream:
                content, finish = "", None
                async for chunk in result:
                    delta = chunk.choices[0].delta
                    assert getattr(delta, "reasoning", None) is None
                    content += delta.content or ""
                    finish = chunk.choices[0].finish_reason or finish
            else:
                message = result.choices[0].message
                assert message.reasoning is None
                content, finish = message.content, result.choices[0].finish_reason
            answers[name] = content, finish
        return answers

    answers = asyncio.run(run())
    assert set(answers) == set(CONSTRAINTS)
    for name, (content, finish) in answers.items():
        check_constraint(name, content, finish)


@pytest.mark.parametrize("name", sorted(GUIDED))
def test_the_guided_spelling_of_the_older_example(example_client, name):
    chat = example_client.chat.completions.create(model=first_model(example_client), max_tokens=64,
                                                  messages=CONSTRAINTS[name]["messages"], extra_body=GUIDED[name])
    check_constraint(name, chat.choices[0].message.content, chat.choices[0].finish_reason)


def test_responses_client(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="empty", timeout=60.0, max_retries=3)
    input_messages: list[Any] = [{"role": "user", "content": "What model are you?"}]
    response = client.responses.create(model="random", input=input_messages)
    for message in response.output:
        if message.type == "reasoning":
            input_messages.append(message)
    second = client.responses.create(model="random", input=input_messages)
    print(second.output_text)
    assert response.status in ("completed", "incomplete") and isinstance(second.output_text, str)


def test_embedding_client(example_client):
    responses = example_client.embeddings.create(
        input=["Hello my name is", "The best thing about vLLM is that it supports many different models"],
        model=first_model(example_client))
    for data in responses.data:
        print(data.embedding)
    assert [d.index for d in responses.data] == [0, 1] and all(len(d.embedding) == 64 for d in responses.data)
