"""The runner's device argmax: taken only when nothing but argmax decides a token, so every
sampling feature still goes through the sampler (and its logprobs still come back)."""

from __future__ import annotations

import pytest
from conftest import engine_on, run_to_completion

from vllmlite.core.request import Request
from vllmlite.sampling_params import SamplingParams
from vllmlite.worker.runner import is_plain_greedy
from vllmlite.worker.sampling import make_generator


def request_with(**params) -> Request:
    sampling = SamplingParams(**{"temperature": 0, "max_tokens": 4, **params})
    return Request(request_id="r", prompt_token_ids=[1, 2], sampling_params=sampling, max_tokens=4,
                   generator=make_generator(0))


@pytest.mark.parametrize("params", [dict(logprobs=0), dict(presence_penalty=0.5), dict(repetition_penalty=1.2),
                                    dict(logit_bias={3: 1.0}), dict(min_tokens=1), dict(allowed_token_ids=[3, 4]),
                                    dict(temperature=0.7)])
def test_any_sampling_feature_keeps_a_request_off_the_argmax_path(params):
    assert is_plain_greedy(request_with()) and not is_plain_greedy(request_with(**params))


def test_torch_logprobs_and_penalties_go_through_the_sampler_and_match_the_numpy_path(tiny_model):
    pytest.importorskip("torch")
    requests = [([5, 6, 7], SamplingParams(temperature=0, max_tokens=6, logprobs=2)),
                ([9, 9, 9, 9], SamplingParams(temperature=0, max_tokens=6, presence_penalty=1.5)),
                ([1, 2], SamplingParams(temperature=0, max_tokens=6))]
    results = {kernels: run_to_completion(engine_on(tiny_model, kernels=kernels), requests)
               for kernels in ("numpy", "torch")}
    numpy_out, torch_out = ([r.outputs[0] for r in results[k]] for k in ("numpy", "torch"))
    assert [o.token_ids for o in torch_out] == [o.token_ids for o in numpy_out]
    assert [len(o.logprobs) for o in torch_out[:1]] == [6]
    for got, want in zip(torch_out[0].logprobs, numpy_out[0].logprobs):
        assert got.keys() == want.keys()
        assert all(abs(got[t].logprob - want[t].logprob) < 1e-9 for t in got)
