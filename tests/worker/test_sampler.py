"""Sampler: exact distributions (chi-square over seeded draws), processor arithmetic by hand,
greedy, seeded reproducibility across batch composition, min_tokens, and raw logprobs. Every test
runs on the numpy sampler and on the device sampler (worker/torch_sampling.py, on torch's CPU
tensors here, float64 as the numpy one), which must give the same answers."""

import importlib.util
import math

import numpy as np
import pytest

from vllmlite.sampling_params import SamplingParams
from vllmlite.worker import sampling
from vllmlite.worker.sampling import SamplingBatch, make_generator


class TorchSamplerOnNumpy:
    """The device sampler behind the numpy sampler's interface: numpy logits in, numpy arrays out."""

    def __init__(self) -> None:
        from vllmlite.worker.torch_sampling import TorchSampler
        self.inner = TorchSampler()

    @staticmethod
    def _tensor(logits):
        import torch
        return torch.from_numpy(np.asarray(logits))

    def __call__(self, logits, batch):
        return self.inner(self._tensor(logits), batch)

    def processed_logits(self, logits, batch):
        return self.inner.processed_logits(self._tensor(logits), batch).numpy()

    def probs(self, logits, batch):
        return self.inner.probs(self._tensor(logits), batch).numpy()


def torch_compute_logprobs(logits, token_ids, num_top):
    import torch

    from vllmlite.worker import torch_sampling
    return torch_sampling.compute_logprobs(torch.from_numpy(np.asarray(logits)), token_ids, num_top)


SAMPLERS = ["numpy"] + (["torch"] if importlib.util.find_spec("torch") else [])


@pytest.fixture(autouse=True, params=SAMPLERS)
def sampler_kind(request, monkeypatch):
    """Every test once per sampler: the names below resolve to the device sampler's in the torch run."""
    if request.param == "torch":
        monkeypatch.setitem(globals(), "Sampler", TorchSamplerOnNumpy)
        monkeypatch.setitem(globals(), "compute_logprobs", torch_compute_logprobs)
    return request.param


Sampler = sampling.Sampler
compute_logprobs = sampling.compute_logprobs

# Token:           0    1    2     3    4     5    6    7     8    9
LOGITS = np.array([1.3, 0.2, 1.7, -0.4, 0.9, -1.1, 0.5, 0.0, -0.7, 1.1])  # [vocab]
VOCAB = len(LOGITS)
NUM_DRAWS = 20_000
# Chi-square critical values at p = 0.001, by degrees of freedom (standard tables).
CHI2_CRITICAL = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322,
                 8: 26.124, 9: 27.877}


def softmax_over(allowed: list[int], temperature: float) -> np.ndarray:
    """The exact expected distribution: softmax(LOGITS / T) restricted to `allowed`. [vocab]"""
    weights = np.zeros(VOCAB)  # [vocab]
    for t in allowed:
        weights[t] = math.exp((LOGITS[t] - LOGITS.max()) / temperature)
    return weights / weights.sum()


def batch_of(params, rows=None, outputs=None, prompts=None, generators=None, stops=()):
    """A SamplingBatch of `rows` rows, params broadcast when a single SamplingParams is given."""
    params = [params] * rows if isinstance(params, SamplingParams) else list(params)
    n = len(params)
    return SamplingBatch(params, prompts or [[]] * n, outputs or [[]] * n,
                         generators or [make_generator(i) for i in range(n)], frozenset(stops))


def draw_counts(params: SamplingParams, seed: int) -> np.ndarray:
    """NUM_DRAWS rows of LOGITS, each with its own seeded generator -> token counts [vocab]."""
    logits = np.tile(LOGITS, (NUM_DRAWS, 1))  # [draws, vocab]
    generators = [np.random.default_rng([seed, i]) for i in range(NUM_DRAWS)]
    tokens = Sampler()(logits, batch_of(params, NUM_DRAWS, generators=generators)).token_ids
    return np.bincount(tokens, minlength=VOCAB)  # [vocab]


def chi_square(counts: np.ndarray, expected: np.ndarray) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom over the tokens with expected mass > 0."""
    allowed = expected > 0  # [vocab]
    expected_counts = expected[allowed] * counts.sum()  # [num_allowed]
    assert expected_counts.min() >= 5, "chi-square needs >= 5 expected per bin"
    statistic = float(((counts[allowed] - expected_counts) ** 2 / expected_counts).sum())
    return statistic, int(allowed.sum()) - 1


# name: (params, allowed tokens (derived by hand in the comments), temperature for the expectation)
CASES = {
    "T=0.5": (SamplingParams(temperature=0.5), list(range(VOCAB)), 0.5),
    "T=1": (SamplingParams(temperature=1.0), list(range(VOCAB)), 1.0),
    "T=1.7": (SamplingParams(temperature=1.7), list(range(VOCAB)), 1.7),
    # the three largest logits: 1.7, 1.3, 1.1
    "top_k=3": (SamplingParams(top_k=3), [2, 0, 9], 1.0),
    # probs sorted .274 .184 .150 .123 .083: mass before the 4th is .608 < .7 (kept),
    # before the 5th .731 >= .7 (dropped)
    "top_p=0.7": (SamplingParams(top_p=0.7), [2, 0, 9, 4], 1.0),
    # keep p >= .25 * pmax, i.e. logit >= 1.7 + ln .25 = 0.314: 1.7 1.3 1.1 0.9 0.5 (not 0.2)
    "min_p=0.25": (SamplingParams(min_p=0.25), [2, 0, 9, 4, 6], 1.0),
    # T=.8, top-k 6 keeps 1.7 1.3 1.1 0.9 0.5 0.2 -> probs .354 .215 .167 .130 .079 .054;
    # top-p .8: mass before 0.9 is .736 < .8 (kept), before 0.5 is .867 (dropped);
    # min-p .4: p/pmax = 1 .607 .472 .368 -> 0.9 dropped
    "combined": (SamplingParams(temperature=0.8, top_k=6, top_p=0.8, min_p=0.4), [2, 0, 9], 0.8),
    # same top-k set; top-p .75 keeps 4 (mass before 0.9 is .736); min-p .2 keeps all 4.
    # vLLM v1's order (min-p first, drops 0.2, renormalizes) would give mass .779 and 3 tokens.
    "top-p before min-p": (SamplingParams(temperature=0.8, top_k=6, top_p=0.75, min_p=0.2),
                           [2, 0, 9, 4], 0.8),
}


@pytest.mark.parametrize("name", list(CASES))
def test_probs_equal_exact_expected_distribution(name):
    params, allowed, temperature = CASES[name]
    probs = Sampler().probs(LOGITS[None, :], batch_of(params, 1))  # [1, vocab]
    np.testing.assert_allclose(probs[0], softmax_over(allowed, temperature), rtol=1e-12,
                               atol=1e-15)


@pytest.mark.parametrize("seed, name", list(enumerate(CASES)))
def test_draws_follow_expected_distribution_chi_square(seed, name):
    params, allowed, temperature = CASES[name]
    counts = draw_counts(params, seed)  # [vocab]
    expected = softmax_over(allowed, temperature)  # [vocab]
    assert counts[expected == 0].sum() == 0, f"disallowed tokens drawn: {counts}"
    statistic, dof = chi_square(counts, expected)
    assert statistic < CHI2_CRITICAL[dof], (statistic, dof, counts)


def test_chi_square_rejects_draws_from_a_wrong_temperature():
    counts = draw_counts(SamplingParams(temperature=1.0), seed=99)  # [vocab]
    statistic, dof = chi_square(counts, softmax_over(list(range(VOCAB)), 1.15))
    assert statistic > CHI2_CRITICAL[dof]


def test_top_k_keeps_ties_at_the_kth_value_and_large_k_is_off():
    logits = np.array([[1.0, 3.0, 3.0, 0.0], [1.0, 2.0, 3.0, 0.0]])  # [2, 4]
    params = [SamplingParams(top_k=1), SamplingParams(top_k=50)]
    probs = Sampler().probs(logits, batch_of(params))  # [2, 4]
    np.testing.assert_allclose(probs[0], [0, 0.5, 0.5, 0])
    np.testing.assert_allclose(probs[1], np.exp(logits[1]) / np.exp(logits[1]).sum())


def reference_nucleus(probs_row, top_p: float) -> set[int]:
    """Full sort, highest first (ties by token id); add tokens until the mass reaches top_p."""
    kept, mass = set(), 0.0
    for t in sorted(range(len(probs_row)), key=lambda t: (-probs_row[t], t)):
        if mass >= top_p:
            break
        kept.add(t)
        mass += probs_row[t]
    return kept


def test_top_p_on_a_large_vocab_matches_a_full_sort():
    # nuclei from a handful of tokens to thousands: the sampler sorts only candidates and
    # must widen them when they do not hold top_p
    rng = np.random.default_rng(11)
    scales = [8.0, 3.0, 1.0, 0.3, 0.05, 0.0]
    logits = np.stack([rng.normal(size=3000) * s for s in scales])  # [6, 3000]
    top_ps = [0.5, 0.9, 0.95, 0.6, 0.99, 0.7]
    full = Sampler().probs(logits, batch_of(SamplingParams(), len(scales)))  # [6, 3000]
    params = [SamplingParams(top_p=p) for p in top_ps]
    probs = Sampler().probs(logits, batch_of(params))  # [6, 3000]
    sizes = []
    for i, top_p in enumerate(top_ps):
        nucleus = reference_nucleus(full[i], top_p)
        sizes.append(len(nucleus))
        assert set(np.flatnonzero(probs[i])) == nucleus
        np.testing.assert_allclose(probs[i, sorted(nucleus)], full[i, sorted(nucleus)]
                                   / full[i, sorted(nucleus)].sum(), rtol=1e-12)
    assert min(sizes) < 50 and max(sizes) > 1024, sizes


@pytest.mark.parametrize("layout", ["C", "F", "slice"])
def test_penalties_arithmetic_by_hand(layout):
    base = np.array([[1.0, -1.0, 2.0, 0.5, 0.0, 3.0, 9.0]] * 2)  # [2, 7]
    logits = {"C": base[:, :6].copy(), "F": np.asfortranarray(base[:, :6]),
              "slice": base[:, :6]}[layout]  # [2, 6]
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    batch = batch_of([params, SamplingParams()], prompts=[[0, 1, 0], [0]],
                     outputs=[[2, 2, 3], [2]])
    processed = Sampler().processed_logits(logits, batch)
    # repetition over prompt+output {0,1,2,3}: 1/2, -1*2, 2/2, .5/2; tokens 4, 5 unseen.
    # frequency/presence over outputs only: token 2 (count 2): 1 - .5*2 - .25 = -.25;
    # token 3 (count 1): .25 - .5 - .25 = -.5; prompt-only tokens 0 and 1 are untouched.
    np.testing.assert_allclose(processed[0], [0.5, -2.0, -0.25, -0.5, 0.0, 3.0])
    np.testing.assert_array_equal(processed[1], logits[1])
    assert logits[0, 0] == 1.0, "input logits must not be modified"


def test_penalties_touch_only_rows_that_ask():
    logits = np.array([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])  # [2, 3]
    params = [SamplingParams(presence_penalty=1.0), SamplingParams()]
    batch = batch_of(params, prompts=[[0], [0]], outputs=[[2], [2]])
    processed = Sampler().processed_logits(logits, batch)
    np.testing.assert_array_equal(processed, [[1.0, 2.0, 2.0], [1.0, 2.0, 3.0]])


def test_logit_bias_applies_after_penalties_and_only_to_its_row():
    logits = np.array([[1.0, 0.0, -2.0], [1.0, 0.0, -2.0]])  # [2, 3]
    params = [SamplingParams(repetition_penalty=2.0, logit_bias={"0": 1.0, "2": -100}),
              SamplingParams()]
    batch = batch_of(params, outputs=[[0], [0]])
    processed = Sampler().processed_logits(logits, batch)
    # token 0: seen, 1.0 / 2 = 0.5, then + 1.0 (bias before the penalty would give 1.0)
    np.testing.assert_allclose(processed, [[1.5, 0.0, -102.0], [1.0, 0.0, -2.0]])


def test_greedy_is_argmax_of_processed_logits_and_draws_nothing():
    rng = np.random.default_rng(7)
    logits = rng.normal(size=(40, 12)).astype(np.float32)  # [40, 12]
    params = [SamplingParams(temperature=0.0, repetition_penalty=float(rng.uniform(0.5, 2)),
                             frequency_penalty=float(rng.uniform(-2, 2)),
                             logit_bias={int(rng.integers(12)): float(rng.uniform(-3, 3))})
              for _ in range(40)]
    outputs = [list(rng.integers(0, 12, size=rng.integers(0, 5))) for _ in range(40)]
    batch = batch_of(params, outputs=outputs, prompts=[[1, 2]] * 40)
    before = [g.bit_generator.state for g in batch.generators]
    sampler = Sampler()
    processed = sampler.processed_logits(logits, batch)  # [40, 12]
    tokens = sampler(logits, batch).token_ids
    np.testing.assert_array_equal(tokens, np.argmax(processed, axis=1))
    assert (tokens != np.argmax(logits, axis=1)).any(), "processors should change some argmax"
    np.testing.assert_array_equal(sampler.probs(logits, batch), np.eye(12)[tokens])
    assert [g.bit_generator.state for g in batch.generators] == before


def test_random_row_draws_exactly_once_from_its_generator():
    generator = make_generator(5)
    reference = make_generator(5)
    Sampler()(LOGITS[None, :], batch_of(SamplingParams(), 1, generators=[generator]))
    reference.random()
    assert generator.bit_generator.state == reference.bit_generator.state


def test_seeded_row_is_independent_of_batch_composition_and_order():
    others = [SamplingParams(temperature=0.0), SamplingParams(top_p=0.5, top_k=4),
              SamplingParams(presence_penalty=1.0, min_p=0.2, logit_bias={3: 5.0}),
              SamplingParams(temperature=1.9, seed=3), SamplingParams(min_tokens=4)]
    rng = np.random.default_rng(0)
    seeded = [SamplingParams(seed=s, top_p=0.95, temperature=1.3) for s in range(30)]
    alone = [int(Sampler()(LOGITS[None, :], batch_of(p, 1, generators=[make_generator(p.seed)]))
                 .token_ids[0]) for p in seeded]
    assert len(set(alone)) > 3, "the seeds should not all give the same token"
    for params, expected in zip(seeded, alone):
        rows = [params] + others[: int(rng.integers(0, len(others) + 1))]
        order = rng.permutation(len(rows))
        shuffled = [rows[i] for i in order]
        generators = [make_generator(p.seed) for p in shuffled]
        logits = np.tile(LOGITS, (len(rows), 1))  # [rows, vocab]
        batch = batch_of(shuffled, outputs=[[1]] * len(rows), generators=generators,
                         stops=[5])
        tokens = Sampler()(logits, batch).token_ids
        assert tokens[int(np.flatnonzero(order == 0)[0])] == expected


class FixedUniform:
    """A stand-in generator whose one draw is a chosen u in [0, 1)."""

    def __init__(self, u: float):
        self.u = u

    def random(self) -> float:
        return self.u


# top_k=2 leaves tokens {2, 3}; the CDF runs in vocab order, tokens 0, 1 and 4 have no mass
@pytest.mark.parametrize("u, expected", [(0.0, 2), (np.nextafter(1.0, 0.0), 3)])
def test_inverse_cdf_extremes_never_pick_a_zero_mass_token(u, expected):
    logits = np.array([[0.0, 1.0, 3.0, 2.0, -1.0]])  # [1, 5]
    tokens = Sampler()(logits, batch_of(SamplingParams(top_k=2), 1,
                                        generators=[FixedUniform(u)])).token_ids
    assert tokens[0] == expected


def min_tokens_batch(params, num_outputs, eos=0):
    return batch_of(params, 1, outputs=[[7] * num_outputs], stops=[eos])


# EOS (0) is the argmax, the request's stop id 5 second, token 3 third
MIN_TOKENS_LOGITS = np.array([[9.0, 0.0, 0.0, 7.0, 0.0, 8.0]])  # [1, 6]


@pytest.mark.parametrize("num_outputs, expected", [(0, 3), (2, 3), (3, 0), (10, 0)])
def test_min_tokens_masks_eos_and_stop_ids_until_reached(num_outputs, expected):
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5])
    batch = min_tokens_batch(params, num_outputs)
    assert Sampler()(MIN_TOKENS_LOGITS, batch).token_ids[0] == expected
    processed = Sampler().processed_logits(MIN_TOKENS_LOGITS, batch)
    assert np.isneginf(processed[0, [0, 5]]).all() == (num_outputs < 3)


def test_ignore_eos_leaves_eos_unmasked_but_masks_request_stop_ids():
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5], ignore_eos=True)
    logits = MIN_TOKENS_LOGITS[:, [5, 1, 2, 3, 4, 0]]  # stop id 5 is now the argmax, EOS second
    processed = Sampler().processed_logits(logits, min_tokens_batch(params, 1))
    assert np.isneginf(processed[0, 5]) and processed[0, 0] == logits[0, 0]
    assert Sampler()(logits, min_tokens_batch(params, 1)).token_ids[0] == 0


def test_min_tokens_random_rows_never_draw_a_masked_token():
    params = SamplingParams(min_tokens=2, stop_token_ids=[5])
    logits = np.tile(MIN_TOKENS_LOGITS, (2000, 1))  # [2000, 6]
    batch = batch_of(params, 2000, outputs=[[1]] * 2000, stops=[0])
    counts = np.bincount(Sampler()(logits, batch).token_ids, minlength=6)
    assert counts[0] == counts[5] == 0 and counts[3] > 0


def test_min_tokens_that_would_mask_every_token_masks_nothing():
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1, 2])
    processed = Sampler().processed_logits(np.array([[1.0, 3.0, 2.0]]),
                                           min_tokens_batch(params, 0))
    np.testing.assert_array_equal(processed, [[1.0, 3.0, 2.0]])


def reference_log_softmax(row) -> np.ndarray:
    """Independent float64 log_softmax via math.fsum. [vocab]"""
    values = [float(v) for v in row]
    peak = max(values)
    log_total = peak + math.log(math.fsum(math.exp(v - peak) for v in values))
    return np.array([v - log_total for v in values])  # [vocab]


def test_logprobs_are_raw_log_softmax_with_top_and_rank():
    rng = np.random.default_rng(3)
    logits = (rng.normal(size=(6, 50)) * 4).astype(np.float32)  # [6, 50]
    params = [SamplingParams(logprobs=5, temperature=1.5, presence_penalty=2.0, seed=1),
              SamplingParams(), SamplingParams(logprobs=0, top_k=3),
              SamplingParams(logprobs=20, temperature=0.0, logit_bias={7: 50.0}),
              SamplingParams(logprobs=1, repetition_penalty=1.7, top_p=0.5),
              SamplingParams(logprobs=3, min_p=0.5)]
    batch = batch_of(params, outputs=[[1, 2, 3]] * 6, prompts=[[4, 5]] * 6)
    out = Sampler()(logits, batch)
    assert out.logprobs[1] is None
    for i, p in enumerate(params):
        if p.logprobs is None:
            continue
        ref = reference_log_softmax(logits[i])  # [50]
        entry = out.logprobs[i]
        token = int(out.token_ids[i])
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(ref[token], abs=1e-12)
        assert entry.rank == 1 + int((ref > ref[token]).sum())
        assert [t for t, _ in entry.top] == list(np.argsort(-ref, kind="stable")[: p.logprobs])
        np.testing.assert_allclose([lp for _, lp in entry.top], np.sort(ref)[::-1][: p.logprobs],
                                   atol=1e-12)


def test_sampled_token_outside_top_candidates_is_still_reported():
    logits = np.array([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])  # [1, 6]
    params = SamplingParams(temperature=0.0, logprobs=2, logit_bias={5: 100})
    out = Sampler()(logits, batch_of(params, 1))
    entry = out.logprobs[0]
    ref = reference_log_softmax(logits[0])  # [6]
    assert out.token_ids[0] == entry.token_id == 5
    assert entry.rank == 6 and entry.logprob == pytest.approx(ref[5], abs=1e-12)
    assert [t for t, _ in entry.top] == [0, 1]


def test_compute_logprobs_serves_prompt_logprobs():
    logits = np.array([[0.0, 1.0, 2.0], [2.0, 2.0, 0.0]])  # [2, 3]
    entries = compute_logprobs(logits, np.array([0, 1]), num_top=[1, 2])
    assert entries[0].rank == 3 and entries[1].rank == 1  # ties share the better rank
    assert entries[1].top[0][0] == 0 and len(entries[1].top) == 2
    assert entries[0].logprob == pytest.approx(reference_log_softmax(logits[0])[0])


def test_batch_rejects_mismatched_lengths_and_logits_shape():
    with pytest.raises(ValueError, match="equal lengths"):
        SamplingBatch([SamplingParams()], [[]], [], [make_generator(0)])
    with pytest.raises(ValueError, match="logits"):
        Sampler()(np.zeros((2, 4)), batch_of(SamplingParams(), 1))


def test_negative_seed_makes_a_reproducible_generator():
    assert make_generator(-5).random() == make_generator(-5).random()
    assert make_generator(-5).random() != make_generator(5).random()


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_an_extreme_repetition_penalty_leaves_a_distribution_not_nans(temperature):
    # rp = 1e-320 divides the positive logits of seen tokens 0 and 2 past the float range: softmax's
    # limit is uniform over those infinite logits (inf - inf made every probability NaN).
    params = SamplingParams(repetition_penalty=1e-320, temperature=temperature)
    batch = batch_of(params, rows=1, prompts=[[0, 2, 3]])
    with np.errstate(over="raise", invalid="raise"):  # no overflow warning, no NaN
        probs = Sampler().probs(LOGITS[None, :], batch)[0]  # [vocab]
        token = Sampler()(LOGITS[None, :], batch).token_ids[0]
    assert probs.tolist() == [0.5, 0, 0.5] + [0] * (VOCAB - 3) and token in (0, 2)
