"""The int_dot knob through the engine: every quantized product takes activations rounded to 8 bits
(kernels/int_dot.py). The reference is the numpy engine with the knob, whose `linear` is that
module's definition; the compiled engine must give its greedy tokens, alone and batched (its few-
and many-token paths), and logprobs that follow it rather than the float activations'."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import engine_on, greedy, make_prompts, run_to_completion

from vllmlite.engine.llm_engine import LLMEngine
from vllmlite.engine_args import EngineArgs
from vllmlite.kernels import IntDotKernels
from vllmlite.models.loader import load_model

MAX_TOKENS = 10


@pytest.fixture(scope="module", params=["int8", "int4"])
def quantized(request):
    """The tiny random model with every matrix rounded to the format at load (float32)."""
    return load_model("random", dtype="float32", seed=0, quantization=request.param)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(6, seed=3, min_len=1, max_len=60)


def engine(loaded, **overrides) -> LLMEngine:
    return engine_on(loaded, dtype="float32", quantization=loaded.weights.embed.format, **overrides)


def tokens_and_logprobs(eng: LLMEngine, prompts, **run_kwargs) -> tuple[list[list[int]], np.ndarray]:
    results = run_to_completion(eng, [(p, greedy(MAX_TOKENS, logprobs=0)) for p in prompts], **run_kwargs)
    return ([r.outputs[0].token_ids for r in results],
            np.array([r.outputs[0].cumulative_logprob for r in results]))


@pytest.fixture(scope="module")
def reference(quantized, prompts) -> tuple[list[list[int]], np.ndarray]:
    """The numpy engine with int_dot: kernels/int_dot.py's definition of every quantized product."""
    return tokens_and_logprobs(engine(quantized, kernels="numpy", int_dot=True), prompts)


def test_the_knob_gives_the_engine_integer_dot_kernels(quantized):
    assert isinstance(engine(quantized, int_dot=True).model.kernels, IntDotKernels)
    assert not isinstance(engine(quantized).model.kernels, IntDotKernels)
    assert engine(quantized, int_dot=True).effective_config()["int_dot"] is True


def test_compiled_engine_gives_the_definitions_greedy_tokens_batched(quantized, prompts, reference):
    tokens, logprobs = tokens_and_logprobs(engine(quantized, int_dot=True), prompts)
    assert tokens == reference[0]
    # Rounding is a step function: where x / d_x lands within float32 rounding of a half, one
    # integer flips and the sequence's logprob moves by up to ~0.03; the others agree to float precision.
    assert np.isclose(logprobs, reference[1], rtol=0, atol=1e-4).sum() >= len(prompts) - 2


def test_compiled_engine_gives_the_same_tokens_and_logprobs_alone_batched_and_mid_flight(quantized, prompts,
                                                                                       reference):
    """Alone, a decode is one token (without VNNI: the rounded activations through the packed-bytes
    kernel; with it, the integer kernel as in a batch). Other batches change the float kernels'
    rounding (chunked prefill, attention), and where that moves x / d_x across a half, a rounded
    integer flips: logprobs agree for all but a sequence or two, tokens for all."""
    batched = tokens_and_logprobs(engine(quantized, int_dot=True), prompts)
    alone = [tokens_and_logprobs(engine(quantized, int_dot=True), [p]) for p in prompts[:3]]
    assert [tokens[0] for tokens, _ in alone] == reference[0][:3]
    assert np.isclose([logprobs[0] for _, logprobs in alone], batched[1][:3], rtol=0, atol=1e-4).sum() >= 2
    arrivals = {i: 2 * i for i in range(len(prompts))}
    mid_flight = tokens_and_logprobs(engine(quantized, int_dot=True, max_num_batched_tokens=16), prompts,
                                     arrivals=arrivals)
    assert mid_flight[0] == reference[0]
    assert np.isclose(mid_flight[1], batched[1], rtol=0, atol=1e-4).sum() >= len(prompts) - 2


def test_logprobs_follow_the_rounded_activations_not_the_float_ones(quantized, prompts, reference):
    """The knob changes the numbers (so a knob lost on the way would show): with float activations
    a typical sequence's logprob is 0.01-0.14 from the reference's; with the knob, within 1e-4."""
    _, rounded = tokens_and_logprobs(engine(quantized, int_dot=True), prompts)
    _, floats = tokens_and_logprobs(engine(quantized, kernels="numpy"), prompts)
    assert np.median(np.abs(floats - reference[1])) > 0.01 > 100 * np.median(np.abs(rounded - reference[1]))


@pytest.mark.parametrize("values, message", [
    ({}, "int_dot multiplies quantized weights as integers: it needs quantization int8 or int4, got 'none'"),
    ({"quantization": "none"}, "needs quantization int8 or int4, got 'none'"),
    ({"quantization": "int4", "device": "cuda"}, "int_dot needs the numba or numpy kernels, got 'torch'"),
    ({"quantization": "int4", "kernels": "torch"}, "int_dot needs the numba or numpy kernels, got 'torch'"),
])
def test_int_dot_without_quantized_weights_or_cpu_kernels_is_a_value_error(values, message, monkeypatch):
    monkeypatch.delenv("VLLMLITE_KERNELS", raising=False)   # the knobs given here, not a run's kernels
    with pytest.raises(ValueError, match=message):
        EngineArgs(model="random", int_dot=True, **values).create_engine_config()

