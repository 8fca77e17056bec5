"""One engine replica as a Ray Serve deployment: an AsyncLLMEngine with the usual engine flags,
streaming each request's outputs back to the ingress.

Owns the replica side of the ingress protocol: `facts()` (tokenizer and request limits, so the
ingress checks requests without a model), `generate()` (RequestOutputs, then ends; an engine error is
yielded as a value, so the ingress re-raises the very exception AsyncLLMEngine raised), `health()`,
`metrics()`, `inspect()` (this engine's named reads: its /v1/stats and /debug/* payloads), `drain()`.
Knows nothing of routing or HTTP. Imports Ray: load it only for --num-replicas.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ray import serve

from vllmlite.api.cli import ServerArgs
from vllmlite.engine.client import EngineFacts
from vllmlite.engine.factory import make_async_engine
from vllmlite.engine.request_stream import GenerateRequest, StreamItem

# Health and metrics calls count against Serve's limit too; generation is bounded by the engine's queue.
MAX_ONGOING_REQUESTS = 4096


@dataclass(frozen=True)
class ReplicaHealth:
    pid: int
    health_error: str | None
    is_draining: bool
    num_unfinished_requests: int


@serve.deployment(max_ongoing_requests=MAX_ONGOING_REQUESTS, health_check_period_s=1.0,
                  health_check_timeout_s=10.0, graceful_shutdown_timeout_s=30.0,
                  logging_config={"enable_access_log": False})  # the ingress polls health and metrics
class EngineReplica:
    """Built from ServerArgs' fields (a dict, so a Serve config file can give them)."""

    def __init__(self, server_args: dict) -> None:
        self.engine = make_async_engine(ServerArgs(**server_args))
        self.engine.start()

    def facts(self) -> EngineFacts:
        engine = self.engine
        return EngineFacts(engine.tokenizer, engine.request_limits, engine.hidden_size, engine.summary())

    def health(self) -> ReplicaHealth:
        return ReplicaHealth(os.getpid(), self.engine.health_error, self.engine.is_draining,
                             self.engine.num_unfinished_requests)

    def metrics(self) -> str:
        return self.engine.metrics.render() if self.engine.metrics is not None else ""

    async def inspect(self, read: str, *args: str) -> Any:
        """The payload this engine would answer its route with (`AsyncLLMEngine.inspect`), read on the
        engine thread between steps: `stats` (/v1/stats), `requests`, `request` (an id; None when
        there is no trace of it) or `engine` (/debug/engine). Only these named reads ever run."""
        return await self.engine.inspect(read, *args)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[StreamItem]:
        """The request's outputs; an error (queue full, draining, dead, aborted, bad request) is
        yielded as the last item. Cancelled by the ingress (client gone): the request is aborted."""
        try:
            stream = self.engine.add_request(request)
        except Exception as error:
            yield error
            return
        try:
            async for output in stream:
                yield output
        except Exception as error:
            yield error
        finally:
            stream.cancel()

    async def drain(self, timeout: float) -> None:
        """Finish in-flight requests within `timeout` seconds, abort the rest, stop the engine."""
        await asyncio.to_thread(self.engine.shutdown, timeout)

    def check_health(self) -> None:
        """Serve's probe: a replica whose engine loop failed is replaced (a hung step is not: it
        is reported by `health()` and routed around until it completes)."""
        if self.engine.is_dead:
            raise RuntimeError(self.engine.health_error or "the engine is dead")


def replica_app(server_args: dict, index: int, num_cpus: float | None = None) -> serve.Application:
    """Replica `index` as a Serve application of one deployment (its name: `vllmlite-replica-<index>`)."""
    options = {"name": f"vllmlite-replica-{index}"}
    if num_cpus is not None:
        options["ray_actor_options"] = {"num_cpus": num_cpus}
    return EngineReplica.options(**options).bind(server_args)


def build_replica(args: dict) -> serve.Application:
    """Serve's application builder for a config file (`serve deploy`, `serve run`): args
    `{"index": i, "server_args": {...ServerArgs fields...}}`; see examples/ray_serve_config.yaml."""
    return replica_app(dict(args.get("server_args", {})), int(args["index"]))
