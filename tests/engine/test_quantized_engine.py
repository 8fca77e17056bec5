"""Quantized weights through the engine: greedy output is deterministic and no knob of the serving
machinery changes a token, as for float weights; the reference is the dense model on the
dequantized matrices."""

from __future__ import annotations

import pytest
from conftest import engine_on, greedy, make_prompts, run_to_completion
from reference import dense_greedy

from vllmlite.engine.llm_engine import LLMEngine
from vllmlite.kernels.quant import QuantizedMatrix
from vllmlite.models.loader import load_model

MAX_TOKENS = 10


@pytest.fixture(scope="module", params=["int8", "int4"])
def quantized(request):
    """The tiny random model with every matrix rounded to the format at load (float32)."""
    loaded = load_model("random", dtype="float32", seed=0, quantization=request.param)
    assert isinstance(loaded.weights.layers[0].w_down, QuantizedMatrix)
    assert loaded.weights.layers[0].w_down.format == request.param
    return loaded


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(6, seed=2, min_len=1, max_len=60)


@pytest.fixture(scope="module")
def expected(quantized, prompts) -> list[list[int]]:
    return [dense_greedy(quantized, p, MAX_TOKENS) for p in prompts]


def engine(loaded, **overrides) -> LLMEngine:
    return engine_on(loaded, dtype="float32", quantization=loaded.weights.embed.format, **overrides)


def outputs_of(eng, prompts, **run_kwargs) -> list[list[int]]:
    results = run_to_completion(eng, [(p, greedy(MAX_TOKENS)) for p in prompts], **run_kwargs)
    return [r.outputs[0].token_ids for r in results]


def test_greedy_is_deterministic_and_matches_the_dense_dequantized_model(quantized, prompts, expected):
    assert outputs_of(engine(quantized), prompts) == expected
    assert outputs_of(engine(quantized), prompts) == expected


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_greedy_identical_across_block_sizes(quantized, prompts, expected, block_size):
    assert outputs_of(engine(quantized, block_size=block_size, num_blocks=2048 // block_size), prompts) == expected


def test_greedy_identical_alone_batched_and_arriving_mid_flight(quantized, prompts, expected):
    # Alone, a sequence decodes through the packed-bytes kernel; in a batch, through BLAS tiles.
    assert [outputs_of(engine(quantized), [p])[0] for p in prompts[:2]] == expected[:2]
    arrivals = {i: 2 * i for i in range(len(prompts))}
    assert outputs_of(engine(quantized, max_num_batched_tokens=16), prompts, arrivals=arrivals) == expected


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_identical_under_forced_preemption(quantized, prompts, expected, mode):
    eng = engine(quantized, block_size=4, num_blocks=18, preemption_mode=mode, swap_space=0.01,
                 max_num_batched_tokens=32)
    assert outputs_of(eng, prompts) == expected
    assert eng.scheduler.num_preemptions > 0
