"""Beam search (vllmlite/beam_search.py) and `LLM.beam_search`: the step rule on hand-made logprobs, the
whole search against a brute-force reference on the tiny model in float32 (every beam's logprobs
recomputed over its whole sequence, no cache), and the blocks the beams share through the prefix cache."""

from __future__ import annotations

import doctest
import math

import numpy as np
import pytest
from conftest import assert_no_leaks, make_prompts
from reference import beam_search as reference_beam_search
from reference import next_token_logprobs

from vllmlite import LLM, beam_search
from vllmlite.beam_search import BeamSearch, BeamSearchOutput, BeamSearchSequence, get_beam_search_score
from vllmlite.models.loader import load_model
from vllmlite.outputs import Logprob
from vllmlite.sampling_params import BeamSearchParams, SamplingParams

EOS = 257  # the byte tokenizer's
# Random prompts on which the 4-wide search finishes beams with EOS (found once; the tests check it).
EOS_PROMPTS = [make_prompts(1, seed=seed)[0] for seed in (0, 4, 7)]


def position(*pairs: tuple[int, float]) -> dict[int, Logprob]:
    """One step's logprobs as the engine hands them back: token id -> Logprob, best first."""
    return {token_id: Logprob(logprob) for token_id, logprob in pairs}


# --- the step rule, on hand-made logprobs -------------------------------------------------------

def test_the_best_candidates_of_all_beams_live_on_and_an_eos_candidate_finishes():
    search = BeamSearch([1, 2], BeamSearchParams(beam_width=2, max_tokens=3), eos_token_id=EOS, max_model_len=100)
    search.advance([position((10, -0.1), (EOS, -0.5), (11, -2.0), (12, -3.0))])
    assert [b.tokens for b in search.live] == [[1, 2, 10], [1, 2, 11]]
    assert [(b.tokens, b.cum_logprob, b.finish_reason, b.stop_reason) for b in search.finished] == [
        ([1, 2], -0.5, "stop", EOS)]  # EOS left out of the tokens, its logprob counted
    search.advance([position((20, -1.0), (21, -1.5), (22, -9.0), (23, -9.0)),
                    position((30, -0.1), (31, -0.2), (32, -9.0), (33, -9.0))])
    # beam 1's two best (-1.1, -1.6) beat beam 2's best (-2.1): a beam may have several children
    assert [(b.tokens[2:], round(b.cum_logprob, 6)) for b in search.live] == [([10, 20], -1.1), ([10, 21], -1.6)]
    assert len(search.live[0].logprobs) == 2 and search.num_steps == 2 and not search.is_done


@pytest.mark.parametrize("eos_rank, is_candidate", [(4, True), (5, False)])
def test_each_beam_offers_two_candidates_per_beam_width(eos_rank, is_candidate):
    search = BeamSearch([1], BeamSearchParams(beam_width=2, max_tokens=1), eos_token_id=EOS, max_model_len=100)
    others = iter([10, 11, 12, 13])
    search.advance([position(*((EOS if rank == eos_rank else next(others), -float(rank)) for rank in range(1, 6)))])
    assert [b.tokens for b in search.finished] == ([[1]] if is_candidate else [])
    assert [b.tokens for b in search.live] == [[1, 10], [1, 11]]


@pytest.mark.parametrize("include_stop, ignore_eos", [(True, False), (False, True)])
def test_eos_is_kept_with_include_stop_str_in_output_and_ordinary_with_ignore_eos(include_stop, ignore_eos):
    params = BeamSearchParams(beam_width=1, max_tokens=2, ignore_eos=ignore_eos,
                              include_stop_str_in_output=include_stop)
    search = BeamSearch([1], params, eos_token_id=EOS, max_model_len=100)
    search.advance([position((EOS, -0.1), (10, -3.0))])
    (best,) = search.best()
    assert best.tokens == [1, EOS]
    assert best.finish_reason == ("length" if ignore_eos else "stop")
    assert [b.tokens for b in search.live] == [[1, EOS] if ignore_eos else [1, 10]]  # ignore_eos: it lives on


def test_final_ranking_applies_the_length_penalty_and_a_beam_at_the_context_limit_finishes():
    # A beam finished by EOS: cum -1.2 over 2 tokens; the live ones: -1.5 and -1.6 over 3 tokens.
    def run(length_penalty: float) -> list[list[int]]:
        search = BeamSearch([1], BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=length_penalty),
                            eos_token_id=EOS, max_model_len=3)
        search.advance([position((10, -1.0), (11, -1.3), (12, -9.0), (13, -9.0))])
        search.advance([position((EOS, -0.2), (20, -0.5), (21, -0.6), (22, -9.0)),
                        position((30, -0.5), (31, -9.0), (32, -9.0), (33, -9.0))])
        assert search.live == [] and search.is_done  # both reached max_model_len = 3 tokens
        return [b.tokens for b in search.best()]
    assert run(0.0) == [[1, 10], [1, 10, 20]]        # -1.2 beats -1.5
    assert run(3.0) == [[1, 10, 20], [1, 10, 21]]    # -1.5 / 27 and -1.6 / 27 beat -1.2 / 8


def test_score_divides_by_the_length_without_a_final_eos():
    assert get_beam_search_score([1, 2, 3, EOS], -6.0, EOS, 1.0) == -2.0
    assert get_beam_search_score([1, 2, 3, 4], -6.0, EOS, 2.0) == -6.0 / 16
    assert doctest.testmod(beam_search).failed == 0


def test_beam_search_params_are_checked_as_vllm_names_them():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=11, max_tokens=4)  # 22 candidates per beam: past the logprobs bound
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=0)
    for length_penalty in (math.nan, 11.0, -11.0):
        with pytest.raises(ValueError, match="length_penalty"):
            BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=length_penalty)
    with pytest.raises(TypeError, match="LLM.beam_search"):
        SamplingParams(use_beam_search=True)


# --- against the brute-force reference ---------------------------------------------------------

@pytest.fixture(scope="module")
def model32():
    return load_model("random", dtype="float32", seed=0)


@pytest.fixture(scope="module")
def llm32():
    return LLM("random", dtype="float32", seed=0, num_blocks=512, block_size=4)


def check_against_reference(model, result: BeamSearchOutput, prompt: list[int], params: BeamSearchParams) -> None:
    expected = reference_beam_search(model, prompt, params.beam_width, params.max_tokens, EOS,
                                     params.ignore_eos, params.length_penalty)
    got = [(s.tokens, s.finish_reason) for s in result.sequences]
    drop_eos = not params.include_stop_str_in_output
    assert got == [(t[:-1] if reason == "stop" and drop_eos else t, reason) for t, _, reason in expected]
    np.testing.assert_allclose([s.cum_logprob for s in result.sequences], [c for _, c, _ in expected], atol=1e-4)


@pytest.mark.parametrize("beam_width, length_penalty", [(1, 1.0), (2, 0.0), (4, 1.0), (4, 2.5)])
def test_beam_search_finds_what_the_brute_force_reference_finds(llm32, model32, beam_width, length_penalty):
    prompts = make_prompts(3, seed=1, max_len=20)
    params = BeamSearchParams(beam_width=beam_width, max_tokens=6, length_penalty=length_penalty)
    results = llm32.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, result in zip(prompts, results):
        assert len(result.sequences) == beam_width
        check_against_reference(model32, result, prompt, params)
    assert_no_leaks(llm32.engine)


@pytest.mark.parametrize("include_stop, ignore_eos", [(False, False), (True, False), (False, True)])
def test_beams_ended_by_eos_match_the_reference(llm32, model32, include_stop, ignore_eos):
    params = BeamSearchParams(beam_width=4, max_tokens=8, ignore_eos=ignore_eos,
                              include_stop_str_in_output=include_stop)
    results = llm32.beam_search([{"prompt_token_ids": p} for p in EOS_PROMPTS], params)
    for prompt, result in zip(EOS_PROMPTS, results):
        check_against_reference(model32, result, prompt, params)
    reasons = {s.finish_reason for r in results for s in r.sequences}
    assert reasons == ({"length"} if ignore_eos else {"stop", "length"})  # EOS really ended some beams


def test_cumulative_logprob_is_the_sum_over_the_sequence_scored_in_one_pass(llm32, model32):
    prompt = make_prompts(1, seed=7, max_len=20)[0]
    (result,) = llm32.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(beam_width=3, max_tokens=5))
    for sequence in result.sequences:
        output = sequence.tokens[len(prompt):]
        total = sum(next_token_logprobs(model32, sequence.tokens[:len(prompt) + i])[t] for i, t in enumerate(output))
        assert sequence.cum_logprob == pytest.approx(total, abs=1e-4)
        assert [p[t].logprob for p, t in zip(sequence.logprobs, output)] == pytest.approx(
            [next_token_logprobs(model32, sequence.tokens[:len(prompt) + i])[t] for i, t in enumerate(output)],
            abs=1e-4)


def test_text_is_the_whole_sequence_decoded_as_vllm_gives_it(llm32):
    (result,) = llm32.beam_search("ab", BeamSearchParams(beam_width=2, max_tokens=3))
    tokenizer = llm32.get_tokenizer()
    assert all(isinstance(s, BeamSearchSequence) for s in result.sequences)
    assert [s.text for s in result.sequences] == [tokenizer.decode(s.tokens) for s in result.sequences]
    assert result.sequences[0].tokens[:3] == tokenizer.encode("ab")


# --- blocks: shared through the prefix cache, all free at the end ------------------------------

def peak_blocks_in_use(llm: LLM, monkeypatch, prompt: list[int], params: BeamSearchParams) -> int:
    """The most device blocks referenced at once while `llm` searches (measured after each schedule)."""
    bm, scheduler = llm.engine.block_manager, llm.engine.scheduler
    schedule, peak = scheduler.schedule, 0

    def measured():
        nonlocal peak
        out = schedule()
        bm.check_invariants()
        peak = max(peak, bm.num_blocks - bm.num_free_blocks)
        return out
    monkeypatch.setattr(scheduler, "schedule", measured)
    llm.beam_search({"prompt_token_ids": prompt}, params)
    return peak


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_four_beams_hold_far_fewer_blocks_than_four_copies_and_free_all(monkeypatch, enable_prefix_caching):
    llm = LLM("random", dtype="float32", seed=0, num_blocks=512, block_size=4,
              enable_prefix_caching=enable_prefix_caching)
    prompt = make_prompts(1, seed=2, min_len=64, max_len=64)[0]
    params = BeamSearchParams(beam_width=4, max_tokens=8, ignore_eos=True)
    peak = peak_blocks_in_use(llm, monkeypatch, prompt, params)
    four_copies = 4 * math.ceil((len(prompt) + params.max_tokens) / 4)   # 72 blocks
    if enable_prefix_caching:
        assert peak <= 16 + 4 * 3 < four_copies / 2  # the prompt's 16 blocks once, each beam's own <= 3
    else:
        assert peak > four_copies * 0.8  # without sharing, the measure sees the copies
    assert_no_leaks(llm.engine)  # every block free (or cached and free), no request left


def test_beams_stop_at_the_context_length():
    llm = LLM("random", dtype="float32", seed=0, num_blocks=64, max_model_len=12)
    params = BeamSearchParams(beam_width=2, max_tokens=10, ignore_eos=True)
    (result,) = llm.beam_search({"prompt_token_ids": list(range(1, 9))}, params)
    assert [(len(s.tokens), s.finish_reason) for s in result.sequences] == [(12, "length")] * 2
    assert_no_leaks(llm.engine)
