"""The ingress's engine over N Ray Serve replicas: `RemoteEngine` implements EngineClient
(engine/client.py) as the local AsyncLLMEngine does, and routes each request to a replica
(vllmlite/api/ray/routing.py), so every route, error, auth and stream of the server is unchanged by
construction. Its `inspect` asks every replica the same named read and merges the answers
(replica_debug.py).

Owns replica selection, the ingress-side stream of each request, replica health (polled; a replica
that fails is routed around until it answers again) and the merged /metrics page. Knows nothing of
HTTP but the 404 of a trace some replicas could not be asked for. Imports Ray: the server loads this
module only for --num-replicas > 1 or --ray-address.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import ray
from ray import serve
from starlette.responses import JSONResponse

from vllmlite.api.cli import ServerArgs
from vllmlite.api.ops.debug import no_trace
from vllmlite.api.ray.replica import ReplicaHealth, replica_app
from vllmlite.api.ray.replica_debug import ReplicaAnswers, merge_answers
from vllmlite.api.ray.replica_metrics import merge_replica_metrics
from vllmlite.api.ray.routing import NoReplicaError, Router, request_cost, routing_key
from vllmlite.engine.client import EngineFacts, RemoteFactsViews
from vllmlite.engine.exceptions import EngineDeadError, EngineDrainingError
from vllmlite.engine.request_stream import GenerateRequest, RequestStream
from vllmlite.sampling_params import SamplingParams
from vllmlite.structured_output_params import StructuredOutputsParams

logger = logging.getLogger(__name__)
POLL_INTERVAL = 0.5   # seconds between health and metrics polls of each replica
POLL_TIMEOUT = 3.0    # a replica that does not answer a poll in this time is down
DRAIN_POLL = 0.5      # seconds between looks at a draining replica's health
MAX_REPORTED_HITS = 4096  # (replica, prefix) pairs whose last prefix-cache hit the ingress remembers
# /v1/stats and /debug/*: a replica whose engine does not answer in this time (a long step) is left
# out of the answer rather than holding up the others' (it is not marked down for it).
INSPECT_TIMEOUT = 5.0


@dataclass
class ReplicaState:
    """The ingress's view of one replica."""

    index: int
    handle: serve.handle.DeploymentHandle
    is_healthy: bool = True
    error: str | None = None         # why it is down (or degraded), if it is
    pid: int | None = None
    load: float = 0.0                # the costs of its requests in flight (routing.request_cost)
    num_in_flight: int = 0
    metrics_page: str | None = None  # its last /metrics text

    @property
    def state(self) -> str:
        return "healthy" if self.is_healthy else "down"


class ReplicaMetrics:
    """`engine.metrics` for the server: every replica's registry, labelled `replica`."""

    def __init__(self, replicas: list[ReplicaState]) -> None:
        self._replicas = replicas

    def render(self) -> str:
        return merge_replica_metrics([r.metrics_page for r in self._replicas])

    def log_line(self, now: float) -> tuple[str, bool]:
        loads = [r.num_in_flight for r in self._replicas]
        healthy = sum(r.is_healthy for r in self._replicas)
        return f"replicas: {healthy}/{len(loads)} healthy, in-flight requests {loads}", any(loads)


class RemoteEngine(RemoteFactsViews):
    """The EngineClient the API uses, served by Ray Serve replicas."""

    def __init__(self, handles: list[serve.handle.DeploymentHandle], facts: EngineFacts, config: ServerArgs,
                 owns_ray: bool, owns_replicas: bool) -> None:
        self.replicas = [ReplicaState(i, handle) for i, handle in enumerate(handles)]
        self.facts = facts
        self.router = Router(config.routing)
        self.model_name = config.model_name
        self.max_queue = config.max_queue
        self.request_timeout = config.request_timeout
        self.metrics = ReplicaMetrics(self.replicas)
        self.is_draining = False
        self._owns_ray = owns_ray
        self._owns_replicas = owns_replicas  # False when attached to applications deployed from a config file
        self._pumps: dict[str, tuple[asyncio.Task, ReplicaState, RequestStream]] = {}
        # (replica, routing key) -> the prompt tokens its last request with that prefix found cached
        self._reported_hits: OrderedDict[tuple[int, bytes], int] = OrderedDict()
        self._poller: asyncio.Task | None = None
        self._stopped = False

    # --- what the API reads (tokenizer, limits, summary, check_request: RemoteFactsViews) ----------

    def check_grammar(self, structured_outputs: StructuredOutputsParams) -> None:
        """Only llguidance's own validation (the ingress compiles nothing against the vocabulary): a
        grammar that breaks a limit once tokens come ends its request on a replica, as a 400."""
        structured_outputs.verify()

    @property
    def health_error(self) -> str | None:
        """None while at least one replica serves (healthy or degraded); why not, when none does."""
        if self._stopped or any(r.is_healthy for r in self.replicas):
            return None
        return "every replica is down: " + "; ".join(f"replica {r.index}: {r.error}" for r in self.replicas)

    def health_report(self) -> dict:
        """/health/replicas: `ok` (all healthy), `degraded` (some down) or `dead` (none serves)."""
        num_healthy = sum(r.is_healthy for r in self.replicas)
        status = "ok" if num_healthy == len(self.replicas) else "degraded" if num_healthy else "dead"
        return {"status": status, "replicas": [
            {"replica": r.index, "state": r.state, "error": r.error, "pid": r.pid,
             "in_flight_requests": r.num_in_flight} for r in self.replicas]}

    async def inspect(self, read: str, *args: str) -> Any:
        """The named read `read` over every healthy replica, merged (replica_debug.merge_answers). A
        replica that is down or does not answer in time is left out and named in `missing_replicas`;
        none answering raises EngineDeadError. An id no answering replica has a trace of, while some did
        not answer, is a 404 naming them (it may be on one of those)."""
        replies = await self.inspect_replicas(read, *args)
        if not replies.answers:
            raise EngineDeadError(f"no replica answered: {replies.describe_missing()}")
        payload = merge_answers(read, self.model_name, replies, time.time())
        if read == "request" and payload is None and replies.missing:
            raise no_trace(args[0], replies.describe_missing())
        return payload

    async def inspect_replicas(self, read: str, *args: str, timeout: float = INSPECT_TIMEOUT) -> ReplicaAnswers:
        """`EngineReplica.inspect(read, *args)` on every healthy replica at once. Returns within
        `timeout` seconds; a replica that is down, fails or does not answer in time is left out and
        named with why, in `missing`."""
        healthy = [r for r in self.replicas if r.is_healthy]
        results = await asyncio.gather(*(asyncio.wait_for(r.handle.inspect.remote(read, *args), timeout)
                                         for r in healthy), return_exceptions=True)
        answers, missing = [], [(r.index, f"down ({r.error})") for r in self.replicas if not r.is_healthy]
        for replica, result in zip(healthy, results):
            if isinstance(result, asyncio.TimeoutError):
                missing.append((replica.index, f"no answer within {timeout:g} s"))
            elif isinstance(result, BaseException):
                missing.append((replica.index, f"{type(result).__name__}: {result}".splitlines()[0]))
            else:
                answers.append((replica.index, result))
        return ReplicaAnswers(answers, sorted(missing))

    # --- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        """Start polling the replicas (on the running event loop: the app's lifespan calls this)."""
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll_forever())

    def begin_draining(self) -> None:
        self.is_draining = True

    def shutdown(self, timeout: float = 0.0) -> None:
        """Admit nothing new; every replica finishes its in-flight requests within `timeout`
        seconds and stops; then the Serve applications we deployed are deleted (and Ray stopped, if
        we started it). Idempotent: SIGTERM's drain and the app's lifespan both call it."""
        if self._stopped:
            return
        self.begin_draining()
        deadline = time.monotonic() + timeout + 10.0
        if not self._owns_replicas:  # replicas deployed from a config file outlive this ingress
            self._wait_for_pumps(deadline - 10.0)
            self._stopped = True
            return
        drains = [(r, r.handle.drain.remote(timeout)) for r in self.replicas if r.is_healthy]
        for replica, drain in drains:
            self._wait_for_drain(replica, drain, deadline)
        # A replica's last outputs may still be on their way when its drain returns: let them arrive.
        self._wait_for_pumps(time.monotonic() + 10.0)
        self._stopped = True  # before the deletes: /health must not call the server dead meanwhile
        if self._poller is not None:
            self._poller.get_loop().call_soon_threadsafe(self._poller.cancel)
        if self._owns_ray:  # our own local Ray: stopping it stops Serve and the (drained) replicas at once
            ray.shutdown()
            return
        if self._owns_replicas:
            for replica in self.replicas:
                serve.delete(f"vllmlite-replica-{replica.index}", _blocking=False)

    @staticmethod
    def _wait_for_drain(replica: ReplicaState, drain, deadline: float) -> None:
        """Until `replica` has drained, or `deadline`, or it goes down (the poller still runs): a replica
        whose process, or Ray itself, is gone will never answer (e.g. a signal sent to the whole
        process group reached Ray's own processes too), so there is nothing to wait for."""
        while True:
            try:
                drain.result(timeout_s=max(min(DRAIN_POLL, deadline - time.monotonic()), 0.01))
                return
            except TimeoutError:  # Ray's GetTimeoutError is one
                if not replica.is_healthy or time.monotonic() >= deadline:
                    logger.warning("replica %d did not finish draining: %s", replica.index,
                                   replica.error or "out of time")
                    return
            except Exception as error:  # a dead replica has nothing to drain
                logger.warning("draining replica %d failed: %s", replica.index, error)
                return

    def _wait_for_pumps(self, deadline: float) -> None:
        """Off the event loop: until no request is being forwarded, or `deadline`."""
        while self._pumps and time.monotonic() < deadline:
            time.sleep(0.05)

    # --- requests ---------------------------------------------------------------------------------

    def add_request(self, request: GenerateRequest) -> RequestStream:
        """Route `request` to a replica and return its stream. Raises EngineDrainingError, or
        EngineDeadError when no replica is healthy, without sending anything."""
        if self.is_draining:
            raise EngineDrainingError("the server is shutting down and accepts no new requests")
        key = routing_key(request.prompt_token_ids, self.facts.limits.block_size, request.cache_salt)
        costs = [_cost(request, self._reported_hits.get((r.index, key), 0) if key else 0) for r in self.replicas]
        try:
            index = self.router.choose(key, [r.load for r in self.replicas],
                                       [r.is_healthy for r in self.replicas], costs)
        except NoReplicaError:
            raise EngineDeadError(self.health_error or "no replica is healthy") from None
        replica, cost = self.replicas[index], costs[index]
        loop = asyncio.get_running_loop()
        stream = RequestStream(request.request_id, loop, self.abort, self.request_timeout)
        replica.load += cost
        replica.num_in_flight += 1
        task = loop.create_task(self._pump(replica, request, stream, cost, key))
        self._pumps[request.request_id] = (task, replica, stream)
        return stream

    def abort(self, request_id: str, error: BaseException | None = None) -> None:
        """Stop forwarding a request (its replica aborts it); unknown ids are ignored."""
        entry = self._pumps.pop(request_id, None)
        if entry is not None:
            task, _, stream = entry
            if error is not None:
                stream.put_nowait(error)
            task.cancel()

    async def _pump(self, replica: ReplicaState, request: GenerateRequest, stream: RequestStream,
                    cost: float, key: bytes | None) -> None:
        """Forward the replica's items to `stream`; a replica that fails ends it with a 503."""
        outputs = replica.handle.generate.options(stream=True).remote(request)
        try:
            async for item in outputs:
                stream.put_nowait(item)
                if isinstance(item, BaseException):
                    return
                if item.finished:
                    self._remember_hit(replica.index, key, item.num_cached_tokens)
                    return
            stream.put_nowait(EngineDeadError(f"replica {replica.index} ended the request without a result"))
        except asyncio.CancelledError:
            if request.request_id in self._pumps:  # not our abort (it pops first): Ray's stream was cut
                self._fail(replica, stream, "its stream was cancelled (Ray shutting down?)")
                return
            with contextlib.suppress(Exception):  # Ray may be stopping
                outputs.cancel()
            raise
        except Exception as error:
            self._fail(replica, stream, f"{type(error).__name__}: {error}".splitlines()[0])
        finally:
            replica.load -= cost
            replica.num_in_flight -= 1
            self._pumps.pop(request.request_id, None)

    def _remember_hit(self, index: int, key: bytes | None, num_cached_tokens: int) -> None:
        """What replica `index` found cached for prefix `key`: the next request with that prefix costs it
        that much less (routing.request_cost). Bounded: the least recently reported are forgotten."""
        if key is None:
            return
        self._reported_hits[(index, key)] = num_cached_tokens
        self._reported_hits.move_to_end((index, key))
        if len(self._reported_hits) > MAX_REPORTED_HITS:
            self._reported_hits.popitem(last=False)

    def _fail(self, replica: ReplicaState, stream: RequestStream, error: str) -> None:
        self._mark_down(replica, error)
        stream.put_nowait(EngineDeadError(f"replica {replica.index} failed while serving this request; "
                                          "retry: other replicas are serving"))

    def _mark_down(self, replica: ReplicaState, error: str) -> None:
        """Route around `replica`; end its in-flight requests with a 503 (its process may be gone, and
        a stream from it might never end) instead of letting them wait."""
        if replica.is_healthy:
            logger.warning("replica %d is down: %s", replica.index, error)
        replica.is_healthy, replica.error = False, error
        for request_id, (_, owner, _) in list(self._pumps.items()):
            if owner is replica:
                self.abort(request_id, EngineDeadError(f"replica {replica.index} is down ({error}); retry: "
                                                       "other replicas are serving"))

    # --- polling ----------------------------------------------------------------------------------

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.gather(*(self._poll(r) for r in self.replicas))
            await asyncio.sleep(POLL_INTERVAL)

    async def _poll(self, replica: ReplicaState) -> None:
        try:
            health: ReplicaHealth = await asyncio.wait_for(replica.handle.health.remote(), POLL_TIMEOUT)
            replica.metrics_page = await asyncio.wait_for(replica.handle.metrics.remote(), POLL_TIMEOUT)
        except Exception as error:
            self._mark_down(replica, f"no answer to a health check ({type(error).__name__})")
            return
        replica.pid = health.pid  # requests on a process that died fail in _pump (Ray raises ActorDiedError)
        if health.health_error is not None:
            self._mark_down(replica, health.health_error)
        elif not replica.is_healthy:
            logger.info("replica %d is healthy again", replica.index)
            replica.is_healthy, replica.error = True, None


def _cost(request: GenerateRequest, num_cached_tokens: int) -> float:
    """The request's load for routing on a replica that last found `num_cached_tokens` of its prefix
    cached: its uncached prompt plus its most output tokens (an embedding: its prompt alone)."""
    params = request.params
    max_output = (params.max_tokens or 0) * params.num_sequences if isinstance(params, SamplingParams) else 0
    return request_cost(len(request.prompt_token_ids), num_cached_tokens, max_output)


def launch_replicas(config: ServerArgs) -> RemoteEngine:
    """Connect to Ray (`config.ray_address`, else a local instance), run `config.num_replicas`
    EngineReplica deployments (no Serve HTTP proxy: this process is the ingress), or attach to them
    if a cluster already runs them (examples/ray_serve_config.yaml), and return the ingress's engine
    once every replica is up."""
    owns_ray = not ray.is_initialized() and config.ray_address is None
    # Ray's agents start as Python processes: on a busy small machine they take longer than the 30 s
    # its node waits for them by default, and the node then aborts.
    os.environ.setdefault("RAY_agent_register_timeout_ms", "180000")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    started = time.monotonic()
    if not ray.is_initialized():
        ray.init(address=config.ray_address, logging_level=logging.WARNING, include_dashboard=False)
    serve.start(proxy_location="Disabled")
    ray_ready = time.monotonic()
    names = [f"vllmlite-replica-{i}" for i in range(config.num_replicas)]
    running = serve.status().applications
    attach = config.ray_address is not None and all(name in running for name in names)
    if attach:
        logger.info("attaching to the running applications %s (e.g. from serve deploy)", ", ".join(names))
        handles = [serve.get_app_handle(name) for name in names]
    else:
        server_args = config.replica_args()
        num_cpus = max(0.1, min(1.0, ray.available_resources().get("CPU", 1.0) / config.num_replicas))
        handles = serve.run_many([serve.RunTarget(replica_app(server_args, i, num_cpus), name=name, route_prefix=None)
                                  for i, name in enumerate(names)])
    facts: EngineFacts = handles[0].facts.remote().result()
    logger.info("Ray and Serve up in %.1f s, %d replicas in %.1f s more", ray_ready - started, len(handles),
                time.monotonic() - ray_ready)
    return RemoteEngine(handles, facts, config, owns_ray, owns_replicas=not attach)


def add_replica_routes(app, engine: RemoteEngine) -> None:
    """GET /health/replicas: each replica's state, and `ok`, `degraded` or `dead` overall (200 unless
    dead, as /health)."""
    @app.get("/health/replicas", include_in_schema=False)
    async def replicas_health() -> JSONResponse:
        report = engine.health_report()
        return JSONResponse(report, status_code=503 if report["status"] == "dead" else 200)
