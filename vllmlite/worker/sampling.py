"""The sampler: one next token per row of logits, vectorized over the batch.

Knows SamplingParams and numpy; knows nothing of requests, the scheduler or the model.

Order of operations, per row (float64 throughout; the input logits are never modified):
  0. logprobs   log_softmax of the RAW logits, only for rows with `params.logprobs` set
                (what vLLM returns by default: before penalties, bias and temperature).
  1. processed_logits():
     -  grammar mask        structured output: tokens the row's grammar forbids -> -inf (first, so
                            no later step can bring one back; greedy rows see it too)
     a. repetition_penalty  over prompt AND output tokens, HF sign rule:
                            seen token: logit > 0 ? logit / rp : logit * rp
     b. frequency/presence  over output tokens only (OpenAI):
                            logit -= frequency * count_out + presence * (count_out > 0)
     c. logit_bias          logit += bias[token]
     d. allowed_token_ids   every other token -> -inf
     e. bad_words           the last token of each tokenized bad word whose other tokens end the
                            output so far -> -inf (a one-token bad word always)
     f. min_tokens          while len(output) < min_tokens: params.stop_token_ids and the batch's
                            stop_token_ids (EOS/end-of-turn; skipped if ignore_eos) -> -inf
     e and f never mask a row's last finite logit, so every row keeps a distribution.
  2. greedy rows (temperature < 1e-5): argmax of the processed logits; no random draw.
  3. random rows, probs():  logits / temperature
                            top-k: keep logits >= the k-th largest (ties at the k-th are kept)
                            softmax
                            top-p: keep the smallest highest-first set with mass >= top_p
                            min-p: keep p >= min_p * max(p)
                            renormalize
  4. exactly one `generator.random()` per random row, inverse CDF over that row's distribution,
     so a seeded row's token depends on nothing else in the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from vllmlite.sampling_params import SamplingParams
from vllmlite.worker.structured_output import unpack_bitmask

SEED_MODULUS = 2**64  # SamplingParams accepts negative seeds (as torch does); numpy wants >= 0
TOP_P_CANDIDATES = 256  # first guess at how many tokens hold a top-p nucleus


def make_generator(seed: int | None) -> np.random.Generator:
    """The per-request generator: seeded if the request gave a seed, else fresh OS entropy."""
    return np.random.default_rng(None if seed is None else seed % SEED_MODULUS)


@dataclass
class SamplingBatch:
    """One row per sampling position, built by the runner. All lists have the same length."""

    params: list[SamplingParams]
    prompt_token_ids: list[Sequence[int]]
    output_token_ids: list[Sequence[int]]  # tokens generated so far, before this step
    generators: list[np.random.Generator]  # one per row, owned by the request
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)  # EOS, end-of-turn
    # What each row's grammar allows: [batch, vocab] bool, or packed as llguidance fills it ([batch,
    # words] int32, bit t % 32 of word t // 32 is token t; unpack_bitmask), as the runner passes it.
    allowed_mask: np.ndarray | None = None

    def __post_init__(self) -> None:
        lengths = {len(self.params), len(self.prompt_token_ids), len(self.output_token_ids),
                   len(self.generators)}
        if self.allowed_mask is not None:
            lengths.add(len(self.allowed_mask))
        if len(lengths) != 1:
            raise ValueError(f"SamplingBatch lists must have equal lengths, got {sorted(lengths)}")
        self.stop_token_ids = frozenset(self.stop_token_ids)

    @property
    def num_rows(self) -> int:
        return len(self.params)

    def rows_where(self, predicate: Callable[[SamplingParams], bool]) -> np.ndarray:
        """Indices of the rows whose params satisfy `predicate`."""
        return np.array([i for i, p in enumerate(self.params) if predicate(p)],
                        dtype=np.int64)  # [num_matching]

    def bad_word_pairs(self) -> list[tuple[int, int]]:
        """(row, token) pairs a bad word forbids: bad word [5, 7, 9] forbids 9 when the output so far
        ends with [5, 7]."""
        pairs = []
        for i in self.rows_where(lambda p: p.bad_words_token_ids is not None):
            output = self.output_token_ids[i]
            for word in self.params[i].bad_words_token_ids:
                prefix = word[:-1]
                if len(prefix) <= len(output) and list(output[len(output) - len(prefix):]) == prefix:
                    pairs.append((i, word[-1]))
        return pairs

    def min_tokens_pairs(self) -> list[tuple[int, int]]:
        """(row, stop token) pairs of the rows with fewer than min_tokens outputs."""
        pairs = []
        for i in self.rows_where(lambda p: p.min_tokens > 0):
            params = self.params[i]
            if len(self.output_token_ids[i]) < params.min_tokens:
                stops = set(params.stop_token_ids)
                stops |= set() if params.ignore_eos else self.stop_token_ids
                pairs.extend((i, t) for t in stops)
        return pairs


@dataclass
class TokenLogprobs:
    """The sampled token's logprob and 1-based rank, and the top candidates, highest first."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


class SamplerOutput(NamedTuple):
    token_ids: np.ndarray  # [batch] int64
    logprobs: list[TokenLogprobs | None]  # per row; None unless params.logprobs is set


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Stable log_softmax over the last axis, in float64. [n, vocab] -> [n, vocab]"""
    x = np.asarray(logits, dtype=np.float64)  # [n, vocab]
    shifted = x - x.max(axis=-1, keepdims=True)  # [n, vocab]
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def compute_logprobs(logits: np.ndarray, token_ids: np.ndarray,
                     num_top: Sequence[int]) -> list[TokenLogprobs]:
    """Logprobs of `token_ids` under log_softmax(logits), with the `num_top[i]` best of row i.

    logits [n, vocab], token_ids [n]. Also serves prompt logprobs (token_ids = the next prompt
    tokens). Rank is 1 + the number of tokens with a strictly higher logprob.
    """
    logprobs = log_softmax(logits)  # [n, vocab]
    rows = np.arange(len(logprobs))  # [n]
    token_ids = np.asarray(token_ids, dtype=np.int64)  # [n]
    chosen = logprobs[rows, token_ids]  # [n]
    ranks = (logprobs > chosen[:, None]).sum(axis=1) + 1  # [n]
    max_top = min(max(num_top, default=0), logprobs.shape[1])
    top_ids = np.zeros((len(rows), 0), dtype=np.int64)  # [n, max_top]
    if max_top > 0:
        top_ids = _sorted_top(logprobs, max_top)  # [n, max_top]
    out = []
    for i, k in enumerate(num_top):
        top = [(int(t), float(logprobs[i, t])) for t in top_ids[i, :k]]
        out.append(TokenLogprobs(int(token_ids[i]), float(chosen[i]), int(ranks[i]), top))
    return out


def _flat_token_ids(token_lists: Sequence[Sequence[int]], row_ids: np.ndarray,
                    vocab_size: int) -> np.ndarray:
    """Index of each listed token in the flattened [batch, vocab] logits: row * vocab + token.

    token_lists [[2, 2], [0]], row_ids [3, 5], vocab 4 -> [14, 14, 20]. [total_tokens] int64
    """
    lengths = np.array([len(t) for t in token_lists], dtype=np.int64)  # [rows]
    flat = np.fromiter((t for tokens in token_lists for t in tokens), dtype=np.int64,
                       count=int(lengths.sum()))  # [total_tokens]
    _check_ids("prompt and output token ids", flat, vocab_size)
    return np.repeat(row_ids * vocab_size, lengths) + flat  # [total_tokens]


def _check_ids(name: str, token_ids: np.ndarray, vocab_size: int) -> None:
    if token_ids.size and (token_ids.min() < 0 or token_ids.max() >= vocab_size):
        raise ValueError(f"{name} must be in [0, {vocab_size}); call SamplingParams.verify()")


class Sampler:
    """Stateless; all randomness comes from the per-row generators in the batch."""

    compute_logprobs = staticmethod(compute_logprobs)   # also what the runner scores guesses and prompts with

    def __call__(self, logits: np.ndarray, batch: SamplingBatch) -> SamplerOutput:
        """Sample one token per row. logits [batch, vocab] float32/float64 (not modified)."""
        self.check_shape(logits, batch)
        if batch.allowed_mask is None and all(p.is_plain_greedy for p in batch.params):
            # Every step below would leave the logits as they are and report nothing: the argmax
            # of the raw logits is the processed logits' (their float64 copy orders the same).
            return SamplerOutput(logits.argmax(axis=1).astype(np.int64), [None] * batch.num_rows)
        processed = self.processed_logits(logits, batch)  # [batch, vocab]
        token_ids = processed.argmax(axis=1).astype(np.int64)  # [batch]; final for greedy rows
        random_rows = batch.rows_where(lambda p: not p.is_greedy)
        if random_rows.size:
            probs = self._filtered_probs(processed[random_rows], batch, random_rows)
            uniforms = np.array([batch.generators[i].random() for i in random_rows])  # [r]
            token_ids[random_rows] = _inverse_cdf(probs, uniforms)
        return SamplerOutput(token_ids, self._logprobs(logits, token_ids, batch))

    def processed_logits(self, logits: np.ndarray, batch: SamplingBatch) -> np.ndarray:
        """The grammar mask, penalties, logit_bias, then allowed_token_ids, bad_words and min_tokens
        masking. Returns a new [batch, vocab] float64 array; rows that need none of them are the
        input logits unchanged."""
        self.check_shape(logits, batch)
        processed = np.array(logits, dtype=np.float64, order="C")  # [batch, vocab], a copy
        if batch.allowed_mask is not None:
            np.copyto(processed, -np.inf, where=~unpack_bitmask(batch.allowed_mask, processed.shape[1]))
        self._apply_penalties(processed, batch)
        self._apply_logit_bias(processed, batch)
        self._apply_allowed_token_ids(processed, batch)
        self._apply_bad_words(processed, batch)
        self._apply_min_tokens(processed, batch)
        return processed

    def probs(self, logits: np.ndarray, batch: SamplingBatch) -> np.ndarray:
        """The distribution each row samples from: [batch, vocab] float64, rows sum to 1.

        Greedy rows are one-hot at the argmax of the processed logits.
        """
        processed = self.processed_logits(logits, batch)  # [batch, vocab]
        probs = np.zeros_like(processed)  # [batch, vocab]
        probs[np.arange(batch.num_rows), processed.argmax(axis=1)] = 1.0
        random_rows = batch.rows_where(lambda p: not p.is_greedy)
        if random_rows.size:
            probs[random_rows] = self._filtered_probs(processed[random_rows], batch, random_rows)
        return probs

    @staticmethod
    def check_shape(logits: np.ndarray, batch: SamplingBatch) -> None:
        if logits.ndim != 2 or logits.shape[0] != batch.num_rows:
            raise ValueError(f"logits must be [{batch.num_rows}, vocab], got {logits.shape}")

    @staticmethod
    def _apply_penalties(logits: np.ndarray, batch: SamplingBatch) -> None:
        """Touches only the (row, token) pairs that occur, not the whole [batch, vocab]."""
        rows = batch.rows_where(lambda p: p.needs_penalties)
        if rows.size == 0:
            return
        vocab_size = logits.shape[1]
        flat_logits = logits.reshape(-1)  # [batch * vocab], a view
        repetition = np.array([p.repetition_penalty for p in batch.params])  # [batch]
        frequency = np.array([p.frequency_penalty for p in batch.params])  # [batch]
        presence = np.array([p.presence_penalty for p in batch.params])  # [batch]
        outputs = _flat_token_ids([batch.output_token_ids[i] for i in rows], rows, vocab_size)
        prompts = _flat_token_ids([batch.prompt_token_ids[i] for i in rows], rows, vocab_size)
        seen = np.unique(np.concatenate([prompts, outputs]))  # [num_seen]
        values = flat_logits[seen]  # [num_seen]
        rp = repetition[seen // vocab_size]  # [num_seen]
        with np.errstate(over="ignore"):  # a tiny rp sends logits to +-inf: the penalty's limit
            flat_logits[seen] = np.where(values > 0, values / rp, values * rp)
        generated, counts = np.unique(outputs, return_counts=True)  # [num_generated] each
        row_of = generated // vocab_size  # [num_generated]
        flat_logits[generated] -= frequency[row_of] * counts + presence[row_of]

    @staticmethod
    def _apply_logit_bias(logits: np.ndarray, batch: SamplingBatch) -> None:
        rows = batch.rows_where(lambda p: bool(p.logit_bias))
        if rows.size == 0:
            return
        pairs = [(i, t, b) for i in rows for t, b in batch.params[i].logit_bias.items()]
        row_ids = np.array([r for r, _, _ in pairs], dtype=np.int64)  # [num_biases]
        token_ids = np.array([t for _, t, _ in pairs], dtype=np.int64)  # [num_biases]
        _check_ids("logit_bias token ids", token_ids, logits.shape[1])
        logits[row_ids, token_ids] += np.array([b for _, _, b in pairs])  # keys are unique

    @staticmethod
    def _apply_allowed_token_ids(logits: np.ndarray, batch: SamplingBatch) -> None:
        """Every token outside a row's allowed_token_ids -> -inf (one numpy index per row: the
        list can hold most of the vocabulary, too many for Python pairs at every step)."""
        for i in batch.rows_where(lambda p: p.allowed_token_ids is not None):
            allowed = np.asarray(batch.params[i].allowed_token_ids, dtype=np.int64)  # [num_allowed]
            _check_ids("allowed_token_ids", allowed, logits.shape[1])
            kept = logits[i, allowed]
            logits[i] = -np.inf
            logits[i, allowed] = kept

    @staticmethod
    def _apply_bad_words(logits: np.ndarray, batch: SamplingBatch) -> None:
        _mask_tokens(logits, batch.bad_word_pairs(), "bad_words token ids")

    @staticmethod
    def _apply_min_tokens(logits: np.ndarray, batch: SamplingBatch) -> None:
        _mask_tokens(logits, batch.min_tokens_pairs(), "stop token ids")

    @staticmethod
    def _filtered_probs(logits: np.ndarray, batch: SamplingBatch,
                        rows: np.ndarray) -> np.ndarray:
        """Temperature, top-k, softmax, top-p, min-p, renormalize. logits [r, vocab] processed
        logits of the random `rows`. Returns [r, vocab] float64, rows sum to 1."""
        params = [batch.params[i] for i in rows]
        temperature = np.array([p.temperature for p in params])[:, None]  # [r, 1]
        scaled = logits / temperature  # [r, vocab]
        vocab_size = logits.shape[1]
        top_k = np.array([min(p.top_k or vocab_size, vocab_size) for p in params])  # [r]
        _apply_top_k(scaled, top_k)
        top = scaled.max(axis=1, keepdims=True)  # [r, 1]
        infinite = np.isposinf(top[:, 0])  # [r]: a tiny repetition penalty sent logits to +inf
        probs = np.exp(scaled - np.where(infinite[:, None], 0.0, top))  # [r, vocab]
        if infinite.any():  # softmax's limit: uniform over the row's +inf logits
            probs[infinite] = np.isposinf(scaled[infinite])
        probs /= probs.sum(axis=1, keepdims=True)
        _apply_top_p(probs, np.array([p.top_p for p in params]))
        _apply_min_p(probs, np.array([p.min_p for p in params]))
        return probs / probs.sum(axis=1, keepdims=True)

    @staticmethod
    def _logprobs(logits: np.ndarray, token_ids: np.ndarray,
                  batch: SamplingBatch) -> list[TokenLogprobs | None]:
        out: list[TokenLogprobs | None] = [None] * batch.num_rows
        rows = batch.rows_where(lambda p: p.logprobs is not None)
        if rows.size:
            num_top = [batch.params[i].logprobs for i in rows]
            for i, row_logprobs in zip(rows, compute_logprobs(logits[rows], token_ids[rows],
                                                              num_top)):
                out[i] = row_logprobs
        return out


def _mask_tokens(logits: np.ndarray, pairs: list[tuple[int, int]], name: str) -> None:
    """In place: logits[row, token] -> -inf for each (row, token) pair. A row whose every token
    would then be -inf is left alone, so it still has a distribution. logits [batch, vocab]."""
    if not pairs:
        return
    row_ids = np.array([r for r, _ in pairs], dtype=np.int64)  # [num_masked]
    token_ids = np.array([t for _, t in pairs], dtype=np.int64)  # [num_masked]
    _check_ids(name, token_ids, logits.shape[1])
    mask = np.zeros(logits.shape, dtype=bool)  # [batch, vocab]
    mask[row_ids, token_ids] = True
    nothing_left = (mask | ~np.isfinite(logits)).all(axis=1)  # [batch]
    logits[mask & ~nothing_left[:, None]] = -np.inf


def _apply_top_k(logits: np.ndarray, top_k: np.ndarray) -> None:
    """In place: logits below each row's k-th largest -> -inf. logits [r, vocab], top_k [r]."""
    rows = np.flatnonzero(top_k < logits.shape[1])
    if rows.size == 0:
        return
    sub = logits[rows]  # [rk, vocab]
    # the k-th largest sits at ascending position vocab - k: vocab 5, k 2 -> position 3
    positions = logits.shape[1] - top_k[rows]  # [rk]
    partitioned = np.partition(sub, np.unique(positions), axis=1)  # [rk, vocab]
    kth = partitioned[np.arange(rows.size), positions]  # [rk]
    logits[rows] = np.where(sub >= kth[:, None], sub, -np.inf)


def _apply_top_p(probs: np.ndarray, top_p: np.ndarray) -> None:
    """In place: keep each row's smallest highest-first prefix with mass >= top_p.

    probs [0.5, 0.3, 0.2], top_p 0.6 -> mass before each [0, 0.5, 0.8] -> keep the first two.
    Sorting a whole 50k vocabulary is the sampler's largest cost, so only the most likely
    candidates are sorted; a row whose candidates hold less than top_p retries with 16x more.
    """
    rows = np.flatnonzero(top_p < 1.0)
    vocab_size = probs.shape[1]
    num_candidates = TOP_P_CANDIDATES
    while rows.size:
        num_candidates = min(num_candidates, vocab_size)
        sub = probs[rows]  # [rp, vocab]
        candidate_ids = _sorted_top(sub, num_candidates)  # [rp, m], most likely first
        sorted_probs = np.take_along_axis(sub, candidate_ids, axis=1)  # [rp, m]
        cumulative = np.cumsum(sorted_probs, axis=1)  # [rp, m]
        mass_before = np.zeros_like(cumulative)  # [rp, m]; [.5, .3] -> [0, .5]
        mass_before[:, 1:] = cumulative[:, :-1]
        covered = cumulative[:, -1] >= top_p[rows]  # [rp]: the nucleus lies in the candidates
        covered |= num_candidates == vocab_size
        keep_sorted = mass_before < top_p[rows, None]  # [rp, m]; top_p > 0 keeps position 0
        done = np.flatnonzero(covered)  # [rd]
        kept = np.zeros((done.size, vocab_size), dtype=bool)  # [rd, vocab]
        np.put_along_axis(kept, candidate_ids[done], keep_sorted[done], axis=1)
        probs[rows[done]] = np.where(kept, sub[done], 0.0)
        rows = rows[~covered]
        num_candidates *= 16


def _sorted_top(values: np.ndarray, num_top: int) -> np.ndarray:
    """Ids of each row's `num_top` largest values, by value descending, then token id ascending.
    values [n, vocab] -> [n, num_top] int64."""
    if num_top >= values.shape[1]:
        return np.argsort(-values, axis=1, kind="stable")  # [n, vocab]
    ids = np.argpartition(-values, num_top - 1, axis=1)[:, :num_top]  # [n, num_top]
    order = np.lexsort((ids, -np.take_along_axis(values, ids, axis=1)), axis=1)  # [n, num_top]
    return np.take_along_axis(ids, order, axis=1)


def _apply_min_p(probs: np.ndarray, min_p: np.ndarray) -> None:
    """In place: zero tokens with p < min_p * max(p); the most likely token always stays."""
    rows = np.flatnonzero(min_p > 0.0)
    if rows.size == 0:
        return
    sub = probs[rows]  # [rm, vocab]
    threshold = min_p[rows, None] * sub.max(axis=1, keepdims=True)  # [rm, 1]
    probs[rows] = np.where(sub >= threshold, sub, 0.0)


def _inverse_cdf(probs: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
    """Token per row: the first index whose cumulative mass exceeds u * total.

    probs [[0.2, 0.0, 0.8]], u [0.5] -> cdf [0.2, 0.2, 1.0] -> token 2. A zero-mass token is
    never chosen: its cdf equals its predecessor's. Since u <= 1 - 2**-53, u * total rounds
    strictly below total, so some index always qualifies.
    probs [r, vocab], uniforms [r] in [0, 1) -> [r] int64.
    """
    cdf = np.cumsum(probs, axis=1)  # [r, vocab]
    targets = uniforms * cdf[:, -1]  # [r]
    return (cdf <= targets[:, None]).sum(axis=1).astype(np.int64)  # [r]
