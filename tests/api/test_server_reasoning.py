"""--reasoning-parser over HTTP with the official `openai` client: the random model writes a known
output (forced by a regex; one byte per token, so every tag arrives cut into pieces), and the chat
route sends its reasoning as `reasoning` and the rest as `content`, whole and streamed."""

from __future__ import annotations

import json
import re

import pytest
from server_util import running_server

from vllmlite.api.cli import ServerArgs

MODEL = "random"
USER = [{"role": "user", "content": "Capital of France?"}]
THOUGHT, ANSWER = "The user asks about France; its capital is Paris.", "Paris."


@pytest.fixture(scope="module", params=["deepseek_r1", "qwen3"])
def server(request, tiny_model):
    with running_server(tiny_model, reasoning_parser=request.param) as live:
        yield live


def chat(client, output: str, stream: bool, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=kwargs.pop("messages", USER), temperature=0,
                                          max_tokens=len(output.encode()) + 8, stream=stream,
                                          extra_body={"structured_outputs": {"regex": re.escape(output)},
                                                      **kwargs.pop("extra_body", {})}, **kwargs)


def collected(chunks) -> tuple[str, str, list[tuple[str, str]]]:
    """(reasoning, content) a client assembles from the deltas, and each delta's pair in order."""
    pairs = [(getattr(c.choices[0].delta, "reasoning", None) or "", c.choices[0].delta.content or "")
             for c in chunks if c.choices]
    return "".join(r for r, _ in pairs), "".join(c for _, c in pairs), [p for p in pairs if p != ("", "")]


@pytest.mark.parametrize("output", [f"<think>{THOUGHT}</think>{ANSWER}", f"{THOUGHT}</think>{ANSWER}"])
def test_reasoning_and_content_are_split_whole_and_streamed(client, output):
    """With the model's own <think> or with the one the template wrote (the output starts inside)."""
    message = chat(client, output, stream=False).choices[0].message
    assert (message.reasoning, message.content) == (THOUGHT, ANSWER)
    assert "reasoning_content" not in message.model_dump()  # vLLM's current name only
    reasoning, content, pairs = collected(chat(client, output, stream=True))
    assert (reasoning, content) == (THOUGHT, ANSWER)
    last_reasoning = max(i for i, (r, _) in enumerate(pairs) if r)
    first_content = min(i for i, (_, c) in enumerate(pairs) if c)
    assert last_reasoning < first_content  # content only after the end tag


def test_unfinished_reasoning_is_all_reasoning(client):
    message = chat(client, f"<think>{THOUGHT}", stream=False).choices[0].message
    assert (message.reasoning, message.content) == (THOUGHT, None)


def test_reasoning_then_a_tool_call(client):
    tools = [{"type": "function", "function": {"name": "capital", "parameters": {
        "type": "object", "properties": {"country": {"type": "string"}}}}}]
    call = '<tool_call>\n{"name": "capital", "arguments": {"country": "France"}}\n</tool_call>'
    result = chat(client, f"{THOUGHT}</think>{call}", stream=False, tools=tools).choices[0]
    assert result.message.reasoning == THOUGHT and result.finish_reason == "tool_calls"
    (made,) = result.message.tool_calls
    assert made.function.name == "capital" and json.loads(made.function.arguments) == {"country": "France"}


def test_qwen3_without_thinking_is_all_content(server, client):
    output = f"{ANSWER} <think>"
    no_thinking = {"chat_template_kwargs": {"enable_thinking": False}}
    message = chat(client, output, stream=False, extra_body=no_thinking).choices[0].message
    if server.config.reasoning_parser == "qwen3":
        assert (message.reasoning, message.content) == (None, output)
        assert collected(chat(client, output, stream=True, extra_body=no_thinking))[:2] == ("", output)
    else:  # deepseek_r1 has no switch: an unclosed block is reasoning
        assert (message.reasoning, message.content) == (output.replace("<think>", ""), None)


def test_unknown_reasoning_parser_is_refused_at_start():
    with pytest.raises(ValueError, match=r"reasoning_parser must be one of \['deepseek_r1', 'granite', "
                                         r"'mistral', 'qwen3'\], got 'r1'"):
        ServerArgs(model="random", reasoning_parser="r1")
