"""The engine process: an LLMEngine stepping in a process of its own (vLLM V1's engine core), so the
API server's work (its event loop, JSON, validation, tokenizing) never holds the GIL that the engine's
kernel launches wait for. Its front end, the EngineClient the API talks to, is process_client.py's.

Owns the child's side and its handle in the parent: the start (`EngineProcess.start` spawns it; it
builds the engine from the config, or from a picklable loader, and answers EngineStarted with its
facts or EngineFailed with why), the loop (apply the commands that came, step while there is work,
send one EngineUpdate per pass, block on the pipe when idle) and the end (a Shutdown command, or its
pipe closing: the parent is gone, so nothing is left running). Knows nothing of streams, admission
or metrics: the front end keeps those.

Two one-way pipes carry pickled messages: lists of commands in, updates out. Only the parent that
spawned the child ever reads what the child sends (unpickling runs code: no socket, no other peer).
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from vllmlite.config import EngineConfig
from vllmlite.engine.client import EngineFacts
from vllmlite.engine.exceptions import EngineStartError
from vllmlite.engine.llm_engine import LLMEngine
from vllmlite.engine.request_stream import GenerateRequest
from vllmlite.models.loader import LoadedModel
from vllmlite.outputs import EmbeddingRequestOutput, OutputProgress, RequestOutput
from vllmlite.stats import EngineStats
from vllmlite.utils.heap import freeze_startup_heap

logger = logging.getLogger(__name__)
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [engine process]: %(message)s"
STOP_TIMEOUT = 5.0  # seconds a process told to stop (or whose pipe closed) gets before it is killed

# A picklable function that returns the model, called in the engine process: a module-level function
# or a functools.partial of one (pickled by name, so the weights never cross the pipe).
ModelLoader = Callable[[], LoadedModel]


# --- messages: the parent sends lists of commands --------------------------------------------------

@dataclass
class AddRequest:
    request: GenerateRequest
    final_only: bool  # its reader takes only the finished output (LLMEngine.add_request's final_only)


@dataclass
class AbortRequest:
    request_id: str
    reason: str  # for its trace ("client disconnected", "timeout", ...)


@dataclass
class ReadEngine:
    """Run `read(engine)` between two steps and answer with its value (inspection.py's snapshots)."""

    read_id: int
    read: Callable[[LLMEngine], Any]  # pickled by name, as ModelLoader


@dataclass
class Shutdown:
    """Answer the commands before this one, then exit."""


Command = AddRequest | AbortRequest | ReadEngine | Shutdown


# --- messages: the child sends one of these first, then an update per pass --------------------------

@dataclass
class EngineStarted:
    facts: EngineFacts


@dataclass
class EngineFailed:
    message: str  # "<exception type>: <message>", as the child saw it (its log has the traceback)


@dataclass
class EngineUpdate:
    """One pass of the child's loop: what its commands did, the step's outputs and the stats after it."""

    stats: EngineStats = field(default_factory=EngineStats)
    num_batches: int = 0  # command lists received so far (what the front end's heartbeat counts as answered)
    num_added: int = 0    # adds applied so far, rejected ones too (the front end counts the rest as in flight)
    outputs: list[RequestOutput | EmbeddingRequestOutput] = field(default_factory=list)
    # The outputs of final-only requests before their last, as plain tuples (OutputProgress._make
    # rebuilds them): 256 NamedTuples took 210 us a step to pickle on an EPYC core, plain tuples 30.
    progress: list[tuple] = field(default_factory=list)
    rejected: list[tuple[str, BaseException]] = field(default_factory=list)  # adds the engine refused, and why
    aborted: list[str] = field(default_factory=list)  # aborts that found their request unfinished
    answers: list[tuple[int, Any, BaseException | None]] = field(default_factory=list)  # (read id, value, error)


# --- the child ------------------------------------------------------------------------------------

def run_engine_process(config: EngineConfig, loader: ModelLoader | None, commands: Connection,
                       updates: Connection, log_level: int) -> None:
    """The engine process's entry point: build the engine, say so, serve until told to stop or orphaned."""
    # A terminal's Ctrl-C, or a service manager's SIGTERM, may reach the whole process group: the parent
    # drains first and then tells this process to stop, so it must outlive the signal.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=LOG_FORMAT)
    try:
        engine = LLMEngine(config, loader() if loader is not None else None)
    except BaseException as error:  # MemoryError, a bad path, a missing package: the parent raises it
        logger.exception("the engine failed to start")
        _send(updates, EngineFailed(f"{type(error).__name__}: {error}"))
        return
    facts = EngineFacts(engine.tokenizer, engine.request_limits, engine.model_config.hidden_size, engine.summary())
    freeze_startup_heap()   # torch, the model, the block pool: a full collection would walk them, mid-step
    if not _send(updates, EngineStarted(facts)):
        return
    try:
        EngineLoop(engine, commands, updates).run()
    except BaseException as error:  # a fault of the loop itself: the front end marks the engine dead
        logger.exception("the engine loop failed; the engine is dead")
        _send(updates, EngineFailed(f"{type(error).__name__}: {error}"))
        raise SystemExit(1) from None


class EngineLoop:
    """The child's loop over its pipes. Only this loop touches the engine."""

    def __init__(self, engine: LLMEngine, commands: Connection, updates: Connection) -> None:
        self.engine = engine
        self._commands = commands
        self._updates = updates
        self._unfinished: set[str] = set()  # the requests added and not yet finished or aborted
        self._num_batches = 0
        self._num_added = 0

    def run(self) -> None:
        """Until a Shutdown command, or a pipe closes (the parent is gone)."""
        while True:
            commands = self._receive(block=not self.engine.has_unfinished_requests())
            if commands is None:
                return
            update = EngineUpdate()
            stop = False
            for command in commands:
                stop = stop or isinstance(command, Shutdown)
                if not stop:
                    self._apply(command, update)
            if not stop and self.engine.has_unfinished_requests():
                self._step(update)
            update.stats = self.engine.get_stats()
            update.num_batches, update.num_added = self._num_batches, self._num_added
            if not _send(self._updates, update) or stop:
                return

    def _receive(self, block: bool) -> list[Command] | None:
        """Every command list waiting (waiting for one if `block`); None once the pipe is closed and
        read to its end."""
        commands: list[Command] = []
        try:
            while block or self._commands.poll():
                commands += self._commands.recv()
                self._num_batches += 1
                block = False
        except (EOFError, OSError):
            return commands or None  # what came before the end still counts (a Shutdown, then the close)
        return commands

    def _apply(self, command: Command, update: EngineUpdate) -> None:
        if isinstance(command, AddRequest):
            self._add(command, update)
        elif isinstance(command, AbortRequest):
            if command.request_id in self._unfinished:
                self._unfinished.discard(command.request_id)
                self.engine.abort_request(command.request_id, command.reason)
                update.aborted.append(command.request_id)
        else:
            try:
                update.answers.append((command.read_id, command.read(self.engine), None))
            except Exception as error:  # the reader's fault, not the engine's: its caller gets it
                update.answers.append((command.read_id, None, _transferable(error)))

    def _add(self, command: AddRequest, update: EngineUpdate) -> None:
        request = command.request
        self._num_added += 1
        try:
            self.engine.add_request(request.request_id, request.prompt_token_ids, request.params,
                                    arrival_time=request.arrival_time, priority=request.priority,
                                    cache_salt=request.cache_salt, client_id=request.client_id,
                                    final_only=command.final_only)
        except Exception as error:  # this request's fault alone (a ValueError: the client's): the engine took nothing
            if not isinstance(error, ValueError):
                logger.exception("request %s failed while being queued", request.request_id)
            update.rejected.append((request.request_id, _transferable(error)))
            return
        self._unfinished.add(request.request_id)

    def _step(self, update: EngineUpdate) -> None:
        """One engine step (a final-only request's outputs before its last are OutputProgress)."""
        for output in self.engine.step():
            if isinstance(output, OutputProgress):
                update.progress.append(tuple(output))
                continue
            if output.finished:
                self._unfinished.discard(output.request_id)
            update.outputs.append(output)


def _send(connection: Connection, message: Any) -> bool:
    """Send to the parent; False if it is gone."""
    try:
        connection.send(message)
    except OSError:
        return False
    return True


def _transferable(error: BaseException) -> BaseException:
    """A plain copy of `error` that always crosses the pipe (an exception type of the engine's may not):
    a ValueError (the client's mistake) stays one; any other becomes a RuntimeError naming its type."""
    if isinstance(error, ValueError):
        return ValueError(str(error))
    return RuntimeError(f"{type(error).__name__}: {error}")


# --- the parent's handle ---------------------------------------------------------------------------

class EngineProcess:
    """A started engine process: the pipes to it, the facts it sent, and its end."""

    def __init__(self, process: multiprocessing.process.BaseProcess, commands: Connection, updates: Connection,
                 facts: EngineFacts, config: EngineConfig) -> None:
        self.process = process
        self.commands = commands  # the parent's end: command lists go out here
        self.updates = updates    # and EngineUpdates come in here
        self.facts = facts
        self.config = config
        self.is_stopping = False  # stop() was called: the end of the pipe is expected
        self._join_lock = threading.Lock()  # one waiter at a time: two would race for the exit status
        atexit.register(self.stop)  # before multiprocessing's own exit handler, which would wait on it forever

    @classmethod
    def start(cls, config: EngineConfig, loader: ModelLoader | None = None) -> EngineProcess:
        """Spawn an engine process and return once its engine is built (a model load, kernel compiles
        and CUDA graph captures: seconds to minutes). Raises EngineStartError with the child's own
        message if it fails first, or with its exit status if it dies first."""
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no CUDA or lock state inherited
        command_out, command_in = context.Pipe(duplex=False)
        update_out, update_in = context.Pipe(duplex=False)
        process = context.Process(target=run_engine_process, name="vllmlite-engine", args=(
            config, loader, command_out, update_in, logging.getLogger().getEffectiveLevel()))
        process.start()
        command_out.close()  # the child's ends: closed here, so the child's death reads as end of file
        update_in.close()
        try:
            first = update_out.recv()
            if isinstance(first, EngineFailed):
                process.join(STOP_TIMEOUT)
                raise EngineStartError(f"the engine process failed to start: {first.message}")
        except EOFError:
            _close(command_in, update_out)
            raise EngineStartError(f"the engine process {_exit_reason(process)} before its engine was ready "
                                   "(its log above says why)") from None
        except BaseException:  # its own failure, or interrupted while waiting: take the child down too
            process.kill()
            _close(command_in, update_out)
            raise
        return cls(process, command_in, update_out, first.facts, config)

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def exit_reason(self) -> str:
        """How the process ended ("was killed by SIGKILL", "exited with status 1"), waiting briefly."""
        with self._join_lock:
            return _exit_reason(self.process)

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """Wait up to `timeout` seconds for the process to exit (after a Shutdown, or with its command pipe
        closed it exits by itself once its current step ends), then kill it. Idempotent."""
        self.is_stopping = True
        self.commands.close()
        with self._join_lock:
            self.process.join(timeout)
            if self.process.is_alive():
                logger.warning("the engine process did not exit within %.1f s: killing it", timeout)
                self.process.kill()
                self.process.join(STOP_TIMEOUT)
        atexit.unregister(self.stop)


def _close(*connections: Connection) -> None:
    for connection in connections:
        connection.close()


def _exit_reason(process: multiprocessing.process.BaseProcess) -> str:
    process.join(STOP_TIMEOUT)
    code = process.exitcode
    if code is None:
        return "closed its pipe but still runs"
    if code < 0:
        name = signal.Signals(-code).name
        return f"was killed by {name}" + (" (out of memory?)" if name == "SIGKILL" else "")
    return f"exited with status {code}"
