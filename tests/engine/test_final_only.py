"""final_only (LLMEngine.add_request): a request whose caller reads only its finished output gets an
OutputProgress from each step before that, and, without stop strings, its text decoded once at the
end. The finished output must be exactly the one the request gets without it."""

from __future__ import annotations

import pytest
from conftest import engine_on, make_prompts

from vllmlite.outputs import OutputProgress, RequestOutput
from vllmlite.sampling_params import SamplingParams
from vllmlite.tokenizer.detokenizer import IncrementalDetokenizer

PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=30),                      # EOS may end it: not in the text
    SamplingParams(temperature=0.9, seed=3, max_tokens=25, n=2, logprobs=2),
    SamplingParams(temperature=1.0, seed=4, max_tokens=20, best_of=3),
    SamplingParams(temperature=0.0, max_tokens=40, stop=["e", "a"], ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[101, 32], ignore_eos=True),
    SamplingParams(temperature=0.7, seed=5, max_tokens=35, skip_special_tokens=False, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=12, detokenize=False, ignore_eos=True),
]


def run(engine, requests, final_only: bool) -> tuple[dict[str, RequestOutput], dict[str, list]]:
    """The finished outputs by id, and every output (progress or not) each request got, in order."""
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params, final_only=final_only)
    finished, seen = {}, {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            seen.setdefault(output.request_id, []).append(output)
            if not isinstance(output, OutputProgress) and output.finished:
                finished[output.request_id] = output
    return finished, seen


def comparable(output: RequestOutput) -> list[tuple]:
    return [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason, c.logprobs, c.cumulative_logprob)
            for c in output.outputs]


@pytest.mark.parametrize("max_num_seqs", [16, 3])   # 3: requests queue, and the later ones wait
def test_a_final_only_request_finishes_with_the_output_it_gets_without(tiny_model, max_num_seqs):
    requests = [(prompt, PARAMS[i % len(PARAMS)]) for i, prompt in enumerate(make_prompts(16, seed=11))]
    plain, _ = run(engine_on(tiny_model, max_num_seqs=max_num_seqs), requests, final_only=False)
    final, seen = run(engine_on(tiny_model, max_num_seqs=max_num_seqs), requests, final_only=True)
    assert set(final) == set(plain) == {str(i) for i in range(len(requests))}
    for request_id, output in plain.items():
        assert comparable(final[request_id]) == comparable(output), request_id
        assert final[request_id].prompt_token_ids == output.prompt_token_ids
        # Before the finished output, progress alone; its new tokens and the last output's add up.
        *before, last = seen[request_id]
        assert all(isinstance(p, OutputProgress) for p in before) and last is final[request_id]
        counted = sum(p.num_new_tokens for p in before) + sum(len(c.delta_token_ids) for c in last.outputs)
        if PARAMS[int(request_id) % len(PARAMS)].best_of is None:
            assert counted == sum(len(c.token_ids) for c in output.outputs), request_id
    # Something ran long enough to have progress, and the text was decoded at all.
    assert sum(len(v) for v in seen.values()) > 2 * len(requests)
    assert any(c.text for output in final.values() for c in output.outputs)


def test_a_final_only_request_decodes_its_text_once_unless_it_has_stop_strings(tiny_model, monkeypatch):
    calls: dict[int, int] = {}

    def counted(method):
        def counting(self, token_ids):
            calls[id(self)] = calls.get(id(self), 0) + 1
            return method(self, token_ids)
        return counting
    monkeypatch.setattr(IncrementalDetokenizer, "add_tokens", counted(IncrementalDetokenizer.add_tokens))
    monkeypatch.setattr(IncrementalDetokenizer, "finish", counted(IncrementalDetokenizer.finish))
    engine = engine_on(tiny_model, max_num_batched_tokens=16)
    prompt = make_prompts(1, seed=2, min_len=30, max_len=30)[0]
    for stop, final_only in [(None, True), (None, False), (["zz"], True)]:
        calls.clear()
        params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=stop)
        engine.add_request(f"{stop}-{final_only}", prompt, params, final_only=final_only)
        while engine.has_unfinished_requests():
            engine.step()
        assert list(calls.values()) == ([1] if final_only and stop is None else [20]), (stop, final_only)


def test_an_aborted_final_only_request_leaves_nothing_behind(tiny_model):
    engine = engine_on(tiny_model)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True), final_only=True)
    progress = engine.step()
    assert [type(o) for o in progress] == [OutputProgress] and progress[0].num_new_tokens == 1
    engine.abort_request("a")
    assert not engine.has_unfinished_requests() and engine.step() == []
