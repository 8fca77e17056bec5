"""Appending a step's tokens and stopping (vllmlite/core/stop.py): the one-pass path of samples with
no grammar and no logprobs keeps exactly the tokens, and returns exactly the stop, of the token by
token path (check_stop after each append), over every combination of limits and stop tokens."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from vllmlite.core import stop as stop_module
from vllmlite.core.request import FinishReason, Request
from vllmlite.sampling_params import SamplingParams

EOS = frozenset({0, 1})


def one_by_one(request: Request, token_ids: list[int], max_model_len: int) -> stop_module.Stop | None:
    """The definition: each token appended, then check_stop."""
    for token_id in token_ids:
        request.append_token(token_id)
        stop = stop_module.check_stop(request, token_id, EOS, max_model_len)
        if stop is not None:
            return stop
    return None


def request_with(prompt_len: int, outputs: list[int], max_tokens: int, **params) -> Request:
    request = Request("r", list(range(10, 10 + prompt_len)), SamplingParams(max_tokens=max_tokens, **params),
                      max_tokens, np.random.default_rng(0))
    request.extend_tokens(outputs)
    return request


@given(prompt_len=st.integers(1, 6), done=st.lists(st.integers(0, 5), max_size=4),
       tokens=st.lists(st.integers(0, 5), max_size=10), max_tokens=st.integers(1, 12),
       max_model_len=st.integers(2, 20), min_tokens=st.integers(0, 8), ignore_eos=st.booleans(),
       stop_ids=st.sampled_from([None, [3], [2, 5]]))
def test_the_one_pass_append_keeps_and_stops_as_the_token_by_token_one(prompt_len, done, tokens, max_tokens,
                                                                        max_model_len, min_tokens, ignore_eos,
                                                                        stop_ids):
    params = dict(min_tokens=min(min_tokens, max_tokens), ignore_eos=ignore_eos, stop_token_ids=stop_ids)
    expected_request = request_with(prompt_len, done, max_tokens, **params)
    expected = one_by_one(expected_request, tokens, max_model_len)
    request = request_with(prompt_len, done, max_tokens, **params)
    got = stop_module.append_tokens(request, tokens, None, EOS, max_model_len)
    assert got == expected
    assert request.token_ids == expected_request.token_ids
    assert request.output_token_ids == expected_request.output_token_ids


def test_a_stop_token_on_the_last_allowed_token_is_a_stop_not_a_length():
    request = request_with(2, [], max_tokens=3)
    assert stop_module.append_tokens(request, [7, 8, 0, 9], None, EOS, 100) == stop_module.Stop(FinishReason.STOP)
    assert request.output_token_ids == [7, 8, 0]
    request = request_with(2, [], max_tokens=3, stop_token_ids=[8])
    assert stop_module.append_tokens(request, [7, 8, 5], None, EOS, 100) == stop_module.Stop(FinishReason.STOP, 8)
    request = request_with(2, [], max_tokens=3)
    assert stop_module.append_tokens(request, [7, 8, 5, 6], None, EOS, 100) == stop_module.Stop(FinishReason.LENGTH)
    assert request.output_token_ids == [7, 8, 5]
