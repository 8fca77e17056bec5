"""RequestOutput and CompletionOutput as a vLLM user's script reads them, through `LLM("random")`:
logprobs as one {token_id: Logprob} dict per token, prompt_logprobs as [None, dict, ...], and
`CompletionOutput.finished()` as a method.
"""

from __future__ import annotations

import math

import pytest

from vllmlite import LLM, Logprob, SamplingParams
from vllmlite.outputs import Logprob as OutputsLogprob

PROMPT = "hello world"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("random", num_blocks=256, max_model_len=128)


def generate(llm: LLM, prompt: str = PROMPT, **params):
    params.setdefault("max_tokens", 12)
    params.setdefault("ignore_eos", True)
    return llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0]


def assert_position_shape(position: dict, token_id: int, k: int, token_text) -> None:
    """One position's dict: the token present with rank >= 1, k or k + 1 entries, the top k first
    with ranks 1..k and logprobs falling, each decoded as the server shows it."""
    assert token_id in position
    assert position[token_id].rank >= 1
    assert len(position) in ((k, k + 1) if k > 0 else (1,))
    if len(position) == k + 1:
        assert list(position)[-1] == token_id and position[token_id].rank > k
    top = list(position.values())[:k]
    assert [lp.rank for lp in top] == list(range(1, k + 1))
    assert all(a.logprob >= b.logprob for a, b in zip(top, top[1:]))
    for tid, lp in position.items():
        assert isinstance(lp, Logprob) and isinstance(lp.logprob, float) and lp.logprob <= 0
        assert isinstance(lp.decoded_token, str) and lp.decoded_token == token_text(tid)


def test_logprob_is_importable_where_vllm_users_find_it():
    assert Logprob is OutputsLogprob
    assert Logprob(-0.5) == Logprob(logprob=-0.5, rank=None, decoded_token=None)


@pytest.mark.parametrize("k", [0, 1, 3, 5])
def test_each_generated_token_has_a_dict_with_it_and_the_top_k(llm, k):
    out = generate(llm, temperature=1.0, seed=7, logprobs=k).outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 12
    token_text = llm.get_tokenizer().token_text
    for token_id, position in zip(out.token_ids, out.logprobs):
        assert_position_shape(position, token_id, k, token_text)
    assert out.cumulative_logprob == pytest.approx(
        sum(position[t].logprob for t, position in zip(out.token_ids, out.logprobs)), abs=1e-9)


def test_sampled_tokens_outside_the_top_k_come_last_with_their_rank(llm):
    # At temperature 2 over 258 tokens, some sampled token falls outside the top 1.
    out = generate(llm, temperature=2.0, seed=1, logprobs=1, max_tokens=30).outputs[0]
    outside = [(t, p) for t, p in zip(out.token_ids, out.logprobs) if len(p) == 2]
    assert outside
    for token_id, position in outside:
        (best_id, best), (last_id, sampled) = position.items()
        assert last_id == token_id and sampled.rank > 1 and sampled.logprob <= best.logprob


def test_greedy_tokens_have_rank_one_and_lead_their_dict(llm):
    out = generate(llm, temperature=0.0, logprobs=2).outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 12
    for token_id, position in zip(out.token_ids, out.logprobs):
        assert position[token_id].rank == 1 and next(iter(position)) == token_id
        assert len(position) == 2


def test_user_script_reads_logprob_of_each_token(llm):
    out = generate(llm, temperature=0.0, logprobs=0).outputs[0]
    values = [out.logprobs[i][token_id].logprob for i, token_id in enumerate(out.token_ids)]
    assert all(len(position) == 1 for position in out.logprobs)
    assert math.isclose(sum(values), out.cumulative_logprob, abs_tol=1e-9)


def test_no_logprobs_unless_asked(llm):
    output = generate(llm, temperature=0.0)
    assert output.outputs[0].logprobs is None and output.prompt_logprobs is None


def test_prompt_logprobs_are_none_then_a_dict_per_prompt_token(llm):
    output = generate(llm, temperature=0.0, prompt_logprobs=2, max_tokens=2)
    prompt_ids = output.prompt_token_ids
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(prompt_ids) > 1
    token_text = llm.get_tokenizer().token_text
    for token_id, position in zip(prompt_ids[1:], output.prompt_logprobs[1:]):
        assert_position_shape(position, token_id, 2, token_text)


def test_finished_is_a_method_false_until_the_last_output(llm):
    engine = llm.engine
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=5, ignore_eos=True, logprobs=1))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    completions = [o.outputs[0] for o in outputs]
    assert [c.finished() for c in completions] == [False] * (len(outputs) - 1) + [True]
    assert [o.finished for o in outputs] == [c.finished() for c in completions]  # a bool on RequestOutput
    streamed = [position for c in completions for position in c.delta_logprobs]
    assert streamed == completions[-1].logprobs and len(streamed) == 5


def test_logprobs_follow_tokens_cut_by_a_stop_string(llm):
    full = generate(llm, temperature=0.0, logprobs=1, max_tokens=20).outputs[0]
    stop = next(ch for ch in full.text[3:] if ch.isprintable() and ch != "\ufffd")
    out = generate(llm, temperature=0.0, logprobs=1, max_tokens=20, stop=[stop]).outputs[0]
    assert out.finish_reason == "stop" and out.finished()
    assert len(out.logprobs) == len(out.token_ids) < len(full.token_ids)
    assert out.logprobs == full.logprobs[:len(out.token_ids)]
