"""The data contracts between the scheduler and the runner. No logic lives here.

The scheduler fills a SchedulerOutput; the runner reads it and returns a RunnerOutput; the
scheduler's update() applies that. Neither side imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from vllmlite.core.request import Request
from vllmlite.pooling_params import PoolingType


@dataclass
class ScheduledSequence:
    """One request's share of this step: the tokens to compute and where their K/V goes."""

    request: Request             # read-only for the runner
    token_ids: list[int]         # the tokens computed this step
    start_position: int          # position of token_ids[0] (= num_computed_tokens before the step)
    block_table: list[int | None]  # covers positions 0 .. start_position + len(token_ids) - 1; None:
    # a block out of the sliding window, never read (core/sliding_window.py)
    num_draft_slots: int = 0     # slots after token_ids: speculative guesses verified this step, or
    # multi-step decoding's lookahead (tokens of the extra passes the runner may replay)
    samplers: list[Request] = field(default_factory=list)
    # Requests that draw a token from this sequence's last logits: empty mid-prompt, usually just
    # [request], and [parent, *forks] when an n > 1 request finishes its prompt.
    pooling: PoolingType | None = None
    # Embedding requests: MEAN on every chunk (each row is summed), LAST on the chunk that ends the
    # prompt (its last row is kept); None for everything else.

    @property
    def seq_len(self) -> int:
        return self.start_position + len(self.token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)   # (host, device)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)      # (src, dst) copy-on-write
    finished: list[Request] = field(default_factory=list)  # ended while scheduling (e.g. cannot fit)
    num_preempted: int = 0

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)


@dataclass
class RunnerOutput:
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)  # request id -> new tokens
    logprobs: dict[str, list] = field(default_factory=dict)                # request id -> TokenLogprobs
    prompt_logprobs: dict[str, list] = field(default_factory=dict)         # request id -> TokenLogprobs
    num_drafts: dict[str, int] = field(default_factory=dict)               # request id -> guesses scored
    num_accepted: dict[str, int] = field(default_factory=dict)             # request id -> guesses kept
    errors: dict[str, str] = field(default_factory=dict)                   # request id -> what failed
    pooled: dict[str, np.ndarray] = field(default_factory=dict)  # request id -> [hidden] last row or row sum

    def merge(self, other: RunnerOutput) -> None:
        """Take in another output for disjoint requests (the per-sequence retry after a fault)."""
        for name in self.__dataclass_fields__:
            getattr(self, name).update(getattr(other, name))
