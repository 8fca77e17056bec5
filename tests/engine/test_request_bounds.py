"""Request bounds at their edges: the context length with max_tokens left open, and min_tokens equal
to max_tokens."""

import pytest
from conftest import run_to_completion

from vllmlite.engine.request_limits import RequestLimits
from vllmlite.sampling_params import SamplingParams

EOS = 257  # the byte tokenizer's <|eos|>
LIMITS = RequestLimits(vocab_size=259, max_model_len=16, max_num_seqs=4, num_blocks=64, block_size=4)


def test_a_prompt_filling_the_context_is_refused_when_max_tokens_is_open():
    """With max_tokens=None the output gets what the context leaves; a prompt of exactly
    max_model_len tokens leaves nothing, so it is refused rather than given 0 tokens."""
    with pytest.raises(ValueError, match="maximum context length"):
        LIMITS.check([1] * LIMITS.max_model_len, SamplingParams(max_tokens=None))


def test_one_token_short_of_the_context_leaves_room_for_one_output_token():
    assert LIMITS.check([1] * (LIMITS.max_model_len - 1), SamplingParams(max_tokens=None)) == 1


def test_min_tokens_equal_to_max_tokens_is_accepted_and_holds_eos_back(make_engine):
    """min_tokens == max_tokens is valid: exactly that many tokens, EOS suppressed until then even
    when the model strongly favours it."""
    params = SamplingParams(temperature=0, min_tokens=5, max_tokens=5, logit_bias={EOS: 100.0})
    (out,) = run_to_completion(make_engine(), [([1, 2, 3], params)])
    assert len(out.outputs[0].token_ids) == 5 and EOS not in out.outputs[0].token_ids
    assert out.outputs[0].finish_reason == "length"
