"""`truncate_prompt_tokens` with vLLM's `truncation_side` on the completions and chat routes: "right"
keeps the prompt's first tokens, "left" (and no side, vLLM's default for generation) its last ones. The
kept prompt is what the engine runs on, what return_token_ids reports and what usage counts; checked
through the official `openai` client against the offline engine."""

from __future__ import annotations

import openai
import pytest
from conftest import engine_on, greedy, run_to_completion

MODEL = "random"
PROMPT = [104, 101, 108, 108, 111, 32, 119, 111]  # "hello wo" as byte tokens
KEEP = 4


def offline_text(tiny_model, prompt_ids: list[int], max_tokens: int) -> list[int]:
    (output,) = run_to_completion(engine_on(tiny_model), [(prompt_ids, greedy(max_tokens=max_tokens))])
    return list(output.outputs[0].token_ids)


def complete(client, side: str | None, **extra):
    body = {"return_token_ids": True, "ignore_eos": True, "truncate_prompt_tokens": KEEP, **extra}
    if side is not None:
        body["truncation_side"] = side
    return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0.0, extra_body=body)


@pytest.mark.parametrize(("side", "kept"), [("right", PROMPT[:KEEP]), ("left", PROMPT[-KEEP:]), (None, PROMPT[-KEEP:])])
def test_completion_keeps_the_side_asked_for(client, tiny_model, side, kept):
    result = complete(client, side)
    choice = result.choices[0]
    assert choice.prompt_token_ids == kept
    assert choice.token_ids == offline_text(tiny_model, kept, 3)  # the engine ran on the kept tokens
    assert result.usage.prompt_tokens == KEEP


def test_completion_echo_shows_the_kept_prompt(client):
    def text(echo: bool) -> str:
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0.0, echo=echo,
                                         extra_body={"truncate_prompt_tokens": KEEP, "truncation_side": "right",
                                                     "ignore_eos": True}).choices[0].text

    assert text(echo=True) == bytes(PROMPT[:KEEP]).decode() + text(echo=False)


def test_completion_stream_reports_the_kept_prompt(client):
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0.0, stream=True,
                                       extra_body={"truncate_prompt_tokens": KEEP, "truncation_side": "right",
                                                   "return_token_ids": True, "ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].prompt_token_ids == PROMPT[:KEEP]


def chat_prompt_ids(client, **extra) -> list[int]:
    result = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello there"}],
                                            max_tokens=1, temperature=0.0,
                                            extra_body={"return_token_ids": True, **extra})
    return result.prompt_token_ids


def test_chat_keeps_the_side_asked_for(client):
    full = chat_prompt_ids(client)
    assert len(full) > KEEP
    assert chat_prompt_ids(client, truncate_prompt_tokens=KEEP, truncation_side="right") == full[:KEEP]
    assert chat_prompt_ids(client, truncate_prompt_tokens=KEEP, truncation_side="left") == full[-KEEP:]
    assert chat_prompt_ids(client, truncate_prompt_tokens=KEEP) == full[-KEEP:]
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello there"}],
                                            max_tokens=1, stream=True,
                                            extra_body={"return_token_ids": True, "truncate_prompt_tokens": KEEP,
                                                        "truncation_side": "right"})
    assert next(iter(stream)).prompt_token_ids == full[:KEEP]


def test_side_without_truncation_changes_nothing(client):
    result = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0.0,
                                       extra_body={"truncation_side": "right", "return_token_ids": True})
    assert result.choices[0].prompt_token_ids == PROMPT


def test_unknown_side_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as error:
        complete(client, "middle")
    assert error.value.body["param"] == "truncation_side"
