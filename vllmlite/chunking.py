"""Chunked-prefill sizing: how many prompt tokens one step may compute, and the step-time model behind it.

Owns the chunking policy (`fixed`: prompts take whatever the token budget leaves, as always;
`adaptive`: the prefill share that keeps the step within a target time per output token of the
running decodes, shrunk under memory pressure) and the online least-squares fit of step time. Knows
nothing of requests, blocks or tensors: the scheduler describes the step (`StepLoad`), the engine
reports what ran and how long it took (`observe`).
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from dataclasses import dataclass

import numpy as np

from vllmlite.batch import SchedulerOutput
from vllmlite.config import SchedulerConfig, ceil_div
from vllmlite.stats import ChunkingStats, StepTimeFit

logger = logging.getLogger(__name__)

NUM_FEATURES = 4  # [1, decode rows, prefill tokens, attention pairs / 1000]
MIN_OBSERVATIONS = 8  # steps seen before the fit is trusted; until then the whole budget goes to prefill


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a step computes, in the step-time model's terms.

    attention_pairs counts (query, key) pairs: a chunk of n tokens after s computed ones attends
    n * s + n * (n + 1) / 2 of them (chunk of 3 after 5: 15 + 6 = 21); a decode row (n = 1), s + 1.
    """

    num_decode_rows: int     # sequences computing one token (speculative guesses count as rows)
    num_prefill_tokens: int  # tokens of chunks longer than one token
    attention_pairs: int

    @property
    def features(self) -> np.ndarray:
        # [NUM_FEATURES]; attention in thousands of pairs, so every column is of a similar scale
        return np.array([1.0, self.num_decode_rows, self.num_prefill_tokens, self.attention_pairs / 1000.0])

    @classmethod
    def of(cls, scheduled: SchedulerOutput) -> StepShape:
        rows = tokens = pairs = 0
        for seq in scheduled.scheduled:
            n = len(seq.token_ids) + seq.num_draft_slots
            pairs += n * seq.start_position + n * (n + 1) // 2
            if len(seq.token_ids) == 1:
                rows += n
            else:
                tokens += n
        return cls(rows, tokens, pairs)


def attention_pairs(num_tokens: int, start: int) -> int:
    """(query, key) pairs of a chunk of `num_tokens` after `start` computed tokens (see StepShape)."""
    return num_tokens * start + num_tokens * (num_tokens + 1) // 2


class StepTimeModel:
    """Step seconds ~= coef . [1, decode rows, prefill tokens, attention kpairs], coefficients >= 0.

    Fitted by least squares over recent steps: the last `window` steps, plus the last `window // 4`
    steps that computed prefill, kept apart so a long stretch of pure decoding cannot push out
    what prefill costs. Non-negative by exhaustion: of the 2^4 subsets of features, the best fit
    whose coefficients are all >= 0 (a negative cost is noise, and would invite a huge chunk).
    """

    def __init__(self, window: int = 256) -> None:
        self._recent: deque[tuple[np.ndarray, float]] = deque(maxlen=window)
        self._recent_prefill: deque[tuple[np.ndarray, float]] = deque(maxlen=window // 4)
        self.coefficients = np.zeros(NUM_FEATURES)  # [NUM_FEATURES] seconds per unit of each feature
        self.rms_error = 0.0                        # seconds, over the fitted steps
        self.num_observations = 0                   # cumulative

    @property
    def is_fitted(self) -> bool:
        return self.num_observations >= MIN_OBSERVATIONS

    def observe(self, shape: StepShape, seconds: float) -> None:
        """Add one measured step and refit."""
        sample = (shape.features, seconds)
        (self._recent_prefill if shape.num_prefill_tokens else self._recent).append(sample)
        self.num_observations += 1
        self._fit()

    def predict(self, shape: StepShape) -> float:
        return float(shape.features @ self.coefficients)

    def _fit(self) -> None:
        x = np.array([f for f, _ in itertools.chain(self._recent, self._recent_prefill)])  # [steps, NUM_FEATURES]
        y = np.array([s for _, s in itertools.chain(self._recent, self._recent_prefill)])  # [steps]
        scale = np.maximum(np.abs(x).max(axis=0), 1e-12)  # columns scaled to [0, 1] for the solve
        xs = x / scale
        best, best_error = np.zeros(NUM_FEATURES), float(y @ y)
        for size in range(1, NUM_FEATURES + 1):
            for subset in itertools.combinations(range(NUM_FEATURES), size):
                cols = list(subset)
                coef, *_ = np.linalg.lstsq(xs[:, cols], y, rcond=None)
                if (coef < 0).any():
                    continue
                error = float(np.sum((xs[:, cols] @ coef - y) ** 2))
                if error < best_error - 1e-15:
                    best = np.zeros(NUM_FEATURES)
                    best[cols] = coef
                    best_error = error
        self.coefficients = best / scale
        self.rms_error = (best_error / len(y)) ** 0.5

    def snapshot(self) -> StepTimeFit:
        ms = self.coefficients * 1000.0
        return StepTimeFit(intercept_ms=float(ms[0]), per_decode_row_ms=float(ms[1]),
                           per_prefill_token_ms=float(ms[2]), per_attention_kpair_ms=float(ms[3]),
                           rms_error_ms=self.rms_error * 1000.0, num_observations=self.num_observations)


@dataclass(frozen=True, slots=True)
class StepLoad:
    """What the scheduler knows before it schedules a step."""

    num_decode_rows: int             # running sequences with one token to compute (guess slots included)
    decode_attention_pairs: int      # their (query, key) pairs: sum of their context lengths
    prefill_start: int               # computed tokens of the first prompt in line (its chunk's offset)
    prompt_tokens_left: int          # tokens that prompt has still to compute (0: none)
    next_prompt_tokens: int | None   # prompt tokens left of the waiting queue's head, if any
    num_free_blocks: int


@dataclass(slots=True)
class PrefillShare:
    """A step's prompt tokens, spent as the scheduler hands out chunks: what is left in all, and the
    most any one prompt may take. Decodes (one token) never draw on it.

    >>> share = PrefillShare(num_left=100, per_request=60)
    >>> share.chunk(num_left=1, budget=256), share.chunk(500, 256), share.chunk(30, 256), share.chunk(500, 20)
    (1, 60, 30, 20)
    >>> share.spend(60, num_left=500); share.chunk(500, 256)
    40
    """

    num_left: int
    per_request: int

    def chunk(self, num_left: int, budget: int) -> int:
        """Tokens a request with `num_left` to compute gets, with `budget` left of the step's tokens
        (0: a prompt that waits for a later step)."""
        if num_left <= 1:
            return min(num_left, budget)
        return max(0, min(num_left, budget, self.num_left, self.per_request))

    def spend(self, num_scheduled: int, num_left: int) -> None:
        """A request with `num_left` tokens to compute was given `num_scheduled`."""
        if num_left > 1:
            self.num_left -= num_scheduled


class ChunkingPolicy:
    """Sizes each step's prefill share. `fixed`: the token budget, no per-prompt cap (the behaviour
    before adaptive chunking existed). `adaptive`, from the fitted step time:

    - nothing decoding: the whole token budget;
    - else the largest share P whose predicted step time stays within target_tpot_ms, at least one
      block's worth (prompts always progress), at most the budget less the decode rows;
    - memory: while anything decodes, the first prompt in line goes ahead only if the free blocks
      hold the rest of it plus the blocks the decodes may open before it is done (one per
      block_size steps each); else it waits (P = 0). So admission and chunks shrink before the
      decodes, growing, must preempt someone;
    - a long prompt leaves room for a short one at the head of the waiting queue (a prompt of at
      most P / 2 tokens): the long one takes at most P less that prompt.
    """

    def __init__(self, config: SchedulerConfig, block_size: int) -> None:
        self.policy = config.prefill_chunking
        self.token_budget = config.max_num_batched_tokens
        self.target_tpot_ms = config.target_tpot_ms
        self.block_size = block_size
        self.model = StepTimeModel()
        self._decision = ChunkingStats(self.policy, self.target_tpot_ms, self.token_budget, self.token_budget)
        self._last_step_ms: float | None = None

    def prefill_share(self, load: StepLoad) -> PrefillShare:
        """This step's prompt tokens (the scheduler spends them); logged at debug level."""
        if self.policy == "fixed":
            return PrefillShare(self.token_budget, self.token_budget)
        by_time, predicted = self._by_time(load)
        by_memory = self._by_memory(load, by_time)
        num_tokens = min(by_time, by_memory)
        per_request = num_tokens
        if load.next_prompt_tokens is not None and load.next_prompt_tokens <= num_tokens // 2:
            per_request = num_tokens - load.next_prompt_tokens
        logger.debug("prefill budget %d tokens (%d per prompt): %d decode rows, by time %d (predicted %.1f ms, "
                     "target %.1f ms), by memory %d (%d free blocks)", num_tokens, per_request,
                     load.num_decode_rows, by_time, predicted * 1000, self.target_tpot_ms, by_memory,
                     load.num_free_blocks)
        self._decision = ChunkingStats(self.policy, self.target_tpot_ms, num_tokens, per_request, by_time, by_memory,
                                       predicted * 1000)
        return PrefillShare(num_tokens, per_request)

    def _by_time(self, load: StepLoad) -> tuple[int, float]:
        """The largest prefill share meeting the target (binary search: predicted time grows with
        it), and the predicted step time with that share."""
        limit = max(0, self.token_budget - load.num_decode_rows)
        if load.num_decode_rows == 0 or not self.model.is_fitted:
            return limit, self._predict(load, limit)
        floor = min(self.block_size, limit)
        low, high = floor, limit  # the answer lies in [low, high]
        while low < high:
            middle = (low + high + 1) // 2
            if self._predict(load, middle) * 1000 <= self.target_tpot_ms:
                low = middle
            else:
                high = middle - 1
        return low, self._predict(load, low)

    def _by_memory(self, load: StepLoad, by_time: int) -> int:
        """Prompt tokens the free blocks allow this step.

        Block size 16, 4 decodes, a 1000-token prompt at 250 tokens a step: 4 steps, in which each
        decode opens at most ceil(4 / 16) = 1 block; the prompt needs 63 blocks, so it goes ahead
        only with at least 63 + 4 free, and may then take (free - 4) * 16 tokens.
        """
        if not load.num_decode_rows:
            return load.num_free_blocks * self.block_size
        num_steps = ceil_div(load.prompt_tokens_left, max(1, by_time))
        reserve = load.num_decode_rows * ceil_div(num_steps, self.block_size)
        if ceil_div(load.prompt_tokens_left, self.block_size) + reserve > load.num_free_blocks:
            return 0
        return (load.num_free_blocks - reserve) * self.block_size

    def _predict(self, load: StepLoad, num_prefill: int) -> float:
        pairs = load.decode_attention_pairs + attention_pairs(num_prefill, load.prefill_start)
        return self.model.predict(StepShape(load.num_decode_rows, num_prefill, pairs))

    def observe(self, scheduled: SchedulerOutput, seconds: float) -> None:
        """Feed the model one measured step (a step that computed nothing teaches nothing)."""
        shape = StepShape.of(scheduled)
        if shape.num_decode_rows or shape.num_prefill_tokens:
            self.model.observe(shape, seconds)
            self._last_step_ms = seconds * 1000

    def snapshot(self) -> ChunkingStats:
        d = self._decision
        return ChunkingStats(d.policy, d.target_tpot_ms, d.prefill_budget, d.per_request_budget, d.budget_by_time,
                             d.budget_by_memory, d.predicted_step_ms, self._last_step_ms, self.model.snapshot())
