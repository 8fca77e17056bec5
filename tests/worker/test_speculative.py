"""Speculative decoding changes speed, never the output: greedy equality, exact sampling, no leaks.

Drafts that agree with the target part of the time (n-gram on repetitive prompts, the target's first
layer, the target with a perturbed LM head) reach every path of verification: rounds where all, some
and none of the guesses are kept. The target itself as its draft keeps every guess, so a stop token
can be an accepted guess with more accepted guesses after it.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import greedy, make_prompts, run_to_completion
from reference import dense_greedy, dense_logits

import vllmlite.worker.runner
import vllmlite.worker.speculative
from vllmlite.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from vllmlite.engine.llm_engine import LLMEngine
from vllmlite.models.loader import LoadedModel
from vllmlite.sampling_params import SamplingParams
from vllmlite.worker.speculative import Draft, NgramProposer, verify

MAX_TOKENS = 16
CHI2_P001 = {5: 20.515, 7: 24.322, 9: 27.877}  # chi-square critical values at p = 0.001 by dof
PERTURBED = "perturbed-target"                  # a draft model: the target with a noisy LM head


@pytest.fixture(autouse=True)
def perturbed_draft(monkeypatch, tiny_model):
    """The draft model PERTURBED loads as the target with seeded noise (0.3 of its spread) on the
    LM head: it agrees with the target often but not always. Other names load as usual."""
    rng = np.random.default_rng(1)
    w = tiny_model.weights
    noise = 0.3 * w.lm_head.std() * rng.standard_normal(w.lm_head.shape)             # [vocab, hidden]
    perturbed = dataclasses.replace(tiny_model, weights=dataclasses.replace(w, lm_head=w.lm_head + noise))
    load = vllmlite.worker.speculative.load_model

    def load_draft(model: str, *args) -> LoadedModel:
        return perturbed if model == PERTURBED else load(model, *args)

    monkeypatch.setattr(vllmlite.worker.speculative, "load_model", load_draft)


def spec_engine(tiny_model, spec: dict, scheduler: dict | None = None, **cache_overrides) -> LLMEngine:
    cache = CacheConfig(**{"num_blocks": 256, **cache_overrides})
    config = EngineConfig(model="random", dtype="float64", cache=cache,
                          scheduler=SchedulerConfig(**{"max_num_batched_tokens": 64, **(scheduler or {})}),
                          speculative=SpeculativeConfig.from_dict(spec))
    return LLMEngine(config, tiny_model)


def record_rounds(engine: LLMEngine) -> list[tuple[int, int]]:
    """Every verified round's (guesses scored, guesses kept), as the proposer is told them."""
    rounds: list[tuple[int, int]] = []
    proposer = engine.runner.proposer
    verified = proposer.verified

    def spy(seq, num_drafts: int, num_accepted: int) -> None:
        rounds.append((num_drafts, num_accepted))
        verified(seq, num_drafts, num_accepted)

    proposer.verified = spy
    return rounds


def round_kinds(rounds: list[tuple[int, int]]) -> set[str]:
    """Which verification paths ran: every guess kept, some kept, none kept."""
    return {"all" if kept == scored else "none" if kept == 0 else "some" for scored, kept in rounds if scored}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    # Repetitive prompts give the n-gram proposer something to find; random ones test rejection.
    repetitive = [([5, 6, 7, 8] * 6)[:n] for n in (9, 14, 23)]
    return repetitive + make_prompts(5, seed=21, max_len=30)


@pytest.fixture(scope="module")
def expected(tiny_model, prompts) -> list[list[int]]:
    return [dense_greedy(tiny_model, p, MAX_TOKENS) for p in prompts]


AGREEING = [{"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3},
            {"method": "self_draft", "num_draft_layers": 1},
            {"method": "draft_model", "model": PERTURBED}]
REJECTING = {"method": "draft_model", "model": "random"}  # another seed's model: never agrees
METHODS = [*AGREEING, REJECTING]
TARGET_AS_DRAFT = {"method": "self_draft", "num_draft_layers": 2}  # every layer: the target itself


def method_id(method: dict) -> str:
    return method["method"] if method.get("model") != "random" else "random_draft"


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("method", METHODS, ids=method_id)
def test_greedy_output_identical_with_speculation(tiny_model, prompts, expected, method, k):
    engine = spec_engine(tiny_model, {**method, "num_speculative_tokens": k})
    rounds = record_rounds(engine)
    results = run_to_completion(engine, [(p, greedy(MAX_TOKENS)) for p in prompts])
    assert len(results) == len(expected)
    assert [r.outputs[0].token_ids for r in results] == expected
    stats = engine.get_stats().scheduler.spec_decode
    assert stats.num_draft_tokens == sum(scored for scored, _ in rounds) > 0  # speculation really ran
    assert stats.num_accepted_tokens == sum(kept for _, kept in rounds)
    if method is REJECTING:
        assert round_kinds(rounds) == {"none"}
    else:
        assert stats.num_accepted_tokens > 0
        # One guess is kept or not; from two guesses on, a round may keep some of them. (Eight
        # guesses in a row all kept is rarer than these drafts manage: the target as its own draft
        # shows that path below.)
        kinds = round_kinds(rounds)
        assert kinds == {"all", "none"} if k == 1 else kinds >= {"some", "none"}
        assert "all" in kinds or k == 8


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("method", METHODS, ids=method_id)
def test_greedy_identical_in_mixed_batches_with_preemption(tiny_model, prompts, expected, method, mode):
    engine = spec_engine(tiny_model, {**method, "num_speculative_tokens": 4}, block_size=4, num_blocks=22,
                         preemption_mode=mode, swap_space=0.01)
    sampled = SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True)
    requests = [(p, greedy(MAX_TOKENS) if i % 2 == 0 else sampled) for i, p in enumerate(prompts)]
    results = run_to_completion(engine, requests)
    assert len(results) == len(prompts)
    for i, r in enumerate(results):
        assert len(r.outputs[0].token_ids) == MAX_TOKENS
        if i % 2 == 0:
            assert r.outputs[0].token_ids == expected[i]
    stats = engine.get_stats().scheduler
    assert stats.num_preemptions > 0
    assert stats.spec_decode.num_accepted_tokens > 0 or method is REJECTING


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_target_as_draft_keeps_every_guess_through_preemption(tiny_model, prompts, expected, mode):
    """The draft's own KV is right after a swap out and in and after a recompute (the draft re-reads
    the sequence after any preemption: its KV is not swapped): a perfect draft keeps every guess,
    so a draft KV left stale would show as a round that keeps fewer."""
    engine = spec_engine(tiny_model, {**TARGET_AS_DRAFT, "num_speculative_tokens": 4}, block_size=4,
                         num_blocks=22, preemption_mode=mode, swap_space=0.01)
    swaps = []
    copy_blocks = engine.runner.copy_blocks

    def spy(out):
        swaps.append(len(out.blocks_to_swap_out) + len(out.blocks_to_swap_in))
        copy_blocks(out)

    engine.runner.copy_blocks = spy
    rounds = record_rounds(engine)
    results = run_to_completion(engine, [(p, greedy(MAX_TOKENS)) for p in prompts])
    assert [r.outputs[0].token_ids for r in results] == expected
    assert engine.get_stats().scheduler.num_preemptions > 0
    assert (sum(swaps) > 0) == (mode == "swap")
    assert rounds and round_kinds(rounds) == {"all"}


def test_speculation_with_forked_samples(tiny_model, prompts, expected):
    """n > 1 with speculation: greedy forks all equal the greedy output, and with a perfect draft
    every fork keeps every guess (a fork's draft reads its sequence from the start, into blocks
    copied on write)."""
    prompt, want = prompts[1], expected[1]          # 14 tokens: ends mid-block, so forks copy on write
    engine = spec_engine(tiny_model, {**TARGET_AS_DRAFT, "num_speculative_tokens": 3}, block_size=4)
    rounds = record_rounds(engine)
    [result] = run_to_completion(engine, [(prompt, SamplingParams(n=3, temperature=0, max_tokens=MAX_TOKENS,
                                                                  ignore_eos=True))])
    assert len(result.outputs) == 3
    assert [c.token_ids for c in result.outputs] == [want] * 3
    assert len(rounds) >= 3 and round_kinds(rounds) == {"all"}
    # Sampled forks through a partly agreeing draft: every fork runs to max_tokens, guesses are kept.
    engine = spec_engine(tiny_model, {"method": "self_draft", "num_draft_layers": 1, "num_speculative_tokens": 3},
                         block_size=4)
    rounds = record_rounds(engine)
    params = SamplingParams(n=3, temperature=1.0, seed=8, max_tokens=MAX_TOKENS, ignore_eos=True)
    [result] = run_to_completion(engine, [(prompt, params)])
    assert [len(c.token_ids) for c in result.outputs] == [MAX_TOKENS] * 3
    assert len({tuple(c.token_ids) for c in result.outputs}) == 3
    assert "all" in round_kinds(rounds) or "some" in round_kinds(rounds)


def first_seen_at(tokens: list[int], start: int) -> int:
    """The first position >= start whose token does not occur before it."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_stop_token_accepted_mid_round_drops_the_guesses_after_it(tiny_model, prompts, temperature):
    """The target as its own draft keeps all 8 guesses of a round; a stop token among them ends the
    request there: the accepted guesses after it are dropped, the reason is the stop, nothing leaks."""
    prompt = prompts[3]
    params = dict(temperature=temperature, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True)
    spec = {**TARGET_AS_DRAFT, "num_speculative_tokens": 8}
    engine = spec_engine(tiny_model, spec)
    rounds = record_rounds(engine)
    full = run_to_completion(engine, [(prompt, SamplingParams(**params))])[0].outputs[0].token_ids
    # Token 0 comes from the prefill; round 1 guesses tokens 1-8, keeps them all, and adds token 9.
    assert rounds[0] == (8, 8) and len(full) == MAX_TOKENS
    stop_at = first_seen_at(full, 2)
    assert stop_at <= 6, "no fresh token early in the first round: pick another prompt"
    engine = spec_engine(tiny_model, spec)
    rounds = record_rounds(engine)
    [stopped] = run_to_completion(engine, [(prompt, SamplingParams(**params, stop_token_ids=[full[stop_at]]))])
    assert rounds == [(8, 8)]  # the stop was a kept guess, with kept guesses after it
    assert stopped.outputs[0].token_ids == full[:stop_at + 1]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == full[stop_at]
    assert stopped.metrics.num_accepted_tokens == 8


def test_stops_and_max_tokens_are_honored_mid_round(tiny_model, prompts, expected):
    prompt, want = prompts[0], expected[0]
    engine = spec_engine(tiny_model, {**TARGET_AS_DRAFT, "num_speculative_tokens": 8})
    rounds = record_rounds(engine)
    cut = run_to_completion(engine, [(prompt, greedy(5))])[0]
    assert cut.outputs[0].token_ids == want[:5]
    assert rounds == [(3, 3)]  # guesses are capped so a round cannot pass max_tokens
    stop_id = want[6]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, stop_token_ids=[stop_id])
    stopped = run_to_completion(engine, [(prompt, params)])[0]
    assert stopped.outputs[0].token_ids == want[:want.index(stop_id) + 1]
    assert stopped.outputs[0].finish_reason == "stop"


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


def _accept_every_guess(target_probs, draft, is_greedy, generator):
    """A wrong verification: every guess kept, then a bonus token from the target."""
    return [*draft.token_ids, int(generator.choice(target_probs.shape[1], p=target_probs[len(draft.token_ids)]))]


@pytest.mark.parametrize("verification", ["exact", "accept_every_guess"])
def test_sampled_speculation_matches_target_distribution_end_to_end(tiny_model, monkeypatch, verification):
    """The second generated token's marginal, through the whole engine with a self-draft that keeps
    some guesses: a chi-square test at p = 0.001. Its power: the same test on a verification that
    keeps every guess (the draft's distribution, not the target's) must fail."""
    if verification == "accept_every_guess":
        monkeypatch.setattr(vllmlite.worker.runner, "verify", _accept_every_guess)
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
    assert len(results) == n and all(len(r.outputs[0].token_ids) == 3 for r in results)
    spec = engine.get_stats().scheduler.spec_decode
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens or verification != "exact"
    counts = np.bincount([r.outputs[0].token_ids[1] for r in results], minlength=len(marginal))
    # Bins with enough expected mass, the rest pooled.
    order = np.argsort(-marginal)
    top = order[:9]
    observed = np.append(counts[top], n - counts[top].sum())
    probs = np.append(marginal[top], 1 - marginal[top].sum())
    assert probs.min() * n > 5
    statistic = _chi_square(observed.astype(float), probs)
    assert (statistic < CHI2_P001[9]) == (verification == "exact"), statistic


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
