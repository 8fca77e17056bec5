"""SamplingParams as a vLLM user's script uses it: assigning fields, top_k spellings, allowed_token_ids,
bad_words, truncate_prompt_tokens, detokenize, and unsupported vLLM fields, through `LLM("random")`.

The random model's tokenizer is bytes (ids 0..255, BOS 256, EOS 257), so the text "ab" is the
tokens [97, 98]: multi-token bad words need no real model.
"""

from __future__ import annotations

import numpy as np
import openai
import pytest
from server_util import running_server

from vllmlite import LLM, SamplingParams
from vllmlite.tokenizer import ByteTokenizer
from vllmlite.worker.sampling import Sampler, SamplingBatch, make_generator

MAX_MODEL_LEN = 64
PROMPT = "hello"
A, B = ord("a"), ord("b")


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("random", num_blocks=256, max_model_len=MAX_MODEL_LEN)


def token_ids(llm: LLM, params: SamplingParams, prompt: str | dict = PROMPT) -> list[int]:
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids


def greedy(max_tokens: int = 8, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


# --- assigning fields -----------------------------------------------------------------------------

def test_fields_assigned_after_construction_are_used(llm):
    params = SamplingParams()
    params.temperature = 0
    params.max_tokens = 5
    params.ignore_eos = True
    assert token_ids(llm, params) == token_ids(llm, greedy(5))


def test_stop_assigned_as_a_string_is_one_stop_string(llm):
    letters = [ord(c) for c in "abc"]
    text = llm.generate(PROMPT, greedy(16, allowed_token_ids=letters), use_tqdm=False)[0].outputs[0].text
    stop = text[4:6]
    params = greedy(16, allowed_token_ids=letters)
    params.stop = stop  # a str: one stop string, not one per character
    output = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert output.text == text[:text.index(stop)] and output.stop_reason == stop


@pytest.mark.parametrize("field, value", [("temperature", 5.0), ("top_k", -2), ("max_tokens", 0),
                                          ("allowed_token_ids", []), ("stop", 3)])
def test_invalid_value_assigned_later_is_rejected_at_generate(llm, field, value):
    params = greedy()
    setattr(params, field, value)
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        llm.generate(PROMPT, params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_token_id_outside_the_vocabulary_is_rejected_at_generate(llm):
    with pytest.raises(ValueError, match=r"^allowed_token_ids: token id 300 is outside"):
        llm.generate(PROMPT, greedy(allowed_token_ids=[5, 300]), use_tqdm=False)


def test_mutating_params_after_add_request_does_not_change_the_running_request(llm):
    engine = llm.engine
    expected = token_ids(llm, greedy(6))
    params = greedy(6)
    engine.add_request("mutated", PROMPT, params)
    params.max_tokens = 1
    params.temperature = 1.0
    params.allowed_token_ids = [A]
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == expected


# --- top_k ----------------------------------------------------------------------------------------

def test_top_k_none_zero_and_minus_one_all_mean_off(llm):
    seeded = dict(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    off = [token_ids(llm, SamplingParams(top_k=k, **seeded)) for k in (None, 0, -1)]
    assert off[0] == off[1] == off[2]
    assert token_ids(llm, SamplingParams(top_k=1, **seeded)) == token_ids(llm, greedy(16))
    assert off[0] != token_ids(llm, greedy(16))  # so top_k=1 above did restrict something


# --- allowed_token_ids ----------------------------------------------------------------------------

def test_allowed_token_ids_restrict_every_sampled_token(llm):
    allowed = {ord(c) for c in "vllm"}
    seeded = dict(temperature=1.0, seed=3, max_tokens=32, ignore_eos=True)
    free = token_ids(llm, SamplingParams(**seeded))
    restricted = token_ids(llm, SamplingParams(allowed_token_ids=sorted(allowed), **seeded))
    assert not set(free) <= allowed
    assert len(restricted) == 32 and set(restricted) <= allowed and len(set(restricted)) > 1


# --- bad_words ------------------------------------------------------------------------------------

def test_one_token_bad_word_is_never_generated(llm):
    favour_a = dict(temperature=1.0, seed=1, max_tokens=16, ignore_eos=True, logit_bias={A: 100})
    assert A in token_ids(llm, SamplingParams(**favour_a))
    assert A not in token_ids(llm, SamplingParams(bad_words=["a"], **favour_a))


def test_multi_token_bad_word_masks_only_its_last_token_after_its_prefix(llm):
    a_or_b = dict(temperature=2.0, seed=3, max_tokens=32, ignore_eos=True, allowed_token_ids=[A, B])
    free = bytes(token_ids(llm, SamplingParams(**a_or_b)))
    banned = bytes(token_ids(llm, SamplingParams(bad_words=["ba"], **a_or_b)))
    assert b"ba" in free
    assert b"ba" not in banned
    assert banned.startswith(b"a") and b"b" in banned  # "a" and "b" alone are still allowed


def test_bad_word_tokens_follow_vllms_leading_space_rule():
    class WordTokenizer:
        """'hello' and ' hello' are different single tokens; ' ab' is one token longer than 'ab'."""
        vocab = {"hello": [1], " hello": [2], "ab": [3, 4], " ab": [5, 3, 4]}

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            assert not add_special_tokens
            return self.vocab[text]

    params = SamplingParams(bad_words=["hello", "  ab"])
    params.update_from_tokenizer(WordTokenizer())
    assert params.bad_words_token_ids == [[1], [2], [3, 4]]
    byte_params = SamplingParams(bad_words=["ab"])
    byte_params.update_from_tokenizer(ByteTokenizer())
    assert byte_params.bad_words_token_ids == [[A, B]]


@pytest.mark.parametrize("output, masked", [([], False), ([5], False), ([7, 5], False), ([1, 5, 7], True),
                                            ([5, 7], True)])
def test_sampler_masks_a_bad_words_last_token_only_after_its_prefix(output, masked):
    params = SamplingParams(temperature=0.0, bad_words=["\x05\x07\x08"])
    params.update_from_tokenizer(ByteTokenizer())  # [[5, 7, 8]]
    logits = np.zeros((1, 12))  # [1, vocab]
    logits[0, 8] = 1.0  # the argmax, unless masked
    batch = SamplingBatch(params=[params], prompt_token_ids=[[1]], output_token_ids=[output],
                          generators=[make_generator(0)])
    assert (int(Sampler()(logits, batch).token_ids[0]) != 8) == masked


# --- truncate_prompt_tokens -----------------------------------------------------------------------

def test_truncate_prompt_tokens_keeps_the_last_k_prompt_tokens(llm):
    prompt = list(range(40, 60))
    output = llm.generate({"prompt_token_ids": prompt}, greedy(truncate_prompt_tokens=5), use_tqdm=False)[0]
    assert output.prompt_token_ids == prompt[-5:]
    assert output.outputs[0].token_ids == token_ids(llm, greedy(), {"prompt_token_ids": prompt[-5:]})
    assert output.outputs[0].token_ids != token_ids(llm, greedy(), {"prompt_token_ids": prompt})


def test_truncation_happens_before_the_context_length_check(llm):
    long_prompt = {"prompt_token_ids": [97] * (MAX_MODEL_LEN + 10)}
    with pytest.raises(ValueError, match="maximum context"):
        llm.generate(long_prompt, greedy(), use_tqdm=False)
    output = llm.generate(long_prompt, greedy(truncate_prompt_tokens=10), use_tqdm=False)[0]
    assert len(output.prompt_token_ids) == 10 and len(output.outputs[0].token_ids) == 8


# --- detokenize -----------------------------------------------------------------------------------

def test_detokenize_false_gives_token_ids_and_empty_text(llm):
    with_text = llm.generate(PROMPT, greedy(), use_tqdm=False)[0].outputs[0]
    ids_only = llm.generate(PROMPT, greedy(detokenize=False), use_tqdm=False)[0].outputs[0]
    assert with_text.text != "" and ids_only.text == ""
    assert ids_only.token_ids == with_text.token_ids


def test_stop_strings_need_detokenize():
    with pytest.raises(ValueError, match="^stop strings are only supported when detokenize is True"):
        SamplingParams(stop="###", detokenize=False)
    params = SamplingParams(detokenize=False)
    params.stop = ["###"]
    with pytest.raises(ValueError, match="^stop"):
        params.clone()


# --- construction ---------------------------------------------------------------------------------

@pytest.mark.parametrize("field", ["guided_decoding", "logits_processors", "output_kind",
                                   "extra_args", "spaces_between_special_tokens"])
def test_unsupported_vllm_field_raises_naming_it(field):
    with pytest.raises(TypeError, match=rf"{field} is a vLLM field that vllmlite does not support"):
        SamplingParams(**{field: None})


def test_unknown_argument_raises_naming_it():
    with pytest.raises(TypeError, match="unexpected keyword argument 'temprature'"):
        SamplingParams(temprature=0.5)


@pytest.mark.parametrize("field, value", [
    ("allowed_token_ids", []), ("allowed_token_ids", [-1]), ("allowed_token_ids", "12"),
    ("allowed_token_ids", [1.0]), ("bad_words", [""]), ("bad_words", ["  "]), ("bad_words", [3]),
    ("bad_words", 5), ("truncate_prompt_tokens", 0), ("truncate_prompt_tokens", -1),
    ("truncate_prompt_tokens", 1.5), ("detokenize", 1), ("detokenize", None),
])
def test_bad_value_of_a_new_field_raises_naming_it(field, value):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**{field: value})


def test_new_fields_have_vllms_defaults_and_normalize():
    p = SamplingParams()
    assert (p.allowed_token_ids, p.bad_words, p.truncate_prompt_tokens, p.detokenize) == (None, None, None, True)
    p = SamplingParams(allowed_token_ids=(3, 4), bad_words="ab")
    assert p.allowed_token_ids == [3, 4] and p.bad_words == ["ab"]


# --- HTTP server ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def client(tiny_model):
    with running_server(tiny_model) as live:
        yield openai.OpenAI(base_url=live.base_url, api_key="unused", max_retries=0, timeout=60)


def test_server_maps_vllm_extras_to_sampling_params(client):
    def completion(**extra) -> str:
        body = {"ignore_eos": True, **extra}
        result = client.completions.create(model="random", prompt=PROMPT, max_tokens=12, temperature=1.0,
                                           seed=5, extra_body=body)
        return result.choices[0].text

    assert completion() == completion(top_k=0) == completion(top_k=-1)
    assert set(completion(allowed_token_ids=[A, B])) <= {"a", "b"}
    assert "a" not in completion(allowed_token_ids=[A, B], bad_words=["a"])
    chat = client.chat.completions.create(model="random", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, extra_body={"truncate_prompt_tokens": 3})
    assert chat.usage.prompt_tokens == 3


def test_server_rejects_a_bad_extra_with_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="random", prompt=PROMPT, max_tokens=4,
                                  extra_body={"allowed_token_ids": []})
    assert error.value.body["param"] == "allowed_token_ids"
