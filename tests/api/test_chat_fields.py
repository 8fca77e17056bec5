"""Chat fields at their edges over HTTP: tool calls cut by the token limit, max_completion_tokens
beside max_tokens, and every chat-only field we refuse."""

from __future__ import annotations

import json
import re

import openai
import pytest

MODEL = "random"
USER = [{"role": "user", "content": "What time is it?"}]
CLOCK = [{"type": "function", "function": {"name": "clock", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
    "additionalProperties": False}}}]
CALL = '<tool_call>\n{"name": "clock", "arguments": {"tz": "UTC"}}\n</tool_call>'
# The random model writes one complete call (forced by the regex), then letters until cut off.
CALL_THEN_TEXT = {"regex": re.escape(CALL) + "[a-z]{50}"}


@pytest.mark.parametrize("stream", [False, True])
def test_a_complete_tool_call_cut_by_max_tokens_keeps_finish_reason_length(client, stream):
    """A call was made, but the output ended at max_tokens, not by choice: "length", not "tool_calls"."""
    max_tokens = len(CALL) + 5  # byte tokens: the call, then five of the letters
    chat = client.chat.completions.create(model=MODEL, messages=USER, tools=CLOCK, tool_choice="auto",
                                          temperature=0, max_tokens=max_tokens, stream=stream,
                                          extra_body={"structured_outputs": CALL_THEN_TEXT})
    if stream:
        chunks = [c for c in chat if c.choices]
        calls = [call for c in chunks for call in c.choices[0].delta.tool_calls or ()]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
        assert [call.function.name for call in calls if call.function.name] == ["clock"]
        assert finish == ["length"]
    else:
        choice = chat.choices[0]
        (call,) = choice.message.tool_calls
        assert call.function.name == "clock" and json.loads(call.function.arguments) == {"tz": "UTC"}
        assert choice.finish_reason == "length" and chat.usage.completion_tokens == max_tokens


def test_a_complete_tool_call_that_ends_the_output_is_finish_reason_tool_calls(client):
    """The counterpart: the same call with nothing after it ends by choice."""
    chat = client.chat.completions.create(model=MODEL, messages=USER, tools=CLOCK, tool_choice="auto",
                                          temperature=0, max_tokens=200,
                                          extra_body={"structured_outputs": {"regex": re.escape(CALL)}})
    assert chat.choices[0].finish_reason == "tool_calls" and len(chat.choices[0].message.tool_calls) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_max_completion_tokens_wins_over_max_tokens(client, stream):
    """Given both, max_completion_tokens (OpenAI's current name) is the limit, larger or smaller."""
    for max_tokens, max_completion_tokens in ((3, 7), (7, 3)):
        chat = client.chat.completions.create(model=MODEL, messages=USER, temperature=0, stream=stream,
                                              max_tokens=max_tokens, max_completion_tokens=max_completion_tokens,
                                              extra_body={"ignore_eos": True},
                                              stream_options={"include_usage": True} if stream else openai.NOT_GIVEN)
        usage = [c for c in chat if c.usage][-1].usage if stream else chat.usage
        assert usage.completion_tokens == max_completion_tokens


@pytest.mark.parametrize(("name", "value"), [
    ("continue_final_message", True),
    ("documents", [{"title": "t", "text": "d"}]),
    ("echo", True),
])
def test_each_refused_chat_field_is_a_400_naming_it(client, name, value):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1, extra_body={name: value})
    assert raised.value.body["param"] == name and name in raised.value.body["message"]
