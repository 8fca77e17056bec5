"""Speculative decoding changes speed, never the output: greedy equality, exact sampling, no leaks."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import greedy, make_prompts, run_to_completion
from reference import dense_greedy, dense_logits

from vllmlite.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from vllmlite.engine import LLMEngine
from vllmlite.sampling_params import SamplingParams
from vllmlite.speculative import Draft, NgramProposer, verify

MAX_TOKENS = 16
CHI2_P001 = {5: 20.515, 7: 24.322, 9: 27.877}  # chi-square critical values at p = 0.001 by dof


def spec_engine(tiny_model, spec: dict, **cache_overrides) -> LLMEngine:
    cache = CacheConfig(**{"num_blocks": 256, **cache_overrides})
    config = EngineConfig(model="random", dtype="float64", cache=cache,
                          scheduler=SchedulerConfig(max_num_batched_tokens=64),
                          speculative=SpeculativeConfig.from_dict(spec))
    return LLMEngine(config, tiny_model)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    # Repetitive prompts give the n-gram proposer something to find; random ones test rejection.
    repetitive = [([5, 6, 7, 8] * 6)[:n] for n in (9, 14, 23)]
    return repetitive + make_prompts(5, seed=21, max_len=30)


@pytest.fixture(scope="module")
def expected(tiny_model, prompts) -> list[list[int]]:
    return [dense_greedy(tiny_model, p, MAX_TOKENS) for p in prompts]


METHODS = [{"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3},
           {"method": "self_draft", "num_draft_layers": 1},
           {"method": "draft_model", "model": "random"}]


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("method", METHODS, ids=lambda m: m["method"])
def test_greedy_output_identical_with_speculation(tiny_model, prompts, expected, method, k):
    engine = spec_engine(tiny_model, {**method, "num_speculative_tokens": k})
    results = run_to_completion(engine, [(p, greedy(MAX_TOKENS)) for p in prompts])
    assert [r.outputs[0].token_ids for r in results] == expected
    stats = engine.get_stats().scheduler.spec_decode
    assert stats.num_draft_tokens > 0  # speculation really ran
    if method["method"] == "self_draft":
        assert stats.num_accepted_tokens > 0


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m["method"])
def test_greedy_identical_in_mixed_batches_with_preemption(tiny_model, prompts, expected, method):
    engine = spec_engine(tiny_model, {**method, "num_speculative_tokens": 4}, block_size=4, num_blocks=22)
    sampled = SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True)
    requests = [(p, greedy(MAX_TOKENS) if i % 2 == 0 else sampled) for i, p in enumerate(prompts)]
    results = run_to_completion(engine, requests)
    for i, r in enumerate(results):
        assert len(r.outputs[0].token_ids) == MAX_TOKENS
        if i % 2 == 0:
            assert r.outputs[0].token_ids == expected[i]
    assert engine.get_stats().scheduler.num_preemptions > 0


def test_stops_and_max_tokens_are_honored_mid_round(tiny_model, prompts, expected):
    prompt, want = prompts[0], expected[0]
    engine = spec_engine(tiny_model, {"method": "self_draft", "num_draft_layers": 1, "num_speculative_tokens": 8})
    cut = run_to_completion(engine, [(prompt, greedy(5))])[0]
    assert cut.outputs[0].token_ids == want[:5]
    stop_id = want[6]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, stop_token_ids=[stop_id])
    stopped = run_to_completion(engine, [(prompt, params)])[0]
    assert stopped.outputs[0].token_ids == want[:want.index(stop_id) + 1]


def test_ngram_proposer_proposes_what_followed_the_latest_match():
    proposer = NgramProposer(1, 3)
    assert proposer._lookup([5, 6, 7, 9, 5, 6], 3) == [7, 9, 5]
    assert proposer._lookup([1, 2, 3, 1, 2, 4, 1, 2], 2) == [4, 1]  # latest occurrence wins
    assert proposer._lookup([1, 2, 3], 4) == []


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


P = np.array([0.30, 0.05, 0.25, 0.10, 0.20, 0.10])      # target
Q = np.array([0.10, 0.30, 0.05, 0.25, 0.10, 0.20])      # draft, deliberately different


def _emitted_first_tokens(verify_fn, draws: int, deterministic: bool) -> np.ndarray:
    rng = np.random.default_rng(0)
    counts = np.zeros(len(P))
    target = np.stack([P, P])                            # [k + 1, vocab], k = 1
    for _ in range(draws):
        if deterministic:
            draft = Draft([2], None)                      # n-gram style: always guess token 2
        else:
            draft = Draft([int(rng.choice(len(Q), p=Q))], Q[None, :])
        counts[verify_fn(target, draft, False, rng)[0]] += 1
    return counts


@pytest.mark.parametrize("deterministic", [False, True])
def test_speculative_sampling_reproduces_the_target_distribution(deterministic):
    counts = _emitted_first_tokens(verify, 20_000, deterministic)
    assert _chi_square(counts, P) < CHI2_P001[5]


def test_the_distribution_test_fails_when_verification_is_wrong():
    def accept_always(target, draft, is_greedy, rng):
        return list(draft.token_ids) + [int(rng.choice(len(P), p=target[-1]))]

    counts = _emitted_first_tokens(accept_always, 20_000, deterministic=False)
    assert _chi_square(counts, P) > CHI2_P001[5]


def test_sampled_speculation_matches_target_distribution_end_to_end(tiny_model):
    """The second generated token's marginal, through the whole engine with a self-draft."""
    prompt = [5, 6, 7, 8, 5, 6]
    first = np.exp(_log_softmax(dense_logits(tiny_model, prompt)[-1]))          # [vocab]
    marginal = np.zeros_like(first)
    for t1 in np.flatnonzero(first > 1e-4):
        marginal += first[t1] * np.exp(_log_softmax(dense_logits(tiny_model, prompt + [int(t1)])[-1]))
    config = EngineConfig(model="random", dtype="float64", cache=CacheConfig(num_blocks=4000, block_size=4),
                          scheduler=SchedulerConfig(max_num_seqs=3000, max_num_batched_tokens=30000),
                          speculative=SpeculativeConfig("self_draft", 2, num_draft_layers=1))
    engine = LLMEngine(config, tiny_model)
    n = 3000
    requests = [(prompt, SamplingParams(temperature=1.0, seed=i, max_tokens=3, ignore_eos=True)) for i in range(n)]
    results = run_to_completion(engine, requests)
    assert engine.get_stats().scheduler.spec_decode.num_accepted_tokens > 0
    counts = np.bincount([r.outputs[0].token_ids[1] for r in results], minlength=len(marginal))
    # Bins with enough expected mass, the rest pooled.
    order = np.argsort(-marginal)
    top = order[:9]
    observed = np.append(counts[top], n - counts[top].sum())
    probs = np.append(marginal[top], 1 - marginal[top].sum())
    assert probs.min() * n > 5
    assert _chi_square(observed.astype(float), probs) < CHI2_P001[9]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def test_forks_are_born_when_the_last_prompt_token_is_a_one_token_chunk(tiny_model):
    # Budget 8 and a 9-token prompt: the last chunk is one token, exactly a decode-shaped step.
    config = EngineConfig(model="random", dtype="float64", cache=CacheConfig(num_blocks=64, block_size=4),
                          scheduler=SchedulerConfig(max_num_batched_tokens=8),
                          speculative=SpeculativeConfig("ngram", 3, prompt_lookup_max=2))
    engine = LLMEngine(config, tiny_model)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7]
    params = SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=6, ignore_eos=True)
    result = run_to_completion(engine, [(prompt, params)])[0]
    assert [len(c.token_ids) for c in result.outputs] == [6, 6]
