"""Building a served engine from arguments: `make_async_engine` loads the model, makes the LLMEngine and
its metrics, and wraps them in an AsyncLLMEngine (the local EngineClient); `make_process_engine` has an
engine process of its own build the engine, and puts a ProcessEngine in front of it.

Owns which arguments go where. Knows nothing of HTTP or of the server's other knobs: it reads the
few fields `AsyncEngineArgs` names, which api.cli.ServerArgs has (as any EngineArgs subclass may).
"""

from __future__ import annotations

from typing import Protocol

from vllmlite.config import EngineConfig
from vllmlite.engine.async_engine import AsyncLLMEngine
from vllmlite.engine.engine_process import EngineProcess, ModelLoader
from vllmlite.engine.llm_engine import LLMEngine
from vllmlite.engine.metrics import EngineMetrics
from vllmlite.engine.process_client import ProcessEngine
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


def make_process_engine(args: AsyncEngineArgs, loader: ModelLoader | None = None) -> ProcessEngine:
    """Start an engine process that loads the model (or calls `loader`, a picklable function returning
    a LoadedModel: the weights never cross the pipe) and builds the LLMEngine; return the ProcessEngine in
    front of it once it is ready. Raises EngineStartError with the process's own message if it is not."""
    process = EngineProcess.start(args.create_engine_config(), loader)
    metrics = EngineMetrics(args.model_name, args.metrics_prefix, process.facts.limits.max_model_len)
    return ProcessEngine(process, metrics, max_queue=args.max_queue, request_timeout=args.request_timeout,
                         heartbeat_timeout=args.heartbeat_timeout, model_name=args.model_name)
