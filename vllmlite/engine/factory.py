"""Building a served engine from arguments: `make_async_engine` loads the model, makes the LLMEngine and
its metrics, and wraps them in an AsyncLLMEngine (the local EngineClient).

Owns which arguments go where. Knows nothing of HTTP or of the server's other knobs: it reads the
few fields `AsyncEngineArgs` names, which api.cli.ServerArgs has (as any EngineArgs subclass may).
"""

from __future__ import annotations

from typing import Protocol

from vllmlite.config import EngineConfig
from vllmlite.engine.async_engine import AsyncLLMEngine
from vllmlite.engine.llm_engine import LLMEngine
from vllmlite.engine.metrics import EngineMetrics
from vllmlite.models.loader import LoadedModel


class AsyncEngineArgs(Protocol):
    """What `make_async_engine` reads: EngineArgs' config, the served name, the metrics prefix and
    AsyncLLMEngine's admission and liveness bounds."""

    @property
    def model_name(self) -> str: ...

    @property
    def metrics_prefix(self) -> str: ...

    @property
    def max_queue(self) -> int | None: ...

    @property
    def request_timeout(self) -> float | None: ...

    @property
    def heartbeat_timeout(self) -> float | None: ...

    def create_engine_config(self) -> EngineConfig: ...


def make_async_engine(args: AsyncEngineArgs, loaded: LoadedModel | None = None) -> AsyncLLMEngine:
    """Load the model (unless `loaded` is given) and wrap its LLMEngine for serving; the engine
    thread starts with `start()` (the server's lifespan calls it)."""
    engine = LLMEngine(args.create_engine_config(), loaded)
    metrics = EngineMetrics(args.model_name, args.metrics_prefix, engine.max_model_len)
    return AsyncLLMEngine(engine, metrics, max_queue=args.max_queue, request_timeout=args.request_timeout,
                          heartbeat_timeout=args.heartbeat_timeout, model_name=args.model_name)
