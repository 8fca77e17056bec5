"""EngineClient: what the API asks of an engine, declared once (vLLM's `EngineClient`). The local
AsyncLLMEngine (async_engine.py), the ProcessEngine in front of an engine process (process_client.py)
and the Ray ingress's RemoteEngine (api/ray/serving.py) implement it.

Owns the interface and its vocabulary: the named reads of `inspect` (INSPECT_READS), the metrics view,
the start-up summary, the facts a client in front of an engine elsewhere needs once (EngineFacts),
and the prefix-cache key a client in front of several engines routes by.
Knows nothing of either implementation, nor of HTTP.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from vllmlite.core.block import block_key
from vllmlite.engine.request_limits import RequestLimits
from vllmlite.engine.request_stream import GenerateRequest, RequestStream
from vllmlite.pooling_params import PoolingParams
from vllmlite.sampling_params import SamplingParams
from vllmlite.structured_output_params import StructuredOutputsParams
from vllmlite.tokenizer import Tokenizer

# The reads `inspect` answers, each the payload of one route: `stats` (/v1/stats), `requests`
# (/debug/requests), `request <id>` (/debug/requests/{id}; None for an id without a trace) and
# `engine` (/debug/engine). A Ray replica answers the ingress with the same reads.
INSPECT_READS = ("stats", "requests", "request", "engine")


def first_block_key(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None) -> bytes | None:
    """The prefix-cache key of the prompt's first full block (`block_key(None, first block, salt)`,
    exactly the key the block manager publishes it under), or None for a prompt shorter than a block.

    >>> first_block_key([1, 2, 3], 4) is None
    True
    >>> first_block_key([1, 2, 3, 4, 5], 4) == first_block_key([1, 2, 3, 4, 9], 4)
    True
    """
    if len(token_ids) < block_size:
        return None
    return block_key(None, list(token_ids[:block_size]), () if cache_salt is None else (cache_salt,))


@dataclass(frozen=True)
class EngineSummary:
    """What the server logs at start-up: the model, its dtype and context, and the memory it holds."""

    model_source: str
    dtype: str
    max_model_len: int
    memory: dict[str, int]  # bytes or counts: weights, kv_cache, draft_kv_cache, host_swap, kv_blocks, block_size,
    # kv_bytes_per_token


@dataclass(frozen=True)
class EngineFacts:
    """What a client in front of an engine elsewhere (an engine process, a Ray replica) needs from it
    once, at start-up, to tokenize and check requests without a model: picklable."""

    tokenizer: Tokenizer
    limits: RequestLimits
    hidden_size: int
    summary: EngineSummary


class RemoteFactsViews:
    """EngineClient's read-only views for a client in front of an engine elsewhere (ProcessEngine,
    the Ray ingress's RemoteEngine), answered from the EngineFacts it sent once (`self.facts`)."""

    facts: EngineFacts

    @property
    def tokenizer(self) -> Tokenizer:
        return self.facts.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.facts.limits.max_model_len

    @property
    def hidden_size(self) -> int:
        return self.facts.hidden_size

    @property
    def request_limits(self) -> RequestLimits:
        return self.facts.limits

    def summary(self) -> EngineSummary:
        """The engine's (every Ray replica runs the same model and knobs: replica 0's)."""
        return self.facts.summary

    def check_request(self, token_ids: list[int], params: SamplingParams | PoolingParams) -> int:
        return self.facts.limits.check(token_ids, params)


class MetricsView(Protocol):
    """The engine's metrics as the server shows them: the /metrics page and the periodic log line."""

    def render(self) -> str:
        """The Prometheus text page."""
        ...

    def log_line(self, now: float) -> tuple[str, bool]:
        """The stats line since the last call, and whether there was work."""
        ...


@runtime_checkable
class EngineClient(Protocol):
    """An engine the API serves from. Call `start()` on the event loop once, `add_request` from it;
    `shutdown()` drains and stops. Errors are engine.exceptions' (dead, full, draining, aborted,
    timed out) or ValueError for the client's own mistake."""

    max_queue: int | None        # most requests waiting to run; None: unbounded
    metrics: MetricsView | None
    is_draining: bool

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def hidden_size(self) -> int:
        """The model's hidden size: the length of its embeddings."""
        ...

    @property
    def request_limits(self) -> RequestLimits: ...

    @property
    def health_error(self) -> str | None:
        """Why the engine cannot serve, or None while it can."""
        ...

    def summary(self) -> EngineSummary: ...

    def check_request(self, token_ids: list[int], params: SamplingParams | PoolingParams) -> int:
        """The pure validation (vocabulary, context length); raises ValueError for the client."""
        ...

    def check_grammar(self, structured_outputs: StructuredOutputsParams) -> None:
        """Raises ValueError for the client unless the constraint compiles against the vocabulary and
        takes its first tokens within the grammar engine's limits. May block while it compiles."""
        ...

    def add_request(self, request: GenerateRequest) -> RequestStream:
        """Queue a validated request and return its stream (on the event loop); raises without
        queueing anything when the engine is dead, draining or full."""
        ...

    def abort(self, request_id: str, error: BaseException | None = None) -> None: ...

    async def inspect(self, read: str, *args: str) -> Any:
        """The payload of the named read `read` (INSPECT_READS), consistent with one moment of the
        engine; raises EngineDeadError when the engine cannot answer."""
        ...

    def start(self) -> None: ...

    def begin_draining(self) -> None:
        """Admit nothing new; requests already admitted keep running."""
        ...

    def shutdown(self, timeout: float = 0.0) -> None:
        """Stop admitting, give in-flight requests `timeout` seconds, abort the rest, stop."""
        ...

