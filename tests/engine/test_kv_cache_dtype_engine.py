"""kv_cache_dtype through the engine: the random tiny model's greedy tokens with fp16, bf16 and int8
K/V against float32 K/V, preemption (swap and recompute) changes no token, and a fixed
kv_cache_memory holds as many more blocks as the smaller dtype says; fp8 on the torch kernels: its
agreement with float32 K/V, and no serving knob changes one of its greedy tokens."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
from conftest import engine_on, greedy, make_prompts, run_to_completion

from vllmlite.engine_args import EngineArgs
from vllmlite.kernels.kv_dtype import PackedKV
from vllmlite.models.loader import load_model, random_weights

MAX_TOKENS = 12
# Of the float32 run's greedy tokens, the share each kind reproduces at least (each sequence's
# tokens up to its first difference, after which they are no longer comparable). Measured: on these
# 8 prompts every kind reproduces all 96 tokens; on 32 others (make_prompts(32, seed=5)) fp16 1.0,
# bf16 0.974 (31 of 32 sequences identical), int8 0.945 (29 of 32).
MIN_AGREEMENT = {"fp16": 1.0, "bf16": 1.0, "int8": 0.9}


@pytest.fixture(scope="module")
def loaded():
    return load_model("random", dtype="float32", seed=0)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(8, seed=2, min_len=1, max_len=60)


def tokens(engine, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in run_to_completion(engine, [(p, greedy(MAX_TOKENS)) for p in prompts])]


@pytest.fixture(scope="module")
def float32_tokens(loaded, prompts) -> list[list[int]]:
    return tokens(engine_on(loaded, dtype="float32"), prompts)


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """The share of tokens equal up to each sequence's first difference."""
    agreed = 0
    for x, y in zip(a, b):
        first_difference = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), len(x))
        agreed += first_difference
    return agreed / sum(map(len, a))


@pytest.mark.parametrize("name, kind", [("fp16", "fp16"), ("float16", "fp16"), ("bf16", "bf16"),
                                        ("bfloat16", "bf16"), ("int8", "int8")])
def test_greedy_tokens_agree_with_float32_kv(loaded, prompts, float32_tokens, name, kind):
    engine = engine_on(loaded, dtype="float32", kv_cache_dtype=name)
    k_cache, v_cache = engine.runner.kv_cache[0]
    assert isinstance(k_cache, PackedKV) and k_cache.kind == kind and isinstance(v_cache, PackedKV)
    got = tokens(engine, prompts)
    assert agreement(float32_tokens, got) >= MIN_AGREEMENT[kind]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_int8_preemption_changes_no_token(loaded, prompts, mode):
    """Swapped blocks carry their scales; recomputed ones are quantized to the same bytes."""
    expected = tokens(engine_on(loaded, dtype="float32", kv_cache_dtype="int8"), prompts)
    engine = engine_on(loaded, dtype="float32", kv_cache_dtype="int8", block_size=4, num_blocks=18,
                       preemption_mode=mode, swap_space=0.01, max_num_batched_tokens=32)
    assert tokens(engine, prompts) == expected
    assert engine.scheduler.num_preemptions > 0
    if mode == "swap":
        assert isinstance(engine.runner.host_cache[0][0], PackedKV)


def test_blocks_for_a_memory_budget_grow_by_the_dtype_ratio(loaded, caplog):
    """Tiny model: 2 layers, 2 KV heads, head_dim 16; float32 64 bytes a head and token, fp16/bf16 32,
    int8 16 + a 4-byte scale = 20: 2x and 3.2x the blocks (4x less the scales)."""
    budget = 1 << 20
    blocks, per_token = {}, {}
    for name in ("auto", "fp16", "bf16", "int8"):
        with caplog.at_level(logging.INFO, logger="vllmlite.engine.llm_engine"):
            engine = engine_on(loaded, dtype="float32", kv_cache_dtype=name, num_blocks=None, kv_cache_memory=budget)
        blocks[name] = engine.block_manager.num_blocks
        per_token[name] = engine.memory_report()["kv_bytes_per_token"]
        assert engine.runner.kv_cache_bytes == blocks[name] * 16 * per_token[name] <= budget
        assert f"dtype {name}" in caplog.text and f"{per_token[name]} bytes per token" in caplog.text
    assert per_token == {"auto": 2 * 2 * 2 * 16 * 4, "fp16": 256, "bf16": 256, "int8": 2 * 2 * 2 * 20}
    assert blocks["fp16"] == blocks["bf16"] == 2 * blocks["auto"]
    assert blocks["int8"] == budget // (16 * 160) and abs(blocks["int8"] / blocks["auto"] - 3.2) < 0.01


@pytest.mark.parametrize("values, message", [
    ({"kv_cache_dtype": "fp8_e5m2"}, "kv_cache_dtype must be one of"),
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype 'fp8' needs the torch kernels"),
    ({"kv_cache_dtype": "fp8_e4m3", "kernels": "numpy"}, "kv_cache_dtype 'fp8_e4m3' needs the torch kernels"),
    ({"kv_cache_dtype": "int8", "kernels": "torch"}, "kv_cache_dtype 'int8' needs the numpy or numba kernels"),
    ({"kv_cache_dtype": "fp16", "kernels": "torch", "dtype": "float32"}, "kv_cache_dtype 'fp16' needs"),
])
def test_unsupported_kv_cache_dtypes_are_refused_at_config_time(values, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        EngineArgs(model="random", **values).create_engine_config()


def test_torch_accepts_its_own_half_dtype_as_kv_cache_dtype():
    config = EngineArgs(model="random", kernels="torch", dtype="bfloat16", kv_cache_dtype="bf16").create_engine_config()
    assert config.cache.kv_kind == "bf16"


def test_int8_with_a_draft_model_changes_no_greedy_token(loaded, prompts):
    """The draft's K/V are stored as the target's; guesses verified against int8 K/V give the tokens
    of plain int8 decoding."""
    expected = tokens(engine_on(loaded, dtype="float32", kv_cache_dtype="int8"), prompts)
    engine = engine_on(loaded, dtype="float32", kv_cache_dtype="int8",
                       speculative_config={"method": "self_draft", "num_draft_layers": 1, "num_speculative_tokens": 3})
    assert isinstance(engine.runner.proposer.kv_cache[0][0], PackedKV)
    assert tokens(engine, prompts) == expected


@pytest.fixture(scope="module")
def heads_of_64(loaded):
    """The random model with 6 query heads of 64 over 2 KV heads: over int8 K its decodes take q . k
    from the rounded queries' integers where the CPU has AVX-512 VNNI (head_dim a multiple of 64;
    block_products.packed_scores), while short queries and prefill tiles attend with the rounded
    floats."""
    config = dataclasses.replace(loaded.config, num_heads=6, head_dim=64)
    return dataclasses.replace(loaded, config=config, weights=random_weights(config, np.dtype("float32"), seed=1))


@pytest.mark.parametrize("knobs", [
    dict(block_size=4, max_num_batched_tokens=8), dict(block_size=4, enable_prefix_caching=False),
    dict(block_size=4, num_blocks=40, preemption_mode="swap", swap_space=0.01, max_num_batched_tokens=32),
    dict(speculative_config={"method": "self_draft", "num_draft_layers": 1, "num_speculative_tokens": 3}),
], ids=["chunks-of-8", "no-prefix-cache", "swap", "self-draft"])
def test_no_serving_knob_changes_an_int8_greedy_token_at_head_dim_64(heads_of_64, prompts, knobs):
    """Chunks (a chunk of one token is a decode), speculative verification (short queries) and swaps
    meet the integer scores and the rounded floats of the other paths: the same tokens."""
    expected = tokens(engine_on(heads_of_64, dtype="float32", kv_cache_dtype="int8"), prompts)
    engine = engine_on(heads_of_64, dtype="float32", kv_cache_dtype="int8", **knobs)
    assert tokens(engine, prompts) == expected
    if "preemption_mode" in knobs:
        assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_sliding_window_frees_packed_blocks_and_changes_no_token(loaded, kind):
    """Every layer sliding over 5 tokens, 16 tokens of packed KV for 30 + 40: the freed (and reused)
    blocks before each window are widened but never read, so the tokens are those of a cache that
    holds the whole sequence in the same dtype."""
    config = dataclasses.replace(loaded.config, layer_types=("sliding",) * loaded.config.num_layers, sliding_window=5)
    model, prompt = dataclasses.replace(loaded, config=config), list(range(1, 31))
    runs = [run_to_completion(engine_on(model, dtype="float32", kv_cache_dtype=kind, block_size=4,
                                        num_blocks=num_blocks, max_num_batched_tokens=4), [(prompt, greedy(40))])
            for num_blocks in (4, 64)]
    assert runs[0][0].outputs[0].token_ids == runs[1][0].outputs[0].token_ids


# fp8 (float8 e4m3, torch kernels only), measured as MIN_AGREEMENT's: 0.917 on these 8 prompts (7 of 8
# sequences identical), 0.938 on the 32 others (26 of 32): fp8 keeps 3 mantissa bits to int8's 7.
FP8_MIN_AGREEMENT = 0.8


@pytest.fixture(scope="module")
def fp8_tokens(loaded, prompts) -> list[list[int]]:
    return tokens(engine_on(loaded, dtype="float32", kernels="torch", kv_cache_dtype="fp8"), prompts)


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3"])
def test_fp8_on_torch_stores_float8_and_agrees_with_float32_kv(loaded, prompts, float32_tokens, name):
    torch = pytest.importorskip("torch")
    engine = engine_on(loaded, dtype="float32", kernels="torch", kv_cache_dtype=name)
    assert engine.kv_kind == "fp8" and engine.runner.kv_cache[0][0].dtype == torch.float8_e4m3fn
    assert agreement(float32_tokens, tokens(engine, prompts)) >= FP8_MIN_AGREEMENT


@pytest.mark.parametrize("knobs", [
    dict(block_size=1, num_blocks=2048), dict(block_size=4, max_num_batched_tokens=8),
    dict(block_size=4, enable_prefix_caching=False),
    dict(block_size=4, num_blocks=18, preemption_mode="recompute", max_num_batched_tokens=32),
    dict(block_size=4, num_blocks=18, preemption_mode="swap", swap_space=0.01, max_num_batched_tokens=32),
    dict(speculative_config={"method": "self_draft", "num_draft_layers": 1, "num_speculative_tokens": 3}),
], ids=["block-1", "chunks-of-8", "no-prefix-cache", "recompute", "swap", "self-draft"])
def test_no_serving_knob_changes_an_fp8_greedy_token(loaded, prompts, fp8_tokens, knobs):
    """Each token's K/V are rounded alone, so every path stores the same bytes (swaps copy them)."""
    pytest.importorskip("torch")
    engine = engine_on(loaded, dtype="float32", kernels="torch", kv_cache_dtype="fp8", **knobs)
    assert tokens(engine, prompts) == fp8_tokens
    if "preemption_mode" in knobs:
        assert engine.scheduler.num_preemptions > 0
    if knobs.get("preemption_mode") == "swap":
        assert engine.runner.host_cache[0][0].dtype == engine.runner.kv_cache[0][0].dtype


def test_fp8_holds_four_times_float32s_blocks(loaded):
    pytest.importorskip("torch")
    blocks = {name: engine_on(loaded, dtype="float32", kernels="torch", kv_cache_dtype=name, num_blocks=None,
                              kv_cache_memory=1 << 20).block_manager.num_blocks for name in ("auto", "fp8")}
    assert blocks["fp8"] == 4 * blocks["auto"]
