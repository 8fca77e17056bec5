"""What the engine hands back: vLLM's RequestOutput and CompletionOutput shapes. No logic."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


@dataclass
class Logprob:
    """One token's logprob at one position, as vLLM's `vllm.sequence.Logprob`.

    `rank` is 1-based among the whole vocabulary; `decoded_token` is the token's text as the
    server shows it in logprobs.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One generated (or prompt) position: token id -> Logprob. With SamplingParams(logprobs=k) it holds
# the k most likely tokens, best first, then the sampled token when it is not among them (k or k + 1
# entries; logprobs=0 gives the sampled token alone). The API's top_logprobs rely on that order.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None  # one per generated token, when asked for
    finish_reason: str | None = None      # "stop" | "length" | "abort" | "error", None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    delta_text: str = ""                     # text new since this sample's previous output
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[PositionLogprobs] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_draft_tokens: int = 0       # speculative guesses scored
    num_accepted_tokens: int = 0    # of those, kept
    first_scheduled_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0               # prompt tokens served from the prefix cache
    error: str | None = None
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # [None, dict, ...] when asked for
    is_client_error: bool = False  # `error` is the request's own (its grammar, its size), not the engine's


@dataclass
class EmbeddingOutput:
    """vLLM's EmbeddingOutput: the pooled, (by default) L2-normalized vector."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """vLLM's EmbeddingRequestOutput: one prompt's embedding, handed back once, finished.

    A failed request carries `error` and an empty embedding.
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    prompt: str | None = None
    num_cached_tokens: int = 0               # prompt tokens served from the prefix cache (last pooling)
    error: str | None = None
    metrics: RequestMetrics | None = None


class OutputProgress(NamedTuple):
    """What the metrics read of an unfinished output. A request whose caller reads only its finished
    output (a response not streamed) gets this from each step before that (LLMEngine.add_request's
    `final_only`), not a RequestOutput: its tokens and latencies still count, without the output's
    cumulative ids and text being built every step, or crossing an engine process's pipe."""

    request_id: str
    arrival_time: float | None
    num_prompt_tokens: int
    num_new_tokens: int   # over all its samples

    @classmethod
    def of(cls, output: RequestOutput | EmbeddingRequestOutput) -> OutputProgress:
        arrival = output.metrics.arrival_time if output.metrics is not None else None
        num_new = 0 if isinstance(output, EmbeddingRequestOutput) else \
            sum([len(c.delta_token_ids) for c in output.outputs])
        return cls(output.request_id, arrival, len(output.prompt_token_ids), num_new)
