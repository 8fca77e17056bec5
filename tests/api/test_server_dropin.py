"""vLLM drop-in details of the chat and completions routes (issue 33, second round).
Through the official `openai` client (raw httpx where a key's presence is the point)."""

from __future__ import annotations

import json

import httpx

MODEL = "random"
USER = [{"role": "user", "content": "hi"}]


# --- 1. the message's `reasoning` ---------------------------------------------------------------------

def test_a_chat_message_always_carries_reasoning_null(server, client):
    body = httpx.post(server.base_url + "/chat/completions",
                      json={"messages": USER, "max_tokens": 2}).json()
    message = body["choices"][0]["message"]
    assert "reasoning" in message and message["reasoning"] is None
    # vLLM's tools example reads the attribute and sends it back in the next turn's assistant message.
    chat = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2)
    assert chat.choices[0].message.reasoning is None
    follow_up = [*USER, {"role": "assistant", "content": chat.choices[0].message.content,
                         "reasoning": chat.choices[0].message.reasoning}, {"role": "user", "content": "and?"}]
    assert client.chat.completions.create(model=MODEL, messages=follow_up, max_tokens=2).choices


def test_a_streamed_delta_has_no_reasoning_unless_there_is_some(server):
    with httpx.stream("POST", server.base_url + "/chat/completions",
                      json={"messages": USER, "max_tokens": 3, "stream": True}) as response:
        deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in response.iter_lines()
                  if line.startswith("data: {")]
    assert deltas and not any("reasoning" in d for d in deltas)
