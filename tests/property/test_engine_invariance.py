"""Greedy output is one thing: no knob of the serving machinery may change a token."""

from __future__ import annotations

import pytest
from conftest import engine_on, greedy, make_prompts, run_to_completion
from paths import GOLDENS
from reference import dense_greedy

from vllmlite.models.loader import LoadedModel, load_model
from vllmlite.sampling_params import SamplingParams

MAX_TOKENS = 12


@pytest.fixture(scope="module", params=["random", "qwen3", "qwen3_moe", "mistral", "gemma2", "gemma3"])
def tiny_model(request) -> LoadedModel:
    """The random Llama, and families whose layers do more (Qwen3's per-head q/k norms, head_dim
    twice hidden / heads, tied embeddings; Qwen3-MoE's routed experts, whose choice depends on each
    token alone, so batching must not move it; Mistral's 8-token sliding window on every layer, far
    shorter than most prompts; Gemma 2's soft-caps and 6-token window on alternate layers; Gemma 3's
    5 sliding : 1 full layers with two RoPEs), in float64."""
    model = "random" if request.param == "random" else str(GOLDENS / "families" / request.param)
    return load_model(model, dtype="float64")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(8, seed=1, min_len=1, max_len=70)


@pytest.fixture(scope="module")
def expected(tiny_model, prompts) -> list[list[int]]:
    """Each prompt's greedy continuation from the dense, cache-free reference."""
    return [dense_greedy(tiny_model, p, MAX_TOKENS) for p in prompts]


def outputs_of(engine, prompts, **run_kwargs) -> list[list[int]]:
    results = run_to_completion(engine, [(p, greedy(MAX_TOKENS)) for p in prompts], **run_kwargs)
    return [r.outputs[0].token_ids for r in results]


def sized_for_full_attention(model: LoadedModel) -> None:
    """The tests that count preemptions or swaps, or run a sequence out of the cache, size their
    pool for full attention; a model whose every layer slides (Mistral) holds its window's blocks
    only and never runs short there (the scheduler's own tests preempt, swap and refuse with
    sliding-window tables: tests/core/test_scheduler_sliding_window.py, tests/engine/test_sliding_window_engine.py)."""
    if model.config.uniform_sliding_window:
        pytest.skip("every layer slides: a pool sized for full attention never runs short")


@pytest.mark.parametrize("block_size", [1, 4, 16, 64])
def test_greedy_identical_across_block_sizes(make_engine, prompts, expected, block_size):
    engine = make_engine(block_size=block_size, num_blocks=4096 // block_size)
    assert outputs_of(engine, prompts) == expected


@pytest.mark.parametrize("budget", [8, 33, 64, 4096])
def test_greedy_identical_across_token_budgets(make_engine, prompts, expected, budget):
    engine = make_engine(max_num_batched_tokens=budget)
    assert outputs_of(engine, prompts) == expected


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_greedy_identical_with_and_without_prefix_caching(make_engine, prompts, expected,
                                                          enable_prefix_caching):
    engine = make_engine(enable_prefix_caching=enable_prefix_caching, block_size=4)
    shared = prompts[3][:24]
    with_prefix = [shared + p for p in prompts]  # every prompt shares 24 tokens = 6 blocks
    first = outputs_of(engine, with_prefix)
    again = outputs_of(engine, with_prefix)  # second pass hits blocks cached by the first
    assert first == again
    # On: every request of the second pass hits at least the 6 shared blocks. Off: nothing hits.
    hits = engine.get_stats().scheduler.prefix_cache_hits
    assert hits >= len(with_prefix) * 24 if enable_prefix_caching else hits == 0
    engine_off = make_engine(enable_prefix_caching=False, block_size=4)
    assert outputs_of(engine_off, with_prefix) == first
    assert outputs_of(make_engine(), prompts) == expected


def test_request_alone_batched_and_arriving_mid_flight_agree(make_engine, prompts, expected):
    alone = [outputs_of(make_engine(), [p])[0] for p in prompts[:3]]
    assert alone == expected[:3]
    assert outputs_of(make_engine(), prompts) == expected  # batched with 7 others
    arrivals = {i: 3 * i for i in range(len(prompts))}     # each arrives while others decode
    assert outputs_of(make_engine(max_num_batched_tokens=16), prompts, arrivals=arrivals) == expected


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_identical_under_forced_preemption(make_engine, tiny_model, prompts, expected, mode):
    engine = make_engine(block_size=4, num_blocks=24, preemption_mode=mode, swap_space=0.01,
                         max_num_batched_tokens=32)
    assert outputs_of(engine, prompts) == expected
    assert engine.get_stats().scheduler.num_preemptions > 0


def test_swap_preemption_actually_swaps(make_engine, tiny_model, prompts, expected):
    sized_for_full_attention(tiny_model)
    engine = make_engine(block_size=4, num_blocks=24, preemption_mode="swap", swap_space=0.01)
    swaps = []
    original = engine.runner.copy_blocks

    def spy(out):
        swaps.append((len(out.blocks_to_swap_out), len(out.blocks_to_swap_in)))
        original(out)

    engine.runner.copy_blocks = spy
    assert outputs_of(engine, prompts) == expected
    assert sum(o for o, _ in swaps) > 0 and sum(i for _, i in swaps) > 0


@pytest.mark.parametrize("length", [1, 3, 4, 5, 8, 9])
def test_prompt_lengths_around_block_edges(make_engine, tiny_model, length):
    prompt = make_prompts(1, seed=length, min_len=length, max_len=length)[0]
    want = dense_greedy(tiny_model, prompt, MAX_TOKENS)
    for budget in (1, 3, 4, 64):  # budget 4 ends chunks exactly on block edges
        engine = make_engine(block_size=4, max_num_batched_tokens=budget)
        assert outputs_of(engine, [prompt, prompt]) == [want, want]


def test_full_prefix_hit_still_computes_last_token(make_engine, tiny_model):
    prompt = make_prompts(1, seed=5, min_len=16, max_len=16)[0]  # exactly 4 blocks of 4
    want = dense_greedy(tiny_model, prompt, MAX_TOKENS)
    engine = make_engine(block_size=4)
    assert outputs_of(engine, [prompt]) == [want]
    engine.add_request("again", prompt, greedy(MAX_TOKENS))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].outputs[0].token_ids == want
    assert outputs[-1].num_cached_tokens == 12  # 3 full blocks; the last block is recomputed


def test_concurrent_requests_share_a_system_prompt(make_engine, tiny_model):
    system = make_prompts(1, seed=9, min_len=32, max_len=32)[0]
    prompts = [system + p for p in make_prompts(4, seed=10, min_len=3, max_len=9)]
    engine = make_engine(block_size=4, max_num_batched_tokens=32)
    results = run_to_completion(engine, [(p, greedy(4)) for p in prompts])
    assert len(results) == len(prompts) == 4
    for p, r in zip(prompts, results):
        assert r.outputs[0].token_ids == dense_greedy(tiny_model, p, 4)
    # The first request publishes the shared blocks; later ones hit them while it still runs.
    assert [r.num_cached_tokens for r in results][1:] == [32, 32, 32]


def test_re_prefill_after_preemption_loses_no_token(make_engine, tiny_model, prompts, expected):
    sized_for_full_attention(tiny_model)
    engine = make_engine(block_size=4, num_blocks=20, max_num_batched_tokens=8)
    assert outputs_of(engine, prompts[:4]) == expected[:4]
    assert engine.get_stats().scheduler.num_preemptions > 0


def test_forked_samples_share_prompt_blocks_and_copy_on_write(make_engine):
    prompt = make_prompts(1, seed=3, min_len=10, max_len=10)[0]  # ends mid-block: the fork must copy
    params = SamplingParams(n=3, temperature=1.0, seed=123, max_tokens=8, ignore_eos=True)
    engine = make_engine(block_size=4)
    copies = []
    original = engine.runner.copy_blocks

    def spy(out):
        copies.extend(out.blocks_to_copy)
        original(out)

    engine.runner.copy_blocks = spy
    forked = run_to_completion(engine, [(prompt, params)])[0]
    assert len(forked.outputs) == 3 and len(copies) >= 2
    # Sample i of a seeded n > 1 request is the request alone with seed + i.
    for i, completion in enumerate(forked.outputs):
        alone = SamplingParams(temperature=1.0, seed=123 + i, max_tokens=8, ignore_eos=True)
        single = run_to_completion(make_engine(block_size=4), [(prompt, alone)])[0]
        assert completion.token_ids == single.outputs[0].token_ids


def test_abort_frees_every_block(make_engine, prompts):
    engine = make_engine(block_size=4)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy(50))
    for _ in range(5):
        engine.step()
    assert engine.get_stats().scheduler.num_kv_blocks_used > 0
    for i in range(len(prompts)):
        engine.abort_request(str(i))
    engine.block_manager.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.has_unfinished_requests() and not engine.scheduler.requests


def test_prompt_larger_than_cache_is_refused_and_others_run(make_engine, tiny_model):
    sized_for_full_attention(tiny_model)
    engine = make_engine(block_size=4, num_blocks=8)  # 32 tokens in all
    big = make_prompts(1, seed=2, min_len=40, max_len=40)[0]
    small = make_prompts(1, seed=3, min_len=5, max_len=5)[0]
    with pytest.raises(ValueError, match="KV cache holds at most 31 prompt tokens"):
        engine.add_request("big", big, greedy(4))
    with pytest.raises(ValueError, match="at most 31"):          # 32 tokens: no slot for the next one
        engine.add_request("full", big[:32], greedy(4))
    [result] = run_to_completion(engine, [(small, greedy(4))])
    assert result.outputs[0].finish_reason == "length" and len(result.outputs[0].token_ids) == 4


def test_sequence_outgrowing_the_cache_ends_with_length(make_engine, tiny_model):
    sized_for_full_attention(tiny_model)
    engine = make_engine(block_size=4, num_blocks=4)  # 16 tokens of KV in all
    prompt = make_prompts(1, seed=4, min_len=6, max_len=6)[0]
    result = run_to_completion(engine, [(prompt, greedy(100))])[0]
    assert result.outputs[0].finish_reason == "length"
    assert len(result.outputs[0].token_ids) == 16 - 6 + 1


def test_a_request_that_makes_the_engine_raise_fails_alone(make_engine, prompts, expected):
    engine = make_engine()
    poison = [7, 7, 7, 7, 7]

    def fault(out):
        if any(seq.request.prompt_token_ids == poison for seq in out.scheduled):
            raise RuntimeError("injected fault")

    engine.runner.fault_hook = fault
    requests = [(p, greedy(MAX_TOKENS)) for p in prompts[:3]] + [(poison, greedy(MAX_TOKENS))]
    results = run_to_completion(engine, requests)
    assert [r.outputs[0].token_ids for r in results[:3]] == expected[:3]
    assert results[3].outputs[0].finish_reason == "error" and "injected fault" in results[3].error


def test_static_batching_fills_a_batch_then_admits_no_one_until_it_is_done(make_engine, prompts, expected):
    engine = make_engine(max_num_seqs=3, batching="static", max_num_batched_tokens=16)
    scheduler = engine.scheduler
    batch: set = set()
    late_joiners, batch_sizes = [], []
    original = scheduler._schedule_waiting

    def spy(out, budget):
        before = {r.request_id for r in scheduler.running}
        if not before:
            batch.clear()
        original(out, budget)
        admitted = {r.request_id for r in scheduler.running} - before
        if admitted and batch - before:  # someone of this batch already finished: it is closed
            late_joiners.append(admitted)
        batch.update(admitted)
        batch_sizes.append(len(batch))

    scheduler._schedule_waiting = spy
    assert outputs_of(engine, prompts) == expected
    assert not late_joiners                      # no one takes a finished request's slot
    assert max(batch_sizes) == 3                 # yet a batch fills over several steps


def test_continuous_batching_refills_slots_as_requests_finish(make_engine, prompts, expected):
    engine = make_engine(max_num_seqs=3, max_num_batched_tokens=16)
    assert outputs_of(engine, prompts) == expected
    # The same workload takes fewer steps than with static batching.
    static = make_engine(max_num_seqs=3, batching="static", max_num_batched_tokens=16)
    assert outputs_of(static, prompts) == expected
    assert engine.get_stats().num_forward_passes < static.get_stats().num_forward_passes




# --- seeded sampling: the same tokens whatever the machinery does, as greedy ----------------------

def seeded_requests(prompts: list[list[int]]) -> list[tuple[list[int], SamplingParams]]:
    """Request i: its own seed, and a mix of filters and penalties."""
    return [(p, SamplingParams(temperature=0.9, top_p=0.95, top_k=[None, 40][i % 2], seed=1000 + i,
                               max_tokens=MAX_TOKENS, ignore_eos=True, presence_penalty=0.3 * (i % 3)))
            for i, p in enumerate(prompts)]


def sampled_outputs(engine, requests, **run_kwargs) -> list[list[int]]:
    results = run_to_completion(engine, requests, **run_kwargs)
    assert len(results) == len(requests)
    return [r.outputs[0].token_ids for r in results]


@pytest.fixture(scope="module")
def sampled_alone(tiny_model, prompts) -> list[list[int]]:
    """Each seeded request alone in a roomy engine: the reference for every knob below."""
    outputs = [sampled_outputs(engine_on(tiny_model), [request])[0] for request in seeded_requests(prompts)]
    assert all(len(o) == MAX_TOKENS for o in outputs)
    assert len({tuple(o) for o in outputs}) >= len(prompts) - 1   # distinct, so mixed-up streams show (two of
    # Gemma 2's tiny soft-capped samples coincide)
    return outputs


def test_seeded_sampling_identical_alone_batched_reordered_and_arriving_mid_flight(make_engine, prompts,
                                                                                   sampled_alone):
    requests = seeded_requests(prompts)
    assert sampled_outputs(make_engine(), requests) == sampled_alone
    assert sampled_outputs(make_engine(), requests[::-1]) == sampled_alone[::-1]
    arrivals = {i: 3 * i for i in range(len(prompts))}
    assert sampled_outputs(make_engine(max_num_batched_tokens=16), requests, arrivals=arrivals) == sampled_alone


@pytest.mark.parametrize("budget,block_size", [(8, 4), (33, 16), (4096, 1)])
def test_seeded_sampling_identical_across_chunking_and_block_sizes(make_engine, prompts, sampled_alone,
                                                                   budget, block_size):
    engine = make_engine(max_num_batched_tokens=budget, block_size=block_size, num_blocks=4096 // block_size)
    assert sampled_outputs(engine, seeded_requests(prompts)) == sampled_alone


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_seeded_sampling_identical_under_forced_preemption(make_engine, tiny_model, prompts, sampled_alone, mode):
    sized_for_full_attention(tiny_model)
    engine = make_engine(block_size=4, num_blocks=24, preemption_mode=mode, swap_space=0.01,
                         max_num_batched_tokens=32)
    swapped = []
    copy_blocks = engine.runner.copy_blocks

    def spy(out):
        swapped.append(len(out.blocks_to_swap_out))
        copy_blocks(out)

    engine.runner.copy_blocks = spy
    preempt = engine.scheduler._preempt
    num_sampled_when_preempted = []

    def preempt_spy(request, out):
        num_sampled_when_preempted.append(request.num_output_tokens)
        preempt(request, out)

    engine.scheduler._preempt = preempt_spy
    assert sampled_outputs(engine, seeded_requests(prompts)) == sampled_alone
    # Preempted mid-decode: requests had sampled tokens (drawn from their seeded stream) when they
    # lost their place, and went on drawing after it.
    assert any(0 < n < MAX_TOKENS for n in num_sampled_when_preempted)
    assert (sum(swapped) > 0) == (mode == "swap")


def test_seeded_sampling_identical_with_and_without_prefix_caching(make_engine, prompts):
    shared = prompts[3][:24]
    requests = seeded_requests([shared + p for p in prompts])       # 24 shared tokens = 6 blocks
    engine = make_engine(enable_prefix_caching=True, block_size=4)
    first = sampled_outputs(engine, requests)
    again = sampled_outputs(engine, requests)                        # every prompt hits the cache now
    stats = engine.get_stats().scheduler
    assert stats.prefix_cache_hits >= len(requests) * 24
    assert first == again
    off = make_engine(enable_prefix_caching=False, block_size=4)
    assert sampled_outputs(off, requests) == first
    assert off.get_stats().scheduler.prefix_cache_hits == 0
