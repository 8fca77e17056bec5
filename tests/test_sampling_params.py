"""SamplingParams: defaults, normalization, and a ValueError naming the field for each bad value."""

import dataclasses
import math

import pytest

from vllmlite.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.best_of, p.temperature, p.top_p, p.top_k, p.min_p) == (1, None, 1.0, 1.0,
                                                                          None, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs) == (16, 0, None, None)
    assert (p.stop, p.stop_token_ids, p.logit_bias, p.seed) == ([], [], None, None)
    assert p.skip_special_tokens and not p.ignore_eos and not p.include_stop_str_in_output
    assert not p.is_greedy and not p.needs_penalties
    assert p.num_sequences == 1


@pytest.mark.parametrize("top_k, expected", [(None, None), (0, None), (-1, None), (1, 1),
                                             (50, 50)])
def test_top_k_off_spellings_normalize_to_none(top_k, expected):
    assert SamplingParams(top_k=top_k).top_k == expected


def test_stop_string_becomes_list_and_ids_become_list():
    p = SamplingParams(stop="###", stop_token_ids=(3, 4))
    assert p.stop == ["###"] and p.stop_token_ids == [3, 4]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


def test_logit_bias_digit_string_keys_become_ints():
    p = SamplingParams(logit_bias={"12": 5, 7: -100.0})
    assert p.logit_bias == {12: 5.0, 7: -100.0}
    assert all(type(k) is int for k in p.logit_bias)
    assert all(type(v) is float for v in p.logit_bias.values())


def test_int_where_float_expected_is_accepted_as_float():
    p = SamplingParams(temperature=0, top_p=1, presence_penalty=1)
    assert type(p.temperature) is float and p.is_greedy
    assert type(p.top_p) is float and type(p.presence_penalty) is float


@pytest.mark.parametrize("kwargs", [dict(presence_penalty=0.1), dict(frequency_penalty=-0.5),
                                    dict(repetition_penalty=1.2)])
def test_needs_penalties(kwargs):
    assert SamplingParams(**kwargs).needs_penalties


def test_best_of_sets_num_sequences_and_max_tokens_none_is_allowed():
    assert SamplingParams(n=2, best_of=5).num_sequences == 5
    assert SamplingParams(max_tokens=None, min_tokens=1000).max_tokens is None


def test_fields_are_assignable_and_clone_revalidates():
    p = SamplingParams()
    p.temperature, p.stop = 0, "###"
    clone = p.clone()
    assert clone is not p and clone.stop == ["###"] and type(clone.temperature) is float
    p.max_tokens = 0
    with pytest.raises(ValueError, match="max_tokens"):
        p.clone()
    assert dataclasses.replace(clone, max_tokens=100).max_tokens == 100


BAD_VALUES = [
    ("n", 0), ("n", -1), ("n", 1.0), ("n", True), ("n", "2"), ("n", None), ("n", 10**6),
    ("best_of", 0), ("best_of", 1.5), ("best_of", False), ("best_of", 10**6),
    ("presence_penalty", 2.5), ("presence_penalty", -2.01), ("presence_penalty", math.nan),
    ("presence_penalty", "0"), ("presence_penalty", True), ("presence_penalty", None),
    ("frequency_penalty", 3), ("frequency_penalty", -math.inf), ("frequency_penalty", [1]),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", math.inf),
    ("repetition_penalty", math.nan), ("repetition_penalty", False),
    ("temperature", 3.0), ("temperature", -0.1), ("temperature", math.nan),
    ("temperature", math.inf), ("temperature", "1"), ("temperature", None),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -0.5), ("top_p", math.nan), ("top_p", True),
    ("top_k", -2), ("top_k", 1.5), ("top_k", True), ("top_k", "5"),
    ("min_p", -0.1), ("min_p", 1.5), ("min_p", math.nan), ("min_p", "0.1"),
    ("seed", 1.5), ("seed", "42"), ("seed", True), ("seed", 2**64), ("seed", -(2**63) - 1),
    ("stop", ""), ("stop", [""]), ("stop", ["ok", 3]), ("stop", 5), ("stop", {"a": 1}),
    ("stop", ["x"] * 17), ("stop", [None]),
    ("stop_token_ids", 5), ("stop_token_ids", [1, -1]), ("stop_token_ids", [1.0]),
    ("stop_token_ids", [True]), ("stop_token_ids", "12"), ("stop_token_ids", [None]),
    ("include_stop_str_in_output", 1), ("include_stop_str_in_output", "true"),
    ("ignore_eos", 0), ("ignore_eos", None), ("skip_special_tokens", "no"),
    ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", 1.0), ("max_tokens", True),
    ("min_tokens", -1), ("min_tokens", 2.0), ("min_tokens", 17), ("min_tokens", None),
    ("logprobs", -1), ("logprobs", 21), ("logprobs", True), ("logprobs", 1.0),
    ("prompt_logprobs", -1), ("prompt_logprobs", 21), ("prompt_logprobs", "5"),
    ("logit_bias", {"5": 101}), ("logit_bias", {"5": -100.5}), ("logit_bias", {"5": math.nan}),
    ("logit_bias", {"x": 1}), ("logit_bias", {"-1": 1}), ("logit_bias", {"1.5": 1}),
    ("logit_bias", {" 5": 1}), ("logit_bias", {-3: 1}), ("logit_bias", {True: 1}),
    ("logit_bias", {"5": "1"}), ("logit_bias", {"5": True}), ("logit_bias", [1, 2]),
    ("logit_bias", {"5": 1, 5: 2}), ("logit_bias", {"\u0665": 1}),
]


@pytest.mark.parametrize("field, value", BAD_VALUES)
def test_bad_value_raises_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**{field: value})


def test_best_of_below_n_is_rejected():
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=3, best_of=2)


def test_error_message_states_bound_and_value():
    with pytest.raises(ValueError, match=r"temperature must be in \[0, 2\], got 3.0"):
        SamplingParams(temperature=3.0)


@pytest.mark.parametrize("kwargs, field", [
    (dict(stop_token_ids=[10]), "stop_token_ids"),
    (dict(stop_token_ids=[3, 99]), "stop_token_ids"),
    (dict(logit_bias={"10": 1.0}), "logit_bias"),
    (dict(logit_bias={12345: 1.0}), "logit_bias"),
])
def test_verify_rejects_ids_outside_vocab(kwargs, field):
    params = SamplingParams(**kwargs)
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        params.verify(vocab_size=10)


def test_verify_accepts_ids_inside_vocab_and_rejects_bad_vocab_size():
    SamplingParams(stop_token_ids=[0, 9], logit_bias={"9": 1.0, 0: -1.0}).verify(10)
    with pytest.raises(ValueError, match="vocab_size"):
        SamplingParams().verify(0)
