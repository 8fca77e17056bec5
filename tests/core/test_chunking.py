"""Adaptive chunked prefill: the step-time model, the policy's budget, and that chunking never changes a token."""

from __future__ import annotations

import doctest
import logging

import numpy as np
import pytest
from conftest import greedy, make_prompts, run_to_completion
from reference import dense_greedy

from vllmlite.config import SchedulerConfig
from vllmlite.core import chunking
from vllmlite.core.batch import ScheduledSequence, SchedulerOutput
from vllmlite.core.chunking import MIN_OBSERVATIONS, ChunkingPolicy, StepLoad, StepShape, StepTimeModel
from vllmlite.core.sliding_window import SlidingWindow
from vllmlite.kernels import BACKENDS

MAX_TOKENS = 10
# A synthetic cost (seconds): 20 ms a step, 2 ms a decode row, 1 ms a prefill token, 0.1 ms per 1000 pairs,
# 20 ms per 1000 tokens of context before the prefill chunks, 30 ms more for a step with any prefill.
COST = np.array([0.020, 0.002, 0.001, 0.0001, 0.020, 0.030])


def synthetic_seconds(shape: StepShape) -> float:
    return float(shape.features @ COST)


def trained(policy: ChunkingPolicy, steps: int = 40, seed: int = 0) -> ChunkingPolicy:
    """`policy` with its model fitted to COST over varied steps, as large as these tests' shares."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        rows, tokens = int(rng.integers(0, 16)), int(rng.integers(0, 600)) * int(rng.integers(0, 2))
        shape = StepShape(rows, tokens, int(rng.integers(0, 300_000)), int(rng.integers(0, 2000)) if tokens else 0)
        policy.model.observe(shape, synthetic_seconds(shape))
    return policy


def frozen_adaptive(engine, target_tpot_ms: float):
    """The engine's policy made adaptive at `target_tpot_ms`, trained on COST and deaf to real step
    times from then on, so its chunk sizes are the same on every run."""
    policy = engine.chunking
    policy.policy, policy.target_tpot_ms = "adaptive", target_tpot_ms
    trained(policy)
    policy.observe = lambda scheduled, seconds: None
    return engine


def load(**values) -> StepLoad:
    defaults = dict(num_decode_rows=0, decode_attention_pairs=0, prefill_start=0, prompt_tokens_left=100,
                    short_prompt_tokens=0, num_free_blocks=1000)
    return StepLoad(**{**defaults, **values})


def outputs_of(engine, prompts, arrivals=None) -> list[list[int]]:
    results = run_to_completion(engine, [(p, greedy(MAX_TOKENS)) for p in prompts], arrivals=arrivals)
    return [r.outputs[0].token_ids for r in results]


def test_the_worked_examples_in_the_docstrings_hold():
    assert doctest.testmod(chunking).failed == 0


# --- the step-time model --------------------------------------------------------------------------


def test_step_time_model_converges_on_a_synthetic_cost_function():
    model = StepTimeModel()
    rng = np.random.default_rng(1)
    for _ in range(300):
        tokens = int(rng.integers(0, 512)) * int(rng.integers(0, 2))
        shape = StepShape(int(rng.integers(0, 32)), tokens, int(rng.integers(0, 200_000)),
                          int(rng.integers(0, 3000)) if tokens else 0)
        model.observe(shape, synthetic_seconds(shape) * rng.normal(1.0, 0.02))  # 2% timing noise
    np.testing.assert_allclose(model.coefficients, COST, rtol=0.1)
    probe = StepShape(8, 256, 100_000, 1000)
    assert model.predict(probe) == pytest.approx(synthetic_seconds(probe), rel=0.03)
    fit = model.snapshot()
    assert fit.num_observations == 300 and fit.per_prefill_token_ms == pytest.approx(1.0, rel=0.1)
    assert fit.per_context_ktoken_ms == pytest.approx(20.0, rel=0.1)
    assert fit.per_prefill_step_ms == pytest.approx(30.0, rel=0.1)


def test_step_time_model_never_fits_a_negative_cost():
    model = StepTimeModel()
    for tokens in range(0, 200, 10):  # time falls as prefill grows: the best non-negative fit is flat
        model.observe(StepShape(4, tokens, 0), 0.1 - tokens * 1e-4)
    assert (model.coefficients >= 0).all()
    assert model.coefficients[2] == 0.0


def test_a_quiet_stretch_of_decoding_does_not_forget_what_prefill_costs():
    model = StepTimeModel(window=32)
    for tokens in (64, 128, 256) * 4:
        shape = StepShape(4, tokens, tokens * tokens // 2)
        model.observe(shape, synthetic_seconds(shape))
    for _ in range(1000):
        shape = StepShape(4, 0, 400)
        model.observe(shape, synthetic_seconds(shape))
    assert model.coefficients[2] == pytest.approx(COST[2], rel=0.05)


# --- the policy's budget ---------------------------------------------------------------------------


def test_fixed_policy_gives_prompts_the_whole_budget():
    policy = trained(ChunkingPolicy(SchedulerConfig(max_num_batched_tokens=256), block_size=16))
    share = policy.prefill_share(load(num_decode_rows=12, num_free_blocks=1, short_prompt_tokens=5))
    assert (share.num_left, share.per_request) == (256, 256)


def test_with_no_decodes_the_whole_budget_goes_to_prefill():
    config = SchedulerConfig(max_num_batched_tokens=512, prefill_chunking="adaptive", target_tpot_ms=30.0)
    share = trained(ChunkingPolicy(config, block_size=16)).prefill_share(load(num_decode_rows=0))
    assert (share.num_left, share.per_request) == (512, 512)


def test_decodes_get_the_largest_share_that_meets_the_target():
    config = SchedulerConfig(max_num_batched_tokens=512, prefill_chunking="adaptive", target_tpot_ms=100.0)
    policy = trained(ChunkingPolicy(config, block_size=16))
    # 20 + 2 * 10 = 40 ms of decoding and 30 for having a prompt chunk leave 30 ms: 1 ms a token,
    # 0.1 ms per 1000 pairs (P * (P + 1) / 2).
    share = policy.prefill_share(load(num_decode_rows=10))
    assert share.num_left == 29
    stats = policy.snapshot()
    assert stats.predicted_step_ms <= 100.0 and stats.budget_by_time == 29
    # Decoding alone over the target: prompts still progress by one block a step.
    assert policy.prefill_share(load(num_decode_rows=60)).num_left == 16


def test_without_a_target_the_decodes_own_step_time_is_stretched_by_half():
    """40 decode rows alone: 20 + 2 * 40 = 100 ms predicted, so the target is 150 ms, leaving 20 after
    the 30 a step with a prompt chunk costs: P + 0.1 * P (P + 1) / 2 / 1000 <= 20 ms gives P = 19.
    60 rows: 140 ms alone, a 210 ms target, P = 39."""
    config = SchedulerConfig(max_num_batched_tokens=512, prefill_chunking="adaptive")
    assert config.target_tpot_ms is None
    policy = trained(ChunkingPolicy(config, block_size=16))
    assert policy.prefill_share(load(num_decode_rows=40)).num_left == 19
    assert policy.snapshot().target_tpot_ms == pytest.approx(150.0)
    assert policy.prefill_share(load(num_decode_rows=60)).num_left == 39
    assert policy.snapshot().target_tpot_ms == pytest.approx(210.0)


def test_a_chunk_deep_in_a_long_prompt_pays_for_its_context():
    """Its context costs 20 ms per 1000 tokens whatever the chunk's length: 1000 tokens in, 40 + 30 +
    20 = 90 ms of the 120 are gone before a token, and P + 0.1 * (1000 P + P (P + 1) / 2) / 1000 <= 30
    ms gives P = 27 (49 at the prompt's start)."""
    config = SchedulerConfig(max_num_batched_tokens=512, prefill_chunking="adaptive", target_tpot_ms=120.0)
    policy = trained(ChunkingPolicy(config, block_size=16))
    assert policy.prefill_share(load(num_decode_rows=10, prefill_start=1000)).num_left == 27
    assert policy.prefill_share(load(num_decode_rows=10, prefill_start=0)).num_left == 49
    chunk = StepShape.of(SchedulerOutput([ScheduledSequence(None, list(range(30)), 1000, [0]),
                                          ScheduledSequence(None, [5], 70, [0])]))
    assert (chunk.num_decode_rows, chunk.num_prefill_tokens, chunk.prefill_context) == (1, 30, 1000)


def shares_over_steps(policy: ChunkingPolicy, num_steps: int, **values) -> list[int]:
    """The prompt share of each of num_steps steps of 10 decodes beside a prompt 3000 tokens in, each
    step measured at exactly COST's time for what it ran."""
    shares = []
    for _ in range(num_steps):
        share = policy.prefill_share(load(num_decode_rows=10, prefill_start=3000, **values)).num_left
        decodes = [ScheduledSequence(None, [5], 70, [0]) for _ in range(10)]
        step = SchedulerOutput(decodes + ([ScheduledSequence(None, list(range(share)), 3000, [0])] if share else []))
        policy.observe(step, synthetic_seconds(StepShape.of(step)))
        shares.append(share)
    return shares


@pytest.mark.parametrize("target_tpot_ms, expected", [
    # One block 3000 tokens in: 151 ms predicted; the decodes alone 40. At 100 ms a block overruns by
    # 51, the next step's decodes alone make up 60: blocks every other step.
    (100.0, [16, 0] * 4),
    # At 45 ms the decodes make up 5 ms a step: the block waits the most steps allowed, then goes.
    (45.0, [16] + [0] * chunking.MAX_DEFERRED_STEPS + [16]),
    # At 30 ms the decodes alone overrun: waiting would never help, so a block every step.
    (30.0, [16] * 6),
])
def test_a_block_over_the_target_waits_until_the_decodes_make_up_for_the_overrun(target_tpot_ms, expected):
    config = SchedulerConfig(max_num_batched_tokens=512, prefill_chunking="adaptive", target_tpot_ms=target_tpot_ms)
    policy = trained(ChunkingPolicy(config, block_size=16))
    assert shares_over_steps(policy, len(expected)) == expected


def test_short_prompts_waiting_are_not_held_to_make_up_an_overrun():
    config = SchedulerConfig(max_num_batched_tokens=512, prefill_chunking="adaptive", target_tpot_ms=100.0)
    policy = trained(ChunkingPolicy(config, block_size=16))
    assert shares_over_steps(policy, 4, short_prompt_tokens=40) == [16] * 4


def test_an_unfitted_model_gives_prompts_one_block_beside_decodes():
    config = SchedulerConfig(max_num_batched_tokens=512, prefill_chunking="adaptive", target_tpot_ms=1000.0)
    policy = ChunkingPolicy(config, block_size=16)
    assert not policy.model.is_fitted and MIN_OBSERVATIONS > 0
    assert policy.prefill_share(load(num_decode_rows=10)).num_left == 16
    assert policy.prefill_share(load(num_decode_rows=0)).num_left == 512  # nothing decoding: the whole budget


def test_the_share_grows_by_doublings_past_the_largest_step_measured():
    """Fitted on short prompts only, the model would let a huge long-context chunk through (its
    attention never measured); the share may reach twice what was seen, then twice that."""
    config = SchedulerConfig(max_num_batched_tokens=2048, prefill_chunking="adaptive", target_tpot_ms=10_000.0)
    policy = ChunkingPolicy(config, block_size=16)
    for tokens in [0, 64] * 8:
        shape = StepShape(8, tokens, 8 * 100 + tokens * (tokens + 1) // 2)
        policy.model.observe(shape, synthetic_seconds(shape))
    share = policy.prefill_share(load(num_decode_rows=8, decode_attention_pairs=800, prompt_tokens_left=2000))
    # Twice the most attention measured, 2 * (800 + 64 * 65 / 2) = 5760 pairs: 800 + 99 * 100 / 2 fits, 100 does not.
    assert share.num_left == 99
    shape = StepShape(8, 120, 800 + 120 * 121 // 2)
    policy.model.observe(shape, synthetic_seconds(shape))
    grown = policy.prefill_share(load(num_decode_rows=8, decode_attention_pairs=800, prompt_tokens_left=2000))
    assert 120 < grown.num_left <= 240


def test_few_free_blocks_shrink_the_share_keeping_room_for_the_decodes():
    config = SchedulerConfig(max_num_batched_tokens=512, prefill_chunking="adaptive", target_tpot_ms=1000.0)
    policy = trained(ChunkingPolicy(config, block_size=16))
    # 100 tokens left fit in one step: 7 blocks for the prompt, one for each of 10 decodes; the
    # share is what the blocks beyond the decodes' hold, (17 - 10) * 16.
    assert policy.prefill_share(load(num_decode_rows=10, num_free_blocks=17)).num_left == 112
    assert policy.prefill_share(load(num_decode_rows=10, num_free_blocks=16)).num_left == 0
    # 4000 tokens left at 502 a step: 8 steps, a block per decode; 250 blocks + 10 fit in 270.
    share = policy.prefill_share(load(num_decode_rows=10, num_free_blocks=270, prompt_tokens_left=4000))
    assert share.num_left == 502
    assert policy.prefill_share(load(num_decode_rows=10, num_free_blocks=259, prompt_tokens_left=4000)).num_left == 0
    # Nothing decoding: nothing to protect, the allocator decides.
    assert policy.prefill_share(load(num_free_blocks=2, prompt_tokens_left=4000)).num_left == 32


def test_under_a_sliding_window_a_long_prompt_needs_only_its_window_beside_the_decodes():
    """4000 tokens need 250 blocks of 16; under a window of 64 with chunks of 512, a step holds at
    most ceil((64 + 510) / 16) + 1 = 37 of them, which the 60 free blocks (10 kept for decodes) hold.
    (The scheduler fills prompt_blocks_left so: Scheduler._step_load.)"""
    config = SchedulerConfig(max_num_batched_tokens=512, prefill_chunking="adaptive", target_tpot_ms=1000.0)
    policy = trained(ChunkingPolicy(config, block_size=16))
    full = load(num_decode_rows=10, num_free_blocks=60, prompt_tokens_left=4000)
    assert policy.prefill_share(full).num_left == 0
    windowed = load(num_decode_rows=10, num_free_blocks=60, prompt_tokens_left=4000,
                    prompt_blocks_left=SlidingWindow(64, 16).peak_blocks(4000, 512))
    assert windowed.prompt_blocks_left == 37
    assert policy.prefill_share(windowed).num_left == 502  # the budget less the decode rows, not memory


def test_short_prompts_waiting_get_room_beside_a_long_one():
    config = SchedulerConfig(max_num_batched_tokens=256, prefill_chunking="adaptive")
    policy = ChunkingPolicy(config, block_size=16)
    assert policy.long_prompt_threshold == 256 // 8
    assert policy.prefill_share(load(short_prompt_tokens=40)).per_request == 256 - 40
    assert policy.prefill_share(load(short_prompt_tokens=200)).per_request == 128  # the long one keeps half
    assert policy.prefill_share(load(short_prompt_tokens=0)).per_request == 256


# --- the engine under the policy ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(8, seed=2, min_len=1, max_len=90)


@pytest.fixture(scope="module")
def expected(tiny_model, prompts) -> list[list[int]]:
    return [dense_greedy(tiny_model, p, MAX_TOKENS) for p in prompts]


ARRIVALS = {i: 2 * i for i in range(8)}  # each prompt arrives while earlier ones decode


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("target_tpot_ms", [25.0, 40.0, 1000.0])
def test_greedy_identical_under_both_policies(make_engine, prompts, expected, backend, target_tpot_ms):
    fixed = make_engine(kernels=backend, max_num_batched_tokens=64)
    assert outputs_of(fixed, prompts, ARRIVALS) == expected
    adaptive = frozen_adaptive(make_engine(kernels=backend, max_num_batched_tokens=64), target_tpot_ms)
    assert outputs_of(adaptive, prompts, ARRIVALS) == expected


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_greedy_identical_under_adaptive_chunking_with_measured_times(make_engine, prompts, expected, backend):
    """The real policy on real (noisy) step times: whatever chunks it picks, the tokens are the same."""
    engine = make_engine(kernels=backend, prefill_chunking="adaptive", target_tpot_ms=0.5, max_num_batched_tokens=64)
    assert outputs_of(engine, prompts, ARRIVALS) == expected
    assert engine.get_stats().scheduler.chunking.step_time_model.num_observations > 0


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_greedy_identical_under_adaptive_chunking_with_a_shared_prefix(make_engine, prompts, backend):
    shared = prompts[3][:24]
    with_prefix = [shared + p for p in prompts]
    want = outputs_of(make_engine(kernels=backend, block_size=4, enable_prefix_caching=False), with_prefix)
    engine = frozen_adaptive(make_engine(kernels=backend, block_size=4), 30.0)
    assert outputs_of(engine, with_prefix, ARRIVALS) == want
    assert outputs_of(engine, with_prefix, ARRIVALS) == want  # the second pass hits the cached prefix
    assert engine.get_stats().scheduler.prefix_cache_hits >= len(with_prefix) * 24


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_identical_under_adaptive_chunking_and_preemption(make_engine, prompts, expected, backend, mode):
    # 24 blocks of 4 tokens cannot hold 8 sequences of up to 100 tokens: preemption is forced.
    engine = frozen_adaptive(make_engine(kernels=backend, block_size=4, num_blocks=24, preemption_mode=mode,
                                         swap_space=0.01, max_num_batched_tokens=32), 30.0)
    assert outputs_of(engine, prompts) == expected
    assert engine.get_stats().scheduler.num_preemptions > 0


def test_a_short_prompt_behind_a_long_one_is_admitted_in_the_same_step(make_engine):
    engine = make_engine(prefill_chunking="adaptive", max_num_batched_tokens=64, block_size=4)
    engine.add_request("long", list(range(1, 200)), greedy(4))
    engine.step()                       # the long prompt takes the whole budget: nothing else waits
    engine.add_request("short", list(range(1, 9)), greedy(4))
    engine.step()
    progress = {r.request_id: r.num_computed_tokens for r in engine.scheduler.running}
    assert progress == {"long": 64 + 64 - 8, "short": 8}  # 8 tokens: short (the threshold is 64 // 8)
    fixed = make_engine(max_num_batched_tokens=64, block_size=4)
    fixed.add_request("long", list(range(1, 200)), greedy(4))
    fixed.step()
    fixed.add_request("short", list(range(1, 9)), greedy(4))
    fixed.step()
    assert [r.request_id for r in fixed.scheduler.running] == ["long"]  # fixed: it waits behind the long one


def test_short_prompts_pass_a_long_one_waiting_behind_another_long_one(make_engine):
    engine = make_engine(prefill_chunking="adaptive", max_num_batched_tokens=64, block_size=4)
    engine.add_request("long-a", list(range(1, 200)), greedy(4))
    engine.step()
    engine.add_request("long-b", list(range(1, 200)), greedy(4))
    engine.add_request("short", list(range(1, 7)), greedy(4))
    engine.step()
    progress = {r.request_id: r.num_computed_tokens for r in engine.scheduler.running}
    assert progress == {"long-a": 64 + 64 - 6, "short": 6}  # long-b waits for long-a; the short one passes it
    assert [r.request_id for r in engine.scheduler.waiting] == ["long-b"]
    fixed = make_engine(max_num_batched_tokens=64, block_size=4)
    results = run_to_completion(fixed, [(list(range(1, 200)), greedy(4)), (list(range(1, 200)), greedy(4)),
                                        (list(range(1, 7)), greedy(4))], arrivals={1: 1, 2: 1})
    adaptive = make_engine(prefill_chunking="adaptive", max_num_batched_tokens=64, block_size=4)
    assert [r.outputs[0].token_ids for r in run_to_completion(
        adaptive, [(list(range(1, 200)), greedy(4)), (list(range(1, 200)), greedy(4)), (list(range(1, 7)), greedy(4))],
        arrivals={1: 1, 2: 1})] == [r.outputs[0].token_ids for r in results]


def test_under_memory_pressure_chunks_shrink_before_any_preemption(make_engine):
    """Four decoding requests and a long prompt in 40 blocks of 4: the fixed budget admits the prompt
    as soon as its first chunk fits, and it is preempted when the rest does not; the adaptive share
    holds it back until all of it fits beside the decodes, so nothing is preempted."""
    decoders = [(p, greedy(30)) for p in make_prompts(4, seed=3, min_len=6, max_len=6)]
    long_prompt = (make_prompts(1, seed=4, min_len=120, max_len=120)[0], greedy(4))
    arrivals = {4: 3}
    runs = {}
    for policy in ("fixed", "adaptive"):
        engine = make_engine(prefill_chunking=policy, target_tpot_ms=1000.0, block_size=4, num_blocks=40,
                             max_num_batched_tokens=64)
        budgets = []
        original = engine.scheduler.schedule

        def spy():
            out = original()
            budgets.append(engine.get_stats().scheduler.chunking.prefill_budget)
            return out

        engine.scheduler.schedule = spy
        runs[policy] = ([r.outputs[0].token_ids for r in run_to_completion(engine, decoders + [long_prompt],
                                                                            arrivals)],
                        engine.get_stats().scheduler.num_preemptions, budgets)
    assert runs["fixed"][0] == runs["adaptive"][0]
    assert runs["fixed"][1] > 0
    assert runs["adaptive"][1] == 0
    assert min(runs["adaptive"][2]) == 0 and max(runs["adaptive"][2]) == 64


def test_the_policy_and_fitted_model_are_in_the_stats_and_the_debug_log(make_engine, caplog):
    engine = make_engine(prefill_chunking="adaptive", target_tpot_ms=80.0, max_num_batched_tokens=32)
    with caplog.at_level(logging.DEBUG, logger="vllmlite.core.chunking"):
        run_to_completion(engine, [(p, greedy(6)) for p in make_prompts(4, seed=5, min_len=20, max_len=60)],
                          arrivals={1: 2, 2: 4, 3: 6})
    stats = engine.get_stats().scheduler.chunking
    assert (stats.policy, stats.target_tpot_ms) == ("adaptive", 80.0)
    assert stats.step_time_model.num_observations >= MIN_OBSERVATIONS
    assert stats.last_step_ms > 0 and stats.step_time_model.intercept_ms >= 0
    assert any(r.message.startswith("prefill budget") for r in caplog.records)
