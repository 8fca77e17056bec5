"""The llama-server room's parsing without a server: prompt forms, logit_bias forms, response_fields,
token pieces, and /tokenize's parse_special (which the tiny model's byte tokenizer cannot show: it
never reads special-token text)."""

from __future__ import annotations

import doctest
from types import SimpleNamespace

import pytest

from vllmlite.api.errors import APIError
from vllmlite.api.llamacpp import protocol, serving_completion, serving_tokenize
from vllmlite.api.llamacpp.protocol import LlamaCompletionRequest, parse_prompt
from vllmlite.api.llamacpp.sampling import logit_bias, sampling_params
from vllmlite.api.openai.protocol import TokenizeRequest
from vllmlite.tokenizer.byte import ByteTokenizer


@pytest.mark.parametrize("module", [protocol, serving_completion, serving_tokenize])
def test_the_worked_examples_hold(module):
    assert doctest.testmod(module).failed == 0


@pytest.mark.parametrize("value,prompts", [
    ("hi", [["hi"]]),
    ([1, 2, 3], [[1, 2, 3]]),
    (["a", "b"], [["a"], ["b"]]),        # strings only: several prompts
    ([1, "a", 2], [[1, "a", 2]]),        # ids and text mixed: one prompt
    (["a", 2], [["a", 2]]),
    ([[1, "a"], "b"], [[1, "a"], ["b"]]),
])
def test_llama_servers_prompt_forms(value, prompts):
    assert parse_prompt(value) == prompts


@pytest.mark.parametrize("value", [[], [[]], [-1], [True], [1.0], {"prompt_string": "x"}, [[1, [2]]], None])
def test_other_prompt_forms_are_refused(value):
    with pytest.raises(ValueError):
        parse_prompt(value)


def test_logit_bias_adds_up_per_token_and_false_is_the_strongest_ban():
    tokenizer = ByteTokenizer()
    assert logit_bias([["ab", -1], [97, False]], tokenizer) == {97: -100.0, 98: -1.0}
    assert logit_bias({"97": 2.5, "a": 1}, tokenizer) == {97: 3.5}  # a digit key is an id, other keys text
    assert logit_bias([["97", 1]], tokenizer) == {57: 1.0, 55: 1.0}  # in a pair, a string is always text
    for bad in ([[1, True]], [[1]], [[1, 2, 3]], {"": 1}, [["x", 101]], "x", [[-1, 1]]):
        with pytest.raises(APIError) as error:
            logit_bias(bad, tokenizer)
        assert error.value.param == "logit_bias"


def test_sampling_follows_llama_servers_spellings():
    request = LlamaCompletionRequest.model_validate({"prompt": "x", "temperature": -1, "top_k": 0, "seed": -1})
    params = sampling_params(request, ByteTokenizer(), max_tokens=None)
    assert (params.temperature, params.top_k, params.seed, params.max_tokens) == (0.0, None, None, None)
    defaults = sampling_params(LlamaCompletionRequest.model_validate({"prompt": "x"}), ByteTokenizer(), 4)
    assert (defaults.temperature, defaults.top_k, defaults.top_p, defaults.min_p) == (0.8, 40, 0.95, 0.05)


class _SpecialTextTokenizer(ByteTokenizer):
    """Reads "<s>" as special token 256 unless the span is plain text."""

    def encode(self, text, add_special_tokens=True):
        head, sep, tail = text.partition("<s>")
        if not sep:
            return super().encode(text, add_special_tokens)
        return super().encode(head, add_special_tokens) + [256] + super().encode(tail, False)

    def encode_with_plain_spans(self, text, plain_spans, add_special_tokens=False):
        return super().encode(text, add_special_tokens)


def test_tokenize_reads_special_token_text_unless_parse_special_is_false():
    ctx = SimpleNamespace(engine=SimpleNamespace(tokenizer=_SpecialTextTokenizer(), max_model_len=64))
    special = TokenizeRequest.model_validate({"content": "<s>a"})
    plain = TokenizeRequest.model_validate({"content": "<s>a", "parse_special": False})
    assert serving_tokenize.llama_tokenize(ctx, special).tokens == [256, 97]
    assert serving_tokenize.llama_tokenize(ctx, plain).tokens == list(b"<s>a")
