"""Chunked-prefill sizing: how many prompt tokens one step may compute, and the step-time model behind it.

Owns the chunking policy (`fixed`: prompts take whatever the token budget leaves, as always;
`adaptive`: the prefill share that keeps the step within a target time per output token of the
running decodes, shrunk under memory pressure) and the online least-squares fit of step time. Knows
nothing of requests, blocks or tensors: the scheduler describes the step (`StepLoad`), the engine
reports what ran and how long it took (`observe`).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

import numpy as np

from vllmlite.config import SchedulerConfig, ceil_div
from vllmlite.core.batch import SchedulerOutput
from vllmlite.stats import ChunkingStats, StepTimeFit

logger = logging.getLogger(__name__)

# [1, decode rows, prefill tokens, attention pairs / 1000, prefill context / 1000, 1 if any prefill]
NUM_FEATURES = 6
MIN_OBSERVATIONS = 8  # steps seen before the fit is trusted; until then the whole budget goes to prefill
# Without a target_tpot_ms, the target is this multiple of the running decodes' own step time (the
# model's prediction for them alone): what they see without prompts, stretched by half. Their time
# per output token grows at most so while prompts are prefilled, on any machine, under any load.
DEFAULT_TPOT_SLACK = 1.5
# Late in a long prompt even one block beside the decodes can overrun the target. Such a step is
# taken only once the steps since the last overrun have made up for it (measured under the target
# by as much), so the decodes' mean step, their time per output token, stays on target; but never
# after more than this many steps without one, so prompts always progress. Short prompts waiting
# are never held so: a new request starts as it would without a burst.
MAX_DEFERRED_STEPS = 8
# [63, NUM_FEATURES]: each non-empty subset of the features as a 0/1 row (the fit tries them all)
_SUBSETS = np.array([[(mask >> i) & 1 for i in range(NUM_FEATURES)] for mask in range(1, 1 << NUM_FEATURES)],
                    dtype=float)


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a step computes, in the step-time model's terms.

    attention_pairs counts (query, key) pairs: a chunk of n tokens after s computed ones attends
    n * s + n * (n + 1) / 2 of them (chunk of 3 after 5: 15 + 6 = 21); a decode row (n = 1), s + 1.
    prefill_context sums the s of the chunks: a chunk reads its whole context once per layer
    whatever its length (the compiled backend gathers it from the blocks), a cost per step that
    neither the tokens nor the pairs describe (a 16-token chunk after 2000 tokens pays it as a
    256-token one there does). And a step with any prompt chunk pays a cost of its own whatever
    the chunk (the products of more rows take another path than a few decodes', the chunk's
    attention runs on threads), so the decodes' own step is not the intercept of a mixed one.
    """

    num_decode_rows: int     # sequences computing one token (speculative guesses count as rows)
    num_prefill_tokens: int  # tokens of chunks longer than one token
    attention_pairs: int
    prefill_context: int = 0  # tokens computed before those chunks

    @property
    def features(self) -> np.ndarray:
        # [NUM_FEATURES]; pairs and context in thousands, so every column is of a similar scale
        return np.array([1.0, self.num_decode_rows, self.num_prefill_tokens, self.attention_pairs / 1000.0,
                         self.prefill_context / 1000.0, 1.0 if self.num_prefill_tokens else 0.0])

    @classmethod
    def of(cls, scheduled: SchedulerOutput) -> StepShape:
        rows = tokens = pairs = context = 0
        for seq in scheduled.scheduled:
            n = len(seq.token_ids) + seq.num_draft_slots
            pairs += n * seq.start_position + n * (n + 1) // 2
            if len(seq.token_ids) == 1:
                rows += n
            else:
                tokens += n
                context += seq.start_position
        return cls(rows, tokens, pairs, context)


def attention_pairs(num_tokens: int, start: int) -> int:
    """(query, key) pairs of a chunk of `num_tokens` after `start` computed tokens (see StepShape)."""
    return num_tokens * start + num_tokens * (num_tokens + 1) // 2


class _Window:
    """The last `size` (features, seconds) samples and their least-squares sums, kept as samples come
    and go: gram = X^T X, xty = X^T y, yty = y . y over the window."""

    def __init__(self, size: int) -> None:
        self.samples: deque[tuple[np.ndarray, float]] = deque()
        self.size = size
        self.gram = np.zeros((NUM_FEATURES, NUM_FEATURES))  # [NUM_FEATURES, NUM_FEATURES]
        self.xty = np.zeros(NUM_FEATURES)                  # [NUM_FEATURES]
        self.yty = 0.0

    def add(self, x: np.ndarray, y: float) -> None:
        if len(self.samples) == self.size:
            self._account(*self.samples.popleft(), sign=-1.0)
        self.samples.append((x, y))
        self._account(x, y, sign=1.0)

    def _account(self, x: np.ndarray, y: float, sign: float) -> None:
        self.gram += sign * np.outer(x, x)
        self.xty += sign * x * y
        self.yty += sign * y * y


class StepTimeModel:
    """Step seconds ~= coef . [1, decode rows, prefill tokens, attention kpairs, prefill context
    ktokens, any prefill], coefficients >= 0 (StepShape).

    Fitted by least squares over recent steps: the last `window` steps without prefill, plus the
    last `window // 4` with, kept apart so a long stretch of pure decoding cannot push out what
    prefill costs. Non-negative by exhaustion: of the 63 non-empty subsets of the 6 features, the
    best fit whose coefficients are all >= 0 (a negative cost is noise, and would invite a huge
    chunk). The fit solves normal equations kept as running sums, so it costs the same however
    many steps the windows hold.
    """

    def __init__(self, window: int = 256) -> None:
        self._decode = _Window(window)
        self._prefill = _Window(max(1, window // 4))
        self._coefficients = np.zeros(NUM_FEATURES)  # [NUM_FEATURES] seconds per unit of each feature
        self._rms_error = 0.0                        # seconds, over the fitted steps
        self._is_stale = False                       # observed since the last fit (fitted when next read)
        self.num_observations = 0                    # cumulative
        self.max_prefill_tokens = 0                  # the most prefill tokens, and attention pairs, of any
        self.max_attention_pairs = 0                 # step measured: the model is trusted up to twice these

    @property
    def is_fitted(self) -> bool:
        return self.num_observations >= MIN_OBSERVATIONS

    @property
    def coefficients(self) -> np.ndarray:
        if self._is_stale:
            self._fit()
        return self._coefficients

    def observe(self, shape: StepShape, seconds: float) -> None:
        """Add one measured step (the fit is redone when next read)."""
        (self._prefill if shape.num_prefill_tokens else self._decode).add(shape.features, seconds)
        self.num_observations += 1
        self.max_prefill_tokens = max(self.max_prefill_tokens, shape.num_prefill_tokens)
        self.max_attention_pairs = max(self.max_attention_pairs, shape.attention_pairs)
        self._is_stale = True

    def predict(self, shape: StepShape) -> float:
        return float(shape.features @ self.coefficients)

    def is_trusted(self, shape: StepShape) -> bool:
        """Whether `shape` lies within twice the largest step measured. A fit to short prompts knows
        nothing of long-context attention; a chunk past what was seen could cost many times its
        prediction, so the policy grows into the unknown by doublings, measuring each."""
        return (self.is_fitted and shape.num_prefill_tokens <= 2 * self.max_prefill_tokens
                and shape.attention_pairs <= 2 * self.max_attention_pairs)

    def _fit(self) -> None:
        """Every subset's normal equations solved at once: a subset's system is the full one with the
        rows and columns of the features it leaves out replaced by the identity (their coefficient 0)."""
        gram = self._decode.gram + self._prefill.gram   # [NUM_FEATURES, NUM_FEATURES]
        xty = self._decode.xty + self._prefill.xty      # [NUM_FEATURES]
        yty = self._decode.yty + self._prefill.yty
        scale = np.sqrt(np.maximum(np.diag(gram), 1e-24))  # columns scaled to unit norm for the solve
        gram_s, xty_s = gram / np.outer(scale, scale), xty / scale
        kept = _SUBSETS[:, :, None] * _SUBSETS[:, None, :]  # [subsets, F, F]: 1 where both features are in
        systems = gram_s * kept + np.eye(NUM_FEATURES) * (1 - _SUBSETS)[:, None, :] + 1e-10 * np.eye(NUM_FEATURES)
        coef = np.linalg.solve(systems, (xty_s * _SUBSETS)[:, :, None])[:, :, 0]  # [subsets, F]
        errors = yty - 2 * coef @ xty_s + np.einsum("si,ij,sj->s", coef, gram_s, coef)  # [subsets]
        errors[(coef < 0).any(axis=1)] = np.inf  # a negative cost is noise: that subset is out
        best = int(np.argmin(errors))
        squared_error = min(max(float(errors[best]), 0.0), yty)  # yty: all zeros, the empty subset
        self._coefficients = coef[best] / scale if errors[best] < yty else np.zeros(NUM_FEATURES)
        num_samples = len(self._decode.samples) + len(self._prefill.samples)
        self._rms_error = (squared_error / max(num_samples, 1)) ** 0.5
        self._is_stale = False

    def snapshot(self) -> StepTimeFit:
        ms = self.coefficients * 1000.0
        return StepTimeFit(intercept_ms=float(ms[0]), per_decode_row_ms=float(ms[1]),
                           per_prefill_token_ms=float(ms[2]), per_attention_kpair_ms=float(ms[3]),
                           per_context_ktoken_ms=float(ms[4]), per_prefill_step_ms=float(ms[5]),
                           rms_error_ms=self._rms_error * 1000.0, num_observations=self.num_observations)


@dataclass(frozen=True, slots=True)
class StepLoad:
    """What the scheduler knows before it schedules a step."""

    num_decode_rows: int             # running sequences with one token to compute (guess slots included)
    decode_attention_pairs: int      # their (query, key) pairs: sum of their context lengths
    prefill_start: int               # computed tokens of the first prompt in line (its chunk's offset)
    prompt_tokens_left: int          # tokens that prompt has still to compute (0: none)
    short_prompt_tokens: int         # tokens left of the waiting prompts no longer than the long-prompt threshold
    num_free_blocks: int
    # Blocks that prompt may still take at once; None: all of its tokens', ceil(prompt_tokens_left /
    # block_size). Under a sliding window, only its window's and a chunk's (SlidingWindow.peak_blocks).
    prompt_blocks_left: int | None = None


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
    long_prompt_threshold: int | None = None  # adaptive: prompts with more left than this are long

    def is_long(self, num_left: int) -> bool:
        """A long prompt waits in line while another long one is being prefilled (short ones pass it)."""
        return self.long_prompt_threshold is not None and num_left > self.long_prompt_threshold

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
    - else the largest share P whose predicted step time stays within target_tpot_ms (unset:
      DEFAULT_TPOT_SLACK times the decodes' own predicted step time), at least one block's worth
      (prompts always progress; but a block that would overrun the target waits, up to
      MAX_DEFERRED_STEPS steps, until the decodes' steps have made up for the last overrun), at
      most the budget less the decode rows, and no
      larger than the model can vouch for (`StepTimeModel.is_trusted`: until it is fitted, one
      block; then up to twice the largest step measured);
    - memory: while anything decodes, the first prompt in line goes ahead only if the free blocks
      hold the rest of it plus the blocks the decodes may open before it is done (one per
      block_size steps each); else it waits (P = 0). So admission and chunks shrink before the
      decodes, growing, must preempt someone;
    - long prompts (more than `long_prompt_threshold` tokens left) never block short ones: one long
      prompt is prefilled at a time, short ones pass the others in the waiting queue, and the
      long one takes at most P less what the short ones waiting need (but at least P / 2).
    """

    def __init__(self, config: SchedulerConfig, block_size: int) -> None:
        self.policy = config.prefill_chunking
        self.token_budget = config.max_num_batched_tokens
        self.target_tpot_ms = config.target_tpot_ms
        self.block_size = block_size
        # vLLM's long_prefill_token_threshold, as a share of the budget (256 of 2048; never under a block)
        self.long_prompt_threshold = max(block_size, self.token_budget // 8) if self.is_adaptive else None
        self.model = StepTimeModel()
        self._decision = ChunkingStats(self.policy, None, self.token_budget, self.token_budget)
        self._last_step_ms: float | None = None
        self._overrun_ms = 0.0   # measured time over the target of the decodes' steps, not yet made up
        self._num_deferred = 0   # steps in a row that left prompts waiting for it

    @property
    def is_adaptive(self) -> bool:
        return self.policy == "adaptive"

    def prefill_share(self, load: StepLoad | None) -> PrefillShare:
        """This step's prompt tokens (the scheduler spends them); logged at debug level. `load` is
        read only under adaptive chunking (the scheduler passes None under fixed)."""
        if not self.is_adaptive:
            return PrefillShare(self.token_budget, self.token_budget)
        alone = self.model.predict(self._shape(load, 0))   # the decodes' step without prompts
        target_ms = self.target_tpot_ms if self.target_tpot_ms is not None else DEFAULT_TPOT_SLACK * alone * 1000
        by_time, predicted = self._by_time(load, target_ms)
        if predicted * 1000 > target_ms and self._defers(load, alone * 1000 < target_ms):
            by_time, predicted = 0, alone
        by_memory = self._by_memory(load, by_time)
        num_tokens = min(by_time, by_memory)
        # Short prompts waiting get what they need of the share; a long one keeps at least half.
        per_request = max(num_tokens - load.short_prompt_tokens, num_tokens // 2)
        logger.debug("prefill budget %d tokens (%d per prompt): %d decode rows, by time %d (predicted %.1f ms, "
                     "target %.1f ms), by memory %d (%d free blocks)", num_tokens, per_request,
                     load.num_decode_rows, by_time, predicted * 1000, target_ms, by_memory,
                     load.num_free_blocks)
        self._decision = ChunkingStats(self.policy, target_ms, num_tokens, per_request, by_time, by_memory,
                                       predicted * 1000)
        return PrefillShare(num_tokens, per_request, self.long_prompt_threshold)

    def _defers(self, load: StepLoad, alone_meets_target: bool) -> bool:
        """Whether a share over the target waits this step (MAX_DEFERRED_STEPS): an overrun is still
        to be made up, the decodes alone would make it up, no short prompt waits, and prompts have
        not waited too long."""
        if (self._overrun_ms <= 0 or not alone_meets_target or load.short_prompt_tokens
                or self._num_deferred >= MAX_DEFERRED_STEPS):
            self._num_deferred = 0
            return False
        self._num_deferred += 1
        return True

    def _by_time(self, load: StepLoad, target_ms: float) -> tuple[int, float]:
        """The largest prefill share meeting the target (binary search: predicted time grows with
        it), and the predicted step time with that share."""
        limit = max(0, self.token_budget - load.num_decode_rows)
        if load.num_decode_rows == 0:
            return limit, self.model.predict(self._shape(load, limit))
        floor = min(self.block_size, limit)
        low, high = floor, limit  # the answer lies in [low, high]
        while low < high:
            middle = (low + high + 1) // 2
            shape = self._shape(load, middle)
            if self.model.is_trusted(shape) and self.model.predict(shape) * 1000 <= target_ms:
                low = middle
            else:
                high = middle - 1
        return low, self.model.predict(self._shape(load, low))

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
        prompt_blocks = load.prompt_blocks_left
        if prompt_blocks is None:
            prompt_blocks = ceil_div(load.prompt_tokens_left, self.block_size)
        if prompt_blocks + reserve > load.num_free_blocks:
            return 0
        return (load.num_free_blocks - reserve) * self.block_size

    @staticmethod
    def _shape(load: StepLoad, num_prefill: int) -> StepShape:
        pairs = load.decode_attention_pairs + attention_pairs(num_prefill, load.prefill_start)
        return StepShape(load.num_decode_rows, num_prefill, pairs, load.prefill_start if num_prefill > 1 else 0)

    def observe(self, scheduled: SchedulerOutput, seconds: float) -> None:
        """Feed the model one measured step (a step that computed nothing teaches nothing), and count
        the decodes' time over the target (MAX_DEFERRED_STEPS)."""
        shape = StepShape.of(scheduled)
        if shape.num_decode_rows or shape.num_prefill_tokens:
            self.model.observe(shape, seconds)
            self._last_step_ms = seconds * 1000
        target_ms = self._decision.target_tpot_ms
        if shape.num_decode_rows and target_ms is not None:
            self._overrun_ms = max(0.0, self._overrun_ms + seconds * 1000 - target_ms)

    def snapshot(self) -> ChunkingStats:
        d = self._decision
        return ChunkingStats(d.policy, d.target_tpot_ms, d.prefill_budget, d.per_request_budget, d.budget_by_time,
                             d.budget_by_memory, d.predicted_step_ms, self._last_step_ms, self.model.snapshot())
