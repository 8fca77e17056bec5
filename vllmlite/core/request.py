"""Per-request state: tokens, how many of them have KV (computed), status and finish reason.

`num_computed_tokens` catches up to `num_tokens` one step at a time; this single number covers
chunked prefill, prefix hits, preemption and decoding alike. Knows nothing of blocks or tensors.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from vllmlite.pooling_params import PoolingParams, PoolingType
from vllmlite.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"      # queued, or preempted by recompute (KV dropped)
    RUNNING = "running"
    SWAPPED = "swapped"      # preempted by swap: KV in the host arena
    FORK_PENDING = "fork_pending"  # a sample of an n > 1 request, born when its parent's prompt is done
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"        # EOS, a stop token or a stop string
    LENGTH = "length"    # max_tokens, the context length, or no room left in the KV cache
    ABORT = "abort"      # the client went away or asked to stop
    ERROR = "error"      # this request failed (e.g. its prompt can never fit in the cache)


class StructuredOutputGrammar(Protocol):
    """What the scheduler needs of one sample's grammar state (the worker's GrammarState is one):
    advance it over a kept token, see whether the grammar is complete, read why it failed."""

    def accept(self, token_id: int) -> bool:
        """Advance over a kept token; False if the grammar forbids it."""
        ...

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and allows no token but EOS."""
        ...

    @property
    def error(self) -> str:
        ...


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int                    # resolved: never past the context length
    generator: np.random.Generator     # this request's own random stream
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0                  # lower runs first
    cache_salt: str | None = None
    client_id: str | None = None
    parent_id: str | None = None    # set on the extra samples of an n > 1 request
    sample_index: int = 0
    # An embedding request (prefill only, never samples): its params and the engine's pooling type.
    pooling_params: PoolingParams | None = None
    pooling: PoolingType | None = None

    token_ids: list[int] = field(init=False)          # prompt followed by output
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0          # prompt tokens served from the prefix cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    # The error is the request's own (its grammar broke a limit, its prompt can never fit), not a
    # fault of the engine: the caller's to fix (the API answers it as a client error).
    is_client_error: bool = False
    cumulative_logprob: float = 0.0
    logprobs: list = field(default_factory=list)      # TokenLogprobs per output token, when asked
    prompt_logprobs: list = field(default_factory=list)  # TokenLogprobs of prompt tokens 1.., when asked
    num_preemptions: int = 0
    num_draft_tokens: int = 0           # speculative guesses scored for this request
    num_accepted_tokens: int = 0        # of those, kept
    first_scheduled_time: float | None = None  # when it first ran (time.monotonic, as arrival_time)
    first_token_time: float | None = None
    last_token_time: float | None = None
    # Embedding requests: [hidden] the last position's final-norm hidden state, or (mean) the sum
    # over the positions computed so far; reset by the chunk that starts at position 0.
    pooled: np.ndarray | None = None
    # Structured output: this sample's grammar state, set before it is scheduled and advanced by
    # every token it keeps.
    grammar: StructuredOutputGrammar | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def is_pooling(self) -> bool:
        return self.pooling is not None

    @property
    def extra_keys(self) -> tuple:
        """What besides token ids keys this request's prefix-cache blocks."""
        return () if self.cache_salt is None else (self.cache_salt,)

    def append_token(self, token_id: int) -> None:
        self.extend_tokens((token_id,))

    def extend_tokens(self, token_ids: Sequence[int]) -> None:
        """Append output tokens of one step (none: nothing changes)."""
        if not token_ids:
            return
        self.token_ids.extend(token_ids)
        self.output_token_ids.extend(token_ids)
        now = time.monotonic()
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now

    def add_pooled(self, pooled: np.ndarray, restart: bool) -> None:
        """Take an embedding request's pooled rows from one step [hidden]: they replace what it held
        (`restart`: last pooling, or a chunk at position 0) or add to the mean's sum so far."""
        self.pooled = pooled if restart else self.pooled + pooled

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop output tokens past `num_output_tokens` (sampled after a stop string completed)."""
        del self.output_token_ids[num_output_tokens:]
        del self.token_ids[self.num_prompt_tokens + num_output_tokens:]
        self.cumulative_logprob -= sum(entry.logprob for entry in self.logprobs[num_output_tokens:])
        del self.logprobs[num_output_tokens:]

    def finish(self, reason: FinishReason, stop_reason: int | str | None = None,
               error: str | None = None, is_client_error: bool = False) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.error = error
        self.is_client_error = is_client_error


def internal_error(error: BaseException) -> str:
    """The error a request reports when it alone failed inside the engine (HTTP sends it as a 500)."""
    return f"internal error while running this request: {type(error).__name__}: {error}"
