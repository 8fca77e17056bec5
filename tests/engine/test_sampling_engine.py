"""Decoding parameters end to end through the engine: seeds, stops, n/best_of, logprobs, EOS."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make_prompts, run_to_completion
from reference import dense_logits

from vllmlite.sampling_params import SamplingParams
from vllmlite.worker.sampling import log_softmax

EOS = 257          # the byte tokenizer's <|eos|>
E_LEAD, E_TAIL = 0xC3, 0xA9  # UTF-8 of "é"


def run_one(engine, prompt, params, stream: list | None = None):
    """Run one request alone; collect every streamed delta of sample 0 into `stream`."""
    engine.add_request("r", prompt, params)
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if stream is not None:
                stream.append(output.outputs[0].delta_text)
            final = output
    engine.block_manager.check_invariants()
    return final


@pytest.mark.parametrize("budget,block_size", [(4096, 16), (7, 4), (33, 1)])
def test_seeded_sampling_is_reproducible_across_batch_mix_and_knobs(make_engine, budget, block_size):
    prompts = make_prompts(8, seed=11, max_len=30)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=42, max_tokens=10, ignore_eos=True)
    alone = run_to_completion(make_engine(), [(prompts[0], seeded)])[0].outputs[0].token_ids
    others = [SamplingParams(temperature=t, top_k=k, max_tokens=6 + i, ignore_eos=True)
              for i, (t, k) in enumerate([(1.3, None), (0.0, None), (0.7, 5), (1.0, 20)] * 2)]
    mixed = [(prompts[0], seeded)] + list(zip(prompts[1:], others))
    for order in (mixed, mixed[::-1]):
        results = run_to_completion(make_engine(max_num_batched_tokens=budget, block_size=block_size,
                                                num_blocks=2048 // block_size), order)
        index = 0 if order is mixed else len(order) - 1
        assert results[index].outputs[0].token_ids == alone


def test_unseeded_requests_differ_but_the_engine_seed_reproduces_them(make_engine):
    prompt = make_prompts(1, seed=12)[0]
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    first = run_to_completion(make_engine(), [(prompt, params), (prompt, params)])
    assert first[0].outputs[0].token_ids != first[1].outputs[0].token_ids
    again = run_to_completion(make_engine(), [(prompt, params), (prompt, params)])
    assert [r.outputs[0].token_ids for r in again] == [r.outputs[0].token_ids for r in first]


def test_stop_string_spanning_tokens_cuts_output_in_stream_and_final(make_engine):
    prompt = make_prompts(1, seed=13)[0]
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = run_one(make_engine(), prompt, greedy).outputs[0].text
    stop = full[10:13]  # three byte tokens
    cut = full[:full.index(stop)]
    for include in (False, True):
        stream: list[str] = []
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop],
                                include_stop_str_in_output=include)
        out = run_one(make_engine(), prompt, params, stream).outputs[0]
        expected = cut + stop if include else cut
        assert out.text == expected and "".join(stream) == expected
        assert out.finish_reason == "stop" and out.stop_reason == stop


def test_stop_string_with_a_multibyte_character(make_engine):
    prompt = make_prompts(1, seed=14)[0]
    forced = {E_LEAD: 100.0, E_TAIL: 100.0}  # output is only 0xC3 / 0xA9 bytes
    # The frequency penalty makes greedy alternate between the two, so "é" (C3 A9) forms.
    base = SamplingParams(temperature=0, frequency_penalty=2.0, max_tokens=24, ignore_eos=True,
                          logit_bias=forced)
    tokens = run_one(make_engine(), prompt, base).outputs[0].token_ids
    text = bytes(tokens).decode("utf-8", errors="replace")
    assert "é" in text, "the forced bytes never formed the character; pick another seed"
    stream: list[str] = []
    params = SamplingParams(temperature=0, frequency_penalty=2.0, max_tokens=24, ignore_eos=True,
                            logit_bias=forced, stop=["é"])
    out = run_one(make_engine(), prompt, params, stream).outputs[0]
    assert out.text == text[:text.index("é")] and "".join(stream) == out.text
    assert out.finish_reason == "stop"
    # The token that completed the stop is the last one kept.
    assert bytes(out.token_ids).decode("utf-8", errors="replace").endswith("é")


def test_eos_stops_unless_ignored_and_min_tokens_holds_it_off(make_engine):
    prompt = make_prompts(1, seed=15)[0]
    eos_first = {EOS: 100.0}
    out = run_one(make_engine(), prompt, SamplingParams(temperature=0, max_tokens=10, logit_bias=eos_first))
    assert out.outputs[0].token_ids == [EOS] and out.outputs[0].text == ""
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason is None
    held = run_one(make_engine(), prompt, SamplingParams(temperature=0, max_tokens=10, min_tokens=4,
                                                         logit_bias=eos_first))
    assert len(held.outputs[0].token_ids) == 5 and held.outputs[0].token_ids[-1] == EOS
    ignored = run_one(make_engine(), prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                            logit_bias=eos_first))
    assert ignored.outputs[0].token_ids == [EOS] * 10 and ignored.outputs[0].finish_reason == "length"


def test_stop_token_ids_finish_with_that_token_as_stop_reason(make_engine):
    prompt = make_prompts(1, seed=16)[0]
    params = SamplingParams(temperature=0, max_tokens=10, logit_bias={65: 100.0}, stop_token_ids=[65])
    out = run_one(make_engine(), prompt, params).outputs[0]
    assert out.token_ids == [65] and out.text == "" and out.stop_reason == 65


def test_n_returns_n_distinct_samples(make_engine):
    prompt = make_prompts(1, seed=17)[0]
    out = run_one(make_engine(), prompt, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8,
                                                        ignore_eos=True))
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3


def test_best_of_returns_the_n_most_likely_of_best_of_candidates(make_engine):
    prompt = make_prompts(1, seed=18)[0]
    out = run_one(make_engine(), prompt, SamplingParams(n=2, best_of=4, temperature=1.0, seed=9,
                                                        max_tokens=8, ignore_eos=True))
    candidates = []
    for i in range(4):  # candidate i is the request alone with seed + i
        alone = run_one(make_engine(), prompt, SamplingParams(temperature=1.0, seed=9 + i, max_tokens=8,
                                                              ignore_eos=True, logprobs=0))
        candidates.append((alone.outputs[0].cumulative_logprob, alone.outputs[0].token_ids))
    candidates.sort(key=lambda c: c[0], reverse=True)
    assert [c.token_ids for c in out.outputs] == [c[1] for c in candidates[:2]]
    assert [c.index for c in out.outputs] == [0, 1]
    assert all(c.logprobs is None for c in out.outputs)  # not asked for


def test_logprobs_equal_log_softmax_of_reference_logits(make_engine, tiny_model):
    prompt = make_prompts(1, seed=19, min_len=9, max_len=9)[0]
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True, logprobs=3,
                            prompt_logprobs=2)
    out = run_one(make_engine(block_size=4, max_num_batched_tokens=5), prompt, params)
    completion = out.outputs[0]
    tokens = prompt + completion.token_ids
    reference = log_softmax(dense_logits(tiny_model, tokens))  # [len, vocab]
    assert len(completion.logprobs) == len(completion.token_ids) == 6
    for i, (token_id, position) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = reference[len(prompt) - 1 + i]
        assert position[token_id].logprob == pytest.approx(row[token_id], abs=1e-9)
        assert list(position)[:3] == list(np.argsort(-row)[:3])
        assert position[token_id].rank == 1 + int((row > row[token_id]).sum())
    assert completion.cumulative_logprob == pytest.approx(
        sum(position[t].logprob for t, position in zip(completion.token_ids, completion.logprobs)))
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i, position in enumerate(out.prompt_logprobs[1:]):
        token_id = prompt[i + 1]
        assert position[token_id].logprob == pytest.approx(reference[i][token_id], abs=1e-9)
        assert list(position)[:2] == list(np.argsort(-reference[i])[:2])


@pytest.mark.parametrize("params", [
    SamplingParams(n=2, max_tokens=1, temperature=1.0, seed=1),
    SamplingParams(n=3, temperature=0, max_tokens=5, logit_bias={EOS: 100.0}),  # EOS as the first token
    SamplingParams(n=2, best_of=3, temperature=1.0, seed=2, max_tokens=1),
], ids=["max_tokens_1", "eos_first", "best_of"])
def test_forks_survive_a_parent_that_finishes_on_its_first_token(make_engine, params):
    prompt = make_prompts(1, seed=31, min_len=5, max_len=5)[0]
    result = run_to_completion(make_engine(block_size=4), [(prompt, params)])[0]
    assert len(result.outputs) == params.n
    assert all(len(c.token_ids) == 1 for c in result.outputs)


def test_stop_string_and_eos_in_one_round_keep_only_tokens_up_to_the_stop(make_engine):
    from vllmlite.core.request import FinishReason
    engine = make_engine()
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=10, stop=["a"]))
    request = engine.scheduler.requests["r"]
    # As after a speculative round that emitted "a", "b" and EOS at once.
    for token in (ord("a"), ord("b"), EOS):
        request.append_token(token)
    engine.scheduler.finish(request, FinishReason.STOP)
    assert engine.output_processor.detokenize([request]) == []  # already finished: nothing to hand back
    assert request.output_token_ids == [ord("a")] and request.stop_reason == "a"
    [output] = engine.output_processor.make_outputs()
    assert output.finished and output.outputs[0].text == "" and output.outputs[0].finish_reason == "stop"


def test_best_of_equal_to_n_reports_no_logprobs_unless_asked(make_engine):
    prompt = make_prompts(1, seed=32)[0]
    out = run_one(make_engine(), prompt, SamplingParams(n=2, best_of=2, temperature=1.0, seed=1, max_tokens=4,
                                                        ignore_eos=True))
    assert [c.logprobs for c in out.outputs] == [None, None]
    assert [c.cumulative_logprob for c in out.outputs] == [None, None]
