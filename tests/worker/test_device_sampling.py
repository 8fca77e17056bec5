"""Sampling on the device (worker/torch_sampling.py) inside the engine: every sampling feature
gives the tokens the numpy path gives in float32 — seeded temperature/top-k/top-p/min-p draws,
penalties, logit bias, bad words, min_tokens, grammars, speculative verification — with logprobs
and prompt logprobs within float rounding. On torch's CPU tensors here; on the GPU under `cuda`."""

from __future__ import annotations

import pytest
from conftest import engine_on, run_to_completion

from vllmlite.sampling_params import SamplingParams
from vllmlite.structured_output_params import StructuredOutputsParams

torch = pytest.importorskip("torch")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 9, 9, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [40, 41]]


def requests() -> list[tuple[list[int], SamplingParams]]:
    features = [dict(temperature=0.8, top_k=3, seed=1, logprobs=3),
                dict(temperature=1.0, top_p=0.7, seed=2, prompt_logprobs=2),
                dict(temperature=0.9, min_p=0.2, seed=3, presence_penalty=1.0, frequency_penalty=0.5),
                dict(temperature=0, repetition_penalty=1.5, logit_bias={65: 3.0}, logprobs=1),
                dict(temperature=1.0, seed=4, bad_words=["A"], min_tokens=5),
                dict(temperature=0.7, seed=5, n=2),
                dict(temperature=1.0, seed=6, structured_outputs=StructuredOutputsParams(regex=r"[a-c]{3}-[0-9]{2}")),
                dict(temperature=0, allowed_token_ids=[65, 66, 67, 68], logprobs=2),
                dict(temperature=0, presence_penalty=1.5, frequency_penalty=1.0)]
    return [(PROMPTS[i % len(PROMPTS)], SamplingParams(max_tokens=8, ignore_eos=True, **f))
            for i, f in enumerate(features)]


def outputs(engine):
    return run_to_completion(engine, requests())


def assert_same(got, want) -> None:
    for g, w in zip(got, want):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
        for gc, wc in zip(g.outputs, w.outputs):
            for ge, we in zip(gc.logprobs or [], wc.logprobs or []):
                assert ge.keys() == we.keys()
                assert all(abs(ge[t].logprob - we[t].logprob) < 1e-4 for t in ge)
        for ge, we in zip(g.prompt_logprobs or [], w.prompt_logprobs or []):
            assert (ge is None) == (we is None)
            if ge is not None:
                assert ge.keys() == we.keys() and all(abs(ge[t].logprob - we[t].logprob) < 1e-4 for t in ge)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                         "prompt_lookup_max": 3}], ids=["plain", "ngram"])
def test_every_sampling_feature_matches_the_numpy_path(tiny_model, device, spec):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    extra = {"speculative_config": spec} if spec else {}
    want = outputs(engine_on(tiny_model, dtype="float32", kernels="numpy", **extra))
    engine = engine_on(tiny_model, dtype="float32", kernels="torch", device=device, **extra)
    assert type(engine.runner.sampler).__name__ == "TorchSampler"
    assert_same(outputs(engine), want)
