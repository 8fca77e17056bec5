"""`use_beam_search` on /v1/completions, through the official `openai` client against a live server on the
tiny model: the choices are the brute-force reference's beams (every beam's logprobs recomputed over its
whole sequence, no cache), streamed or not, and every field beam search cannot honour is a 400."""

from __future__ import annotations

import re

import openai
import pytest
from conftest import make_prompts
from reference import beam_search as reference_beam_search
from server_util import wait_until

from vllmlite.tokenizer import ByteTokenizer

MODEL = "random"
EOS = 257
TOKEN_ID = re.compile(r"token_id:(\d+)")
# Random prompts on which 4-wide beams end with EOS (tests/test_beam_search.py's), and one on which none do.
PROMPTS = [make_prompts(1, seed=seed)[0] for seed in (0, 4, 7)]
BEAM = {"use_beam_search": True, "return_tokens_as_token_ids": True}


def choice_token_ids(choice) -> list[int]:
    return [int(TOKEN_ID.fullmatch(token).group(1)) for token in choice.logprobs.tokens]


def expected_choices(tiny_model, width: int, max_tokens: int, include_stop: bool = False,
                     **options) -> list[tuple[list[int], str]]:
    """(output token ids, finish reason) of each prompt's reference beams, in choice order."""
    expected = []
    for prompt in PROMPTS:
        for tokens, _, reason in reference_beam_search(tiny_model, prompt, width, max_tokens, EOS, **options):
            output = tokens[len(prompt):]
            expected.append((output[:-1] if reason == "stop" and not include_stop else output, reason))
    return expected


def test_beam_search_choices_are_the_reference_beams(client, server, tiny_model):
    result = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=8, n=4, logprobs=0,
                                       extra_body=BEAM)
    expected = expected_choices(tiny_model, 4, 8)
    assert [c.index for c in result.choices] == list(range(len(PROMPTS) * 4))
    assert [(choice_token_ids(c), c.finish_reason) for c in result.choices] == expected
    assert {reason for _, reason in expected} == {"stop", "length"}  # EOS ended some beams
    tokenizer = ByteTokenizer()
    assert [c.text for c in result.choices] == [tokenizer.decode(ids, skip_special_tokens=True)
                                                for ids, _ in expected]
    assert result.usage.completion_tokens == sum(len(ids) for ids, _ in expected)
    assert wait_until(server.is_idle)  # every step's requests ended and freed their blocks


def test_length_penalty_and_include_stop_str_in_output_reach_the_search(client, tiny_model):
    result = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=8, n=4, logprobs=0, extra_body={
        **BEAM, "length_penalty": 0.0, "include_stop_str_in_output": True})
    expected = expected_choices(tiny_model, 4, 8, include_stop=True, length_penalty=0.0)
    assert [(choice_token_ids(c), c.finish_reason) for c in result.choices] == expected
    assert any(ids[-1] == EOS for ids, reason in expected if reason == "stop")
    assert expected != expected_choices(tiny_model, 4, 8, include_stop=True)  # the penalty changed the beams


def test_a_streamed_beam_search_sends_the_same_choices(client, tiny_model):
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=6, n=3, extra_body=BEAM)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=6, n=3, stream=True,
                                            extra_body=BEAM))
    streamed = {c.index: (c.text, c.finish_reason) for chunk in chunks for c in chunk.choices}
    assert streamed == {c.index: (c.text, c.finish_reason) for c in whole.choices} and len(streamed) == 3


def test_echo_and_prompt_logprobs_come_with_the_beams(client):
    result = client.completions.create(model=MODEL, prompt="hello", max_tokens=3, n=2, echo=True, logprobs=1,
                                       extra_body={**BEAM, "prompt_logprobs": 1})
    for choice in result.choices:
        assert choice.text.startswith("hello") and len(choice.logprobs.tokens) == 1 + 5 + 3  # BOS, prompt, beam
        assert choice.logprobs.token_logprobs[0] is None and None not in choice.logprobs.token_logprobs[1:]
        assert len(choice.model_extra["prompt_logprobs"]) == 6


BAD_BEAM_SEARCHES = [
    ({**BEAM, "top_p": 0.5}, "top_p"),
    ({**BEAM, "stop": ["x"]}, "stop"),
    ({**BEAM, "seed": 1}, "seed"),
    ({**BEAM, "n": 11}, "n"),                       # n is the beam width: 22 candidates pass the logprobs bound
    ({"length_penalty": 2.0}, "length_penalty"),    # means nothing without beam search
    ({**BEAM, "length_penalty": 1e300}, "length_penalty"),
    ({**BEAM, "use_beam_search": 1}, "use_beam_search"),
]


@pytest.mark.parametrize("fields,param", BAD_BEAM_SEARCHES)
def test_what_beam_search_cannot_honour_is_a_400_naming_it(client, fields, param):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body=fields)
    assert raised.value.body["param"] == param


def test_chat_has_no_beam_search(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body={"use_beam_search": True})
    assert raised.value.body["param"] == "use_beam_search" and "/v1/completions" in raised.value.body["message"]
