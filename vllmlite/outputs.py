"""What the engine hands back: vLLM's RequestOutput and CompletionOutput shapes. No logic."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[list] = None          # TokenLogprobs per token, when asked for
    finish_reason: Optional[str] = None      # "stop" | "length" | "abort" | "error", None while running
    stop_reason: Union[int, str, None] = None  # the stop string or stop token id that ended it
    delta_text: str = ""                     # text new since this sample's previous output
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: Optional[list] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_preemptions: int = 0
    num_draft_tokens: int = 0       # speculative guesses scored
    num_accepted_tokens: int = 0    # of those, kept


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0               # prompt tokens served from the prefix cache
    error: Optional[str] = None
    metrics: Optional[RequestMetrics] = None
    prompt_logprobs: Optional[list] = None
