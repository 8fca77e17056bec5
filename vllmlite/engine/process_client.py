"""ProcessEngine: the EngineClient (client.py) in front of an engine process (engine_process.py), so
the API server's event loop, JSON and tokenizing never share a GIL with the engine's steps.

Owns the front end's side: one RequestStream per request, fed with request_stream.put_many (one
event-loop wake-up per step, as AsyncLLMEngine does); admission (queue bound, draining) from the stats
the engine process last sent plus the adds still on their way; the metrics, fed from what arrives;
`inspect` as a read run in the engine process between two steps; `check_request` from the facts the
process sent at start, `check_grammar` by compiling here (with the same tokenizer). Liveness: the
process dying (a crash, kill -9, the OOM killer) or its loop failing ends every open stream with
EngineDeadError and makes `health_error` say why; while the process owes an answer (it has requests,
or commands it has not answered) and has said nothing for `heartbeat_timeout` seconds, the engine is
unhealthy until it speaks (a step running long, as AsyncLLMEngine's heartbeat says).

Two threads: the outbox's writer sends command lists (command_outbox.py) and a reader applies the
updates. Knows nothing of HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any, TypeVar

from vllmlite.engine.admission import abort_reason, check_admission, check_bounds, heartbeat_error
from vllmlite.engine.async_engine import INSPECT_TIMEOUT
from vllmlite.engine.client import RemoteFactsViews
from vllmlite.engine.command_outbox import CommandOutbox, PendingAdd
from vllmlite.engine.engine_process import AbortRequest, EngineFailed, EngineProcess, EngineUpdate, ReadEngine, Shutdown
from vllmlite.engine.exceptions import EngineDeadError, RequestAbortedError
from vllmlite.engine.inspection import EngineInspector, RunOnEngine
from vllmlite.engine.llm_engine import LLMEngine
from vllmlite.engine.metrics import EngineMetrics
from vllmlite.engine.request_stream import GenerateRequest, RequestStream, StreamItem, put_many
from vllmlite.outputs import OutputProgress
from vllmlite.stats import EngineStats
from vllmlite.structured_output_params import StructuredOutputsParams
from vllmlite.worker.structured_output import GrammarCompiler

logger = logging.getLogger(__name__)
T = TypeVar("T")


class ProcessEngine(RemoteFactsViews):
    """The engine in a process of its own, behind the same interface and errors as AsyncLLMEngine.

    `max_queue`, `request_timeout`, `heartbeat_timeout` and `model_name` mean what they mean there.
    The process runs from construction (engine_process.EngineProcess.start); `start()` only notes the
    event loop. `shutdown()` drains, aborts the rest and stops the process.
    """

    def __init__(self, process: EngineProcess, metrics: EngineMetrics | None = None,
                 max_queue: int | None = None, request_timeout: float | None = None,
                 heartbeat_timeout: float | None = None, model_name: str | None = None) -> None:
        check_bounds(max_queue, request_timeout, heartbeat_timeout)
        self.process = process
        self.facts = process.facts
        self.metrics = metrics
        self.max_queue = max_queue
        self.request_timeout = request_timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.is_draining = False
        self.dead_reason: str | None = None
        self._cond = threading.Condition()
        # Guarded by _cond: the open requests (sent, neither finished nor aborted), the process's last
        # stats, the counts that say what it has not answered yet, and the reads waiting for their value.
        self._streams: dict[str, RequestStream] = {}
        self._stats = EngineStats()
        self._num_adds_posted = self._num_adds_applied = 0
        self._num_batches_sent = self._num_batches_answered = 0
        self._owed_since: float | None = None  # since when the process owes an update, while it does
        self._reads: dict[int, Future] = {}
        self._read_ids = itertools.count()
        self._stopping = False
        self._grammar_lock = threading.Lock()
        self._grammar: GrammarCompiler | None = None  # built at the first constrained request
        run: RunOnEngine = self.run_between_steps
        self._inspector = EngineInspector(run, metrics, process.config.model if model_name is None else model_name)
        self._shutdown_lock = threading.Lock()
        self._outbox = CommandOutbox(process.commands, self._on_send)
        self._reader = threading.Thread(target=self._read, name="vllmlite-engine-reader", daemon=True)
        self._reader.start()

    # --- read-only views, safe from any thread (the facts' own: RemoteFactsViews) ----------------

    @property
    def pid(self) -> int | None:
        """The engine process's id."""
        return self.process.pid

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    @property
    def is_running(self) -> bool:
        return self.process.is_alive()

    @property
    def health_error(self) -> str | None:
        """Why the engine cannot serve (its process died or its loop failed, or it has owed an answer
        for longer than the heartbeat timeout), or None while it can."""
        if self.dead_reason is not None:
            return self.dead_reason
        if self._stopping:
            return None
        return heartbeat_error(self._owed_since, self.heartbeat_timeout,
                               "the engine process has not answered for {:.0f} s")

    @property
    def num_unfinished_requests(self) -> int:
        """Requests on their way to the engine process or in it, as of its last update."""
        with self._cond:
            return self._stats.num_unfinished_requests + self._num_adds_posted - self._num_adds_applied

    def get_stats(self) -> EngineStats:
        """The engine's stats as of the last update the process sent."""
        with self._cond:
            return self._stats

    def check_grammar(self, structured_outputs: StructuredOutputsParams) -> None:
        """The constraint compiled here, against the same tokenizer and vocabulary, and walked a few
        tokens; ValueError for the client. Blocks while it compiles: call it off the event loop. (The
        engine process compiles it again for the request, off its step thread.)"""
        with self._grammar_lock:
            if self._grammar is None:
                self._grammar = GrammarCompiler(self.tokenizer, self.facts.limits.vocab_size)
        self._grammar.check(structured_outputs)

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Note the event loop the commands are flushed on (the process itself runs already)."""
        self._outbox.loop = asyncio.get_running_loop()

    def begin_draining(self) -> None:
        self.is_draining = True

    def wait_until_idle(self, timeout: float | None) -> bool:
        """Block until no request is open (or the engine died); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self.is_dead or not self._streams, timeout)

    def shutdown(self, timeout: float = 0.0) -> None:
        """Stop admitting, let open requests finish within `timeout` seconds, abort the rest (their
        streams raise RequestAbortedError), then stop the engine process. Idempotent."""
        with self._shutdown_lock:
            if self._stopping:
                return
            self.begin_draining()
            if not self.wait_until_idle(timeout):
                logger.warning("shutdown: aborting %d unfinished request(s) after %.1f s", len(self._streams), timeout)
            with self._cond:
                self._stopping = True
                open_ids = list(self._streams)
            for request_id in open_ids:
                self.abort(request_id, RequestAbortedError("the server shut down before this request finished"))
            self._outbox.post(Shutdown())
            self._outbox.flush()
            self._outbox.close(timeout=5.0)
            self.process.stop(max(timeout, 5.0))
            self._reader.join(timeout=5.0)
            self._fail_reads(EngineDeadError("the engine has stopped"))

    # --- requests (event loop side) -------------------------------------------------------------

    def add_request(self, request: GenerateRequest) -> RequestStream:
        """Queue a validated request and return its stream. Must run inside the event loop.

        Raises EngineDeadError (also while the process is past the heartbeat timeout),
        EngineDrainingError or QueueFullError without queueing anything, and ValueError for an id in use.
        """
        self._outbox.loop = loop = asyncio.get_running_loop()
        stream = RequestStream(request.request_id, loop, self.abort, self.request_timeout)
        with self._cond:
            check_admission(self.health_error, self.is_draining or self._stopping, self.max_queue,
                            self._num_not_running())
            if request.request_id in self._streams:
                raise ValueError(f"request id {request.request_id!r} is already in use")
            self._streams[request.request_id] = stream
            self._num_adds_posted += 1
        self._outbox.post(PendingAdd(request, stream))
        return stream

    def _num_not_running(self) -> int:
        return self._stats.scheduler.num_not_running + self._num_adds_posted - self._num_adds_applied

    def abort(self, request_id: str, error: BaseException | None = None) -> None:
        """Abort a request from any thread; unknown or finished ids are ignored. Its stream gets `error`
        (else RequestAbortedError) at once; its trace in the engine process says why."""
        with self._cond:
            stream = self._streams.pop(request_id, None)
            self._cond.notify_all()
        if stream is None:
            return
        stream.put(error or RequestAbortedError("the request was aborted"))
        self._outbox.post(AbortRequest(request_id, abort_reason(error)))

    async def inspect(self, read: str, *args: str) -> Any:
        """The payload of the named read `read` (client.INSPECT_READS), its snapshot taken in the engine
        process between two steps. Raises EngineDeadError if the engine cannot answer."""
        return await self._inspector.read(read, *args)

    async def run_between_steps(self, read: Callable[[LLMEngine], T], timeout: float = INSPECT_TIMEOUT) -> T:
        """`read(engine)` run in the engine process between two steps (`read` crosses the pipe by name).
        Raises EngineDeadError if the process cannot answer within `timeout` seconds."""
        result: Future = Future()
        with self._cond:
            if self.dead_reason is not None or self._stopping:
                raise EngineDeadError(self.dead_reason or "the engine has stopped")
            read_id = next(self._read_ids)
            self._reads[read_id] = result
        self._outbox.post(ReadEngine(read_id, read))
        try:
            return await asyncio.wait_for(asyncio.wrap_future(result), timeout)
        except asyncio.TimeoutError:
            with self._cond:
                self._reads.pop(read_id, None)
            raise EngineDeadError(f"the engine did not answer within {timeout:g} s") from None

    # --- the heartbeat ---------------------------------------------------------------------------

    def _on_send(self) -> None:
        """The writer is about to send a list of commands: the process owes an answer from now, unless
        it owed one already (then the silence is counted from its last update)."""
        with self._cond:
            if not self._is_owed():
                self._owed_since = time.monotonic()
            self._num_batches_sent += 1

    def _is_owed(self) -> bool:
        """Under _cond: whether the process owes an update (unanswered commands, or requests to step)."""
        return self._num_batches_sent > self._num_batches_answered or self._stats.num_unfinished_requests > 0

    # --- updates in -----------------------------------------------------------------------------

    def _read(self) -> None:
        """The reader thread: apply each update until the process ends."""
        try:
            while self._read_one():
                pass
        except Exception as error:  # an update that cannot be applied: no later one could be trusted
            logger.exception("applying the engine process's update failed")
            self._die(f"the engine's updates could not be applied: {type(error).__name__}: {error}")
            self.process.process.kill()

    def _read_one(self) -> bool:
        """Apply the next message; False once the pipe has closed."""
        try:
            message = self.process.updates.recv()
        except (EOFError, OSError):
            if not (self._stopping or self.process.is_stopping):
                self._die(f"the engine process has died: it {self.process.exit_reason()}")
            return False
        if isinstance(message, EngineFailed):
            self._die(f"the engine loop has failed: {message.message}")
        else:
            self._apply(message)
        return True

    def _apply(self, update: EngineUpdate) -> None:
        now = time.monotonic()
        delivered: list[tuple[RequestStream, StreamItem]] = []
        with self._cond:  # the stats first, so a reader never sees counts older than its output
            self._stats = update.stats
            self._num_adds_applied = update.num_added
            self._num_batches_answered = update.num_batches
            self._owed_since = now if self._is_owed() else None
            for output in update.outputs:
                stream = self._streams.pop(output.request_id, None) if output.finished \
                    else self._streams.get(output.request_id)
                if stream is not None and (output.finished or not stream.final_only):
                    delivered.append((stream, output))
            for request_id, error in update.rejected:
                stream = self._streams.pop(request_id, None)
                if stream is not None:
                    delivered.append((stream, error))
            reads = [(self._reads.pop(read_id, None), value, error) for read_id, value, error in update.answers]
            self._cond.notify_all()
        if self.metrics is not None:
            self.metrics.record_stats(update.stats)
            self.metrics.record_outputs([*update.outputs, *map(OutputProgress._make, update.progress)], now)
            for request_id in update.aborted:
                self.metrics.record_abort(request_id)
        put_many(delivered)
        for result, value, error in reads:
            if result is not None:
                _settle(result, value, error)

    def _die(self, reason: str) -> None:
        """The engine is dead: every open stream and waiting read gets EngineDeadError(reason)."""
        dead = EngineDeadError(reason)
        with self._cond:
            if self.dead_reason is not None:
                return
            self.dead_reason = reason
            streams, self._streams = list(self._streams.values()), {}
            self._cond.notify_all()
        logger.error("%s; the engine is dead", reason)
        put_many([(stream, dead) for stream in streams])
        self._fail_reads(dead)
        self._outbox.close(timeout=0)  # the writer has no one to write to

    def _fail_reads(self, error: BaseException) -> None:
        with self._cond:
            reads, self._reads = list(self._reads.values()), {}
        for result in reads:
            _settle(result, None, error)


def _settle(result: Future, value: Any, error: BaseException | None) -> None:
    """Set `result`, unless its waiter gave up on it meanwhile (a timeout cancels it)."""
    with contextlib.suppress(InvalidStateError):
        if error is None:
            result.set_result(value)
        else:
            result.set_exception(error)
