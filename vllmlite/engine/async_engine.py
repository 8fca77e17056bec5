"""AsyncLLMEngine: one background thread steps the LLMEngine; asyncio callers get one stream per request.
The local EngineClient (client.py).

Owns the engine thread, the command queue (add/abort/inspect) drained before each step, admission
(queue bound, draining; the rules are admission.py's) and liveness (a fault of the loop marks the
engine dead). The streams
themselves are request_stream.py's. Knows nothing of HTTP: it raises engine.exceptions' typed errors,
which the API layer maps to statuses. Only the engine thread touches the LLMEngine's mutable state.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from vllmlite.engine.admission import abort_reason, check_admission, check_bounds, heartbeat_error
from vllmlite.engine.client import EngineSummary
from vllmlite.engine.exceptions import (
    EngineDeadError,
    RequestAbortedError,
)
from vllmlite.engine.inspection import EngineInspector
from vllmlite.engine.llm_engine import LLMEngine
from vllmlite.engine.metrics import EngineMetrics
from vllmlite.engine.request_limits import RequestLimits
from vllmlite.engine.request_stream import GenerateRequest, RequestStream, put_many
from vllmlite.outputs import RequestOutput
from vllmlite.pooling_params import PoolingParams
from vllmlite.sampling_params import SamplingParams
from vllmlite.stats import EngineStats
from vllmlite.structured_output_params import StructuredOutputsParams
from vllmlite.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
T = TypeVar("T")
INSPECT_TIMEOUT = 10.0  # seconds `inspect` waits for the engine thread to answer


@dataclass
class _Add:
    request: GenerateRequest
    stream: RequestStream


@dataclass
class _Abort:
    request_id: str
    error: BaseException | None = None  # sent to the stream, if it still has a listener


@dataclass
class _Inspect:
    """Run `read(engine)` on the engine thread between steps; its result (or error) goes to `result`."""

    read: Callable[[LLMEngine], Any]
    result: Future


class AsyncLLMEngine:
    """Runs `engine.step()` on one dedicated thread while there is work, and sleeps when idle.

    `max_queue` bounds the requests not yet running (queued commands plus the scheduler's waiting
    ones); `request_timeout` (seconds) bounds each request's life; a step running longer than
    `heartbeat_timeout` seconds makes the engine unhealthy (`health_error`) until it completes.
    `model_name` is the name the stats and debug payloads carry (None: the engine's configured model).
    Call `start()` once, then `add_request`/`generate` from the event loop; `shutdown()` drains
    and stops the thread.
    """

    def __init__(self, engine: LLMEngine, metrics: EngineMetrics | None = None,
                 max_queue: int | None = None, request_timeout: float | None = None,
                 heartbeat_timeout: float | None = None, model_name: str | None = None) -> None:
        check_bounds(max_queue, request_timeout, heartbeat_timeout)
        self.engine = engine
        self.metrics = metrics
        self.max_queue = max_queue
        self.request_timeout = request_timeout
        self.heartbeat_timeout = heartbeat_timeout
        self._step_started: float | None = None  # when the running step began; None between steps
        self._cond = threading.Condition()
        self._commands: list[_Add | _Abort] = []   # guarded by _cond
        self._streams: dict[str, RequestStream] = {}     # engine thread only
        self._stats = engine.get_stats()                 # guarded by _cond: as of the last step
        self._stop_requested = False
        self.is_draining = False
        self.dead_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._inspector = EngineInspector(self.run_between_steps, metrics,
                                          engine.config.model if model_name is None else model_name)

    # --- read-only views, safe from any thread --------------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def hidden_size(self) -> int:
        """The model's hidden size: the length of its embeddings."""
        return self.engine.model_config.hidden_size

    @property
    def request_limits(self) -> RequestLimits:
        return self.engine.request_limits

    def summary(self) -> EngineSummary:
        return self.engine.summary()

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def health_error(self) -> str | None:
        """Why the engine cannot serve (its loop failed, its thread is gone, or a step has run past
        the heartbeat timeout), or None while it can. A heartbeat, not process liveness."""
        if self.dead_error is not None:
            return f"the engine loop has failed: {self.dead_error}"
        if self._thread is not None and not self._thread.is_alive() and not self._stop_requested:
            return "the engine thread has stopped"
        return heartbeat_error(self._step_started, self.heartbeat_timeout, "a step has run for {:.0f} s")

    @property
    def num_unfinished_requests(self) -> int:
        """Requests queued or in the engine, as of the last step."""
        with self._cond:
            return self._stats.num_unfinished_requests + sum(isinstance(c, _Add) for c in self._commands)

    def get_stats(self) -> EngineStats:
        """The engine's stats as of its last step (or command applied)."""
        with self._cond:
            return self._stats

    def check_request(self, token_ids: list[int], params: SamplingParams | PoolingParams) -> int:
        """The engine's pure validation (vocab, context length); raises ValueError for the client."""
        return self.engine.check_request(token_ids, params)

    def check_grammar(self, structured_outputs: StructuredOutputsParams) -> None:
        """The constraint compiled (into the cache its request will use) and walked a few tokens;
        ValueError for the client. Blocks while it compiles: call it off the event loop."""
        self.engine.check_grammar(structured_outputs)

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run_loop, name="vllmlite-engine", daemon=True)
            self._thread.start()

    def begin_draining(self) -> None:
        """Admit nothing new; requests already admitted keep running."""
        self.is_draining = True

    def wait_until_idle(self, timeout: float | None) -> bool:
        """Block until no request is queued or unfinished (or the engine died); False on timeout."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self.is_dead or (not self._commands and self._stats.num_unfinished_requests == 0),
                timeout)

    def shutdown(self, timeout: float = 0.0) -> None:
        """Stop admitting, let in-flight requests finish within `timeout` seconds, abort the rest
        (their streams raise RequestAbortedError) and stop the engine thread."""
        self.begin_draining()
        if self.is_running and not self.wait_until_idle(timeout):
            logger.warning("shutdown: aborting %d unfinished request(s) after %.1f s",
                           self.num_unfinished_requests, timeout)
        with self._cond:
            self._stop_requested = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=max(timeout, 5.0))

    # --- requests (event loop side) -------------------------------------------------------------

    def add_request(self, request: GenerateRequest) -> RequestStream:
        """Queue a validated request and return its stream. Must run inside the event loop.

        Raises EngineDeadError (also while a step is past the heartbeat timeout), EngineDrainingError
        or QueueFullError without queueing anything.
        """
        stream = RequestStream(request.request_id, asyncio.get_running_loop(), self.abort, self.request_timeout)
        with self._cond:
            check_admission(self.health_error, self.is_draining or self._stop_requested, self.max_queue,
                            self._num_not_running())
            self._commands.append(_Add(request, stream))
            self._cond.notify_all()
        return stream

    def _num_not_running(self) -> int:
        return self._stats.scheduler.num_not_running + sum(isinstance(c, _Add) for c in self._commands)

    def abort(self, request_id: str, error: BaseException | None = None) -> None:
        """Abort a request from any thread; unknown or finished ids are ignored. Its trace says why:
        `error` (a timeout, the server shutting down), else that the client went away."""
        with self._cond:
            self._commands.append(_Abort(request_id, error))
            self._cond.notify_all()

    async def inspect(self, read: str, *args: str) -> Any:
        """The payload of the named read `read` (client.INSPECT_READS; inspection.py builds it), its
        snapshot taken between two steps. Raises EngineDeadError if the engine cannot answer."""
        return await self._inspector.read(read, *args)

    async def run_between_steps(self, read: Callable[[LLMEngine], T], timeout: float = INSPECT_TIMEOUT) -> T:
        """`read(engine)` run on the engine thread between two steps, so it sees consistent state (for
        snapshots such as `LLMEngine.debug_snapshot`). Without a running engine thread it runs here.
        Raises EngineDeadError if the engine cannot answer within `timeout` seconds."""
        if not self.is_running or self._stop_requested:
            return read(self.engine)  # no other thread touches the engine
        result: Future = Future()
        with self._cond:
            if self.dead_error is not None:
                raise EngineDeadError(f"the engine loop has failed: {self.dead_error}")
            self._commands.append(_Inspect(read, result))
            self._cond.notify_all()
        try:
            return await asyncio.wait_for(asyncio.wrap_future(result), timeout)
        except asyncio.TimeoutError:
            raise EngineDeadError(f"the engine did not answer within {timeout:g} s") from None

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Queue `request` and yield its outputs; a consumer that stops early aborts the request."""
        stream = self.add_request(request)
        try:
            async for output in stream:
                yield output
        finally:
            stream.cancel()

    # --- the engine thread ----------------------------------------------------------------------

    def _run_loop(self) -> None:
        try:
            while self._take_commands():
                self._step_started = time.monotonic()
                outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
                with self._cond:  # before delivering, so a consumer never sees counts older than its output
                    self._publish_stats()
                    self._cond.notify_all()
                self._deliver(outputs)
                self._step_started = None
        except BaseException as error:
            self._die(error)
            return
        self._abort_all(RequestAbortedError("the server shut down before this request finished"))
        self._fail_inspects(RequestAbortedError("the engine has stopped"))

    def _take_commands(self) -> bool:
        """Sleep until there is work; apply queued commands. False once shutdown is requested.
        Reads (`inspect`) run after the lock is released, still between steps: a slow snapshot never
        holds up the event loop's `add_request`."""
        inspects: list[_Inspect] = []
        with self._cond:
            while not (self._commands or self._stop_requested or self.engine.has_unfinished_requests()):
                self._cond.wait()
            commands, self._commands = self._commands, []
            for command in commands:
                if isinstance(command, _Add):
                    self._apply_add(command)
                elif isinstance(command, _Abort):
                    self._apply_abort(command)
                else:
                    inspects.append(command)
            self._publish_stats()
            self._cond.notify_all()
            keep_running = not self._stop_requested
        for command in inspects:
            _apply_inspect(command, self.engine)
        return keep_running

    def _apply_add(self, command: _Add) -> None:
        request = command.request
        try:
            self.engine.add_request(request.request_id, request.prompt_token_ids, request.params,
                                    arrival_time=request.arrival_time, priority=request.priority,
                                    cache_salt=request.cache_salt, client_id=request.client_id)
        except ValueError as error:  # a client error the caller's validation did not catch
            command.stream.put(error)
            return
        except Exception as error:  # this request's fault alone: the engine took nothing of it
            logger.exception("request %s failed while being queued", request.request_id)
            command.stream.put(error)
            return
        self._streams[request.request_id] = command.stream

    def _apply_abort(self, command: _Abort) -> None:
        stream = self._streams.pop(command.request_id, None)
        if stream is None:
            return
        self.engine.abort_request(command.request_id, abort_reason(command.error))
        stream.put(command.error or RequestAbortedError("the request was aborted"))
        if self.metrics is not None:
            self.metrics.record_abort(command.request_id)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        if self.metrics is not None:
            self.metrics.record_outputs(outputs, time.monotonic())
        delivered = []
        for output in outputs:
            stream = self._streams.pop(output.request_id) if output.finished \
                else self._streams.get(output.request_id)
            if stream is not None and (output.finished or not stream.final_only):
                delivered.append((stream, output))
        put_many(delivered)

    def _publish_stats(self) -> None:
        """Under _cond: the snapshot admission and `get_stats` read, and the metrics gauges."""
        self._stats = self.engine.get_stats()
        if self.metrics is not None:
            self.metrics.record_stats(self._stats)

    def _abort_all(self, error: BaseException) -> None:
        for request_id in list(self._streams):
            self._apply_abort(_Abort(request_id, error))

    def _fail_inspects(self, error: BaseException) -> None:
        with self._cond:
            pending = [c for c in self._commands if isinstance(c, _Inspect)]
            self._commands = [c for c in self._commands if not isinstance(c, _Inspect)]
        for command in pending:
            command.result.set_exception(error)

    def _die(self, error: BaseException) -> None:
        logger.exception("the engine loop failed; the engine is dead")
        dead = EngineDeadError(f"the engine loop has failed: {type(error).__name__}: {error}")
        with self._cond:
            self.dead_error = error
            pending = [c.stream for c in self._commands if isinstance(c, _Add)]
            inspects = [c for c in self._commands if isinstance(c, _Inspect)]
            self._commands.clear()
            self._cond.notify_all()
        for stream in [*self._streams.values(), *pending]:
            stream.put(dead)
        self._streams.clear()
        for command in inspects:
            command.result.set_exception(dead)


def _apply_inspect(command: _Inspect, engine: LLMEngine) -> None:
    try:
        command.result.set_result(command.read(engine))
    except Exception as error:  # the reader's fault, not the engine's: the caller gets it
        command.result.set_exception(error)
