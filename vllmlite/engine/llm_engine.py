"""LLMEngine: one step = schedule, one forward pass, update, then output processing.

Owns the wiring (input processor, scheduler, runner, output processor), `step()`, the per-request
fault retry and the stats snapshot. Intake (prompt checks, n/best_of samples, seeds, grammar compiles)
lives in processor.py; groups, detokenization and stop strings in output_processor.py.
Knows nothing of HTTP or threads.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

from vllmlite.config import DTYPE_BYTES, EngineConfig
from vllmlite.core.async_scheduler import AsyncScheduler
from vllmlite.core.batch import RunnerOutput, ScheduledSequence, SchedulerOutput
from vllmlite.core.block_manager import BlockManager
from vllmlite.core.chunking import ChunkingPolicy
from vllmlite.core.request import FinishReason, Request, internal_error
from vllmlite.core.scheduler import Scheduler
from vllmlite.core.tracing import make_tracer
from vllmlite.engine.client import EngineSummary
from vllmlite.engine.output_processor import OutputProcessor, StopStringHit
from vllmlite.engine.processor import InputProcessor, NewRequest, Prompt
from vllmlite.engine.request_limits import RequestLimits
from vllmlite.kernels import get_kernels
from vllmlite.kernels.kv_dtype import kv_bytes_per_token
from vllmlite.models.decoder import DecoderModel
from vllmlite.models.loader import LoadedModel, load_model
from vllmlite.outputs import EmbeddingRequestOutput, OutputProgress, RequestOutput
from vllmlite.pooling_params import PoolingParams, PoolingType
from vllmlite.sampling_params import SamplingParams
from vllmlite.stats import EngineDebugSnapshot, EngineStats, KVOccupancy
from vllmlite.structured_output_params import StructuredOutputsParams
from vllmlite.threads import THREAD_ENV, THREAD_ENV_APPLIED
from vllmlite.worker.runner import ModelRunner, PendingStep
from vllmlite.worker.speculative import make_proposer

logger = logging.getLogger(__name__)


def uses_cuda_graphs(config: EngineConfig) -> bool:
    """Whether decode steps replay CUDA graphs (worker/cuda_graphs.py): on a GPU, unless enforce_eager."""
    return config.device == "cuda" and not config.enforce_eager


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        loaded = loaded or load_model(config.model, config.load_dtype, config.seed, config.weight_quantization)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_source = loaded.source
        sched = config.scheduler
        self.max_model_len = min(sched.max_model_len or loaded.config.max_position_embeddings,
                                 loaded.config.max_position_embeddings)
        backend = config.kernel_backend
        kernels = get_kernels(backend, config.device, config.dtype, config.int_dot)
        # The model the runner runs; public for tools that measure or spy on its forward pass.
        self.model = model = DecoderModel(loaded.config, loaded.weights, self.max_model_len, kernels)
        self.kv_kind = kv_kind = config.kv_kind   # what K/V are stored as on this backend
        mc = loaded.config
        self.kv_bytes_per_token = kv_bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, kv_kind,
                                                     DTYPE_BYTES[config.dtype])   # scales included
        bytes_per_block = self.kv_bytes_per_token * config.cache.block_size
        num_blocks = self._num_blocks(bytes_per_block)
        num_host_blocks = config.cache.resolve_num_host_blocks(bytes_per_block)
        logger.info("KV cache: %d blocks of %d tokens, dtype %s (%s), %d bytes per token, %.3f GiB",
                    num_blocks, config.cache.block_size, config.cache.kv_cache_dtype,
                    config.dtype if kv_kind == "auto" else kv_kind, self.kv_bytes_per_token,
                    num_blocks * bytes_per_block / (1 << 30))
        stop_ids = self.tokenizer.stop_token_ids
        # When every layer slides (Mistral), the blocks out of every window are freed (core/sliding_window.py).
        self.block_manager = BlockManager(num_blocks, config.cache.block_size,
                                          config.cache.enable_prefix_caching, num_host_blocks,
                                          loaded.config.uniform_sliding_window)
        spec = config.speculative
        self.tracer = make_tracer(config.trace, self.tokenizer.decode)  # read on the engine thread only
        self.chunking = ChunkingPolicy(sched, config.cache.block_size)  # fed each step's measured time
        graphs = uses_cuda_graphs(config)
        if graphs and loaded.config.num_experts:   # routing reads the router's logits on the host each layer
            logger.info("CUDA graphs: off for %s (its MoE layers route on the host)", loaded.config.architecture)
            graphs = False
        steps = sched.num_scheduler_steps if graphs else 1   # multi-step decoding replays the graphs
        scheduler = AsyncScheduler if sched.async_scheduling else Scheduler
        self.scheduler = scheduler(sched, self.block_manager, self.max_model_len,
                                   config.cache.preemption_mode, stop_ids,
                                   spec.num_speculative_tokens if spec else 0, self.tracer, self.chunking, steps - 1)
        proposer = make_proposer(spec, loaded, config, num_blocks, self.max_model_len, kernels) if spec else None
        self.runner = ModelRunner(model, num_blocks, config.cache.block_size, num_host_blocks, stop_ids,
                                  proposer,
                                  (sched.max_num_seqs, self.max_model_len, steps, sched.async_scheduling) if graphs else None,
                                  kv_kind)
        if backend == "numba":  # the others have nothing to compile; said before the wait, terminal or not
            logger.info("kernels: %s, compiling kernels (first start only, about 25 s on 2 quiet cores; "
                        "cached afterwards, 1-2 s)", backend)
        logger.info("kernels: %s, ready in %.1f s (compiled, or loaded from the on-disk cache)",
                    backend, model.warm_up())
        if graphs:
            logger.info("CUDA graphs: capturing decode steps of batch %s ...", self.runner.graphs.sizes)
            logger.info("CUDA graphs: captured in %.1f s (enforce_eager turns them off)", self.runner.capture_graphs())
        if not THREAD_ENV_APPLIED:
            logger.warning("numpy was imported before vllmlite, so its BLAS threads spin when idle and take "
                           "the cores the attention kernels need (steps up to 2x slower): import vllmlite "
                           "first, or set %s", " ".join(f"{k}={v}" for k, v in THREAD_ENV.items()))
        self.weights_bytes = loaded.weights.num_bytes
        self.input_processor = InputProcessor(self.tokenizer, self.request_limits, PoolingType(config.pooling),
                                              config.seed)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._in_flight: InFlight | None = None   # async scheduling: the step queued and not yet applied

    def _num_blocks(self, bytes_per_block: int) -> int:
        """The device pool's blocks: the configured count or budget, or on a GPU what
        gpu_memory_utilization leaves once the weights and the largest step are in memory."""
        cache, sched = self.config.cache, self.config.scheduler
        if self.config.device != "cuda" or cache.gpu_memory_utilization is None:
            return cache.resolve_num_blocks(bytes_per_block)
        from vllmlite.engine.memory import gpu_kv_budget  # torch: only on a GPU
        budget = gpu_kv_budget(self.model, cache.gpu_memory_utilization, sched.max_num_batched_tokens,
                               sched.max_num_seqs)
        return max(1, budget // bytes_per_block - 1)   # one block for the CUDA graphs' padding rows

    def summary(self) -> EngineSummary:
        """What the server logs at start-up: the model, its dtype and context, and its memory."""
        return EngineSummary(str(self.model_source), self.config.dtype, self.max_model_len, self.memory_report())

    def memory_report(self) -> dict[str, int]:
        """Bytes held by weights, the device KV cache and the host swap arena; the KV cache's bytes per
        token (all layers, K and V, int8's scales included)."""
        proposer = self.runner.proposer
        return {"weights": self.weights_bytes, "kv_cache": self.runner.kv_cache_bytes,
                "draft_kv_cache": proposer.kv_cache_bytes if proposer is not None else 0,
                "host_swap": self.runner.host_cache_bytes,
                "kv_blocks": self.block_manager.num_blocks, "block_size": self.block_manager.block_size,
                "kv_bytes_per_token": self.kv_bytes_per_token}

    # --- requests -------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | PoolingParams, *,
                    arrival_time: float | None = None, priority: int = 0,
                    cache_salt: str | None = None, client_id: str | None = None, final_only: bool = False) -> None:
        """Validate and queue a request: one that generates (SamplingParams) or an embedding request
        (PoolingParams). Raises ValueError (a client error) before allocating anything.

        `final_only`: the caller reads only the finished output (a response not streamed). Until
        then each step returns the request's OutputProgress (its new tokens, for the metrics), not a
        RequestOutput, and without stop strings its text is decoded once, when it finishes.

        The engine keeps its own validated copy of `params` (as vLLM clones them): fields assigned
        since construction are checked here, and assigning fields later never reaches this request.
        """
        if self.output_processor.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        try:
            new = self.input_processor.process(request_id, prompt, params, arrival_time=arrival_time,
                                               priority=priority, cache_salt=cache_salt, client_id=client_id)
            self._register(new, final_only)
        except BaseException:
            self.abort_request(request_id)  # whatever part of it was registered before the failure
            raise

    def _register(self, new: NewRequest, final_only: bool) -> None:
        """Hand a processed request to the output processor and the tracer, then to the scheduler
        (a constrained one to the input processor first, until its grammar has compiled)."""
        if new.is_pooling:
            self.output_processor.add_embedding_request(new.request_id, new.prompt_text, new.samples[0])
        else:
            self.output_processor.add_request(new.request_id, new.prompt_text, new.params, new.samples, final_only)
        self.tracer.arrived(new.request_id, new.samples, new.prompt_text)
        if new.needs_grammar:
            self.input_processor.compile_grammar(new)
        else:
            self.scheduler.add_request(new.samples[0], new.samples[1:])

    @property
    def request_limits(self) -> RequestLimits:
        """What `check_request` checks against: a small picklable value (an ingress in front of
        replicas checks requests with it, without a model of its own)."""
        bm = self.block_manager
        return RequestLimits(self.model_config.vocab_size, self.max_model_len,
                             self.config.scheduler.max_num_seqs, bm.num_blocks, bm.block_size,
                             bm.sliding_window, self.config.scheduler.max_num_batched_tokens)

    def check_request(self, token_ids: list[int], params: SamplingParams | PoolingParams) -> int:
        """`RequestLimits.check`: the prompt against the vocabulary, context length and KV cache; the
        resolved max_tokens. Pure, so the HTTP thread may call it to answer 400 before queueing."""
        return self.request_limits.check(token_ids, params)

    def check_grammar(self, structured_outputs: StructuredOutputsParams) -> None:
        """ValueError (the client's) unless the constraint compiles against this vocabulary and takes
        its first tokens within llguidance's limits: a 400 before queueing instead of a failure once
        it runs. Thread-safe (the grammar compiler's cache and thread), so the HTTP side may call it."""
        self.input_processor.check_grammar(structured_outputs)

    def abort_request(self, request_id: str, why: str = "aborted by the caller") -> None:
        """Stop a request (all its samples) and free its blocks; unknown ids are ignored. `why` goes
        into its trace ("client disconnected", "timeout", ...)."""
        samples = self.output_processor.abort_request(request_id)
        self.input_processor.abort(request_id)
        self.scheduler.abort_requests([r.request_id for r in samples])
        self.tracer.aborted(request_id, why)
        self._forget_finished(samples)

    def has_unfinished_requests(self) -> bool:
        """Whether step() has work: a request unfinished, or a step still running ahead (async
        scheduling), its requests perhaps finished since."""
        return self.output_processor.num_unfinished_requests > 0 or self._in_flight is not None

    @property
    def num_unfinished_requests(self) -> int:
        return self.output_processor.num_unfinished_requests

    def get_stats(self) -> EngineStats:
        """A snapshot of the engine's numbers; what other modules read instead of its parts. A request
        whose grammar is still compiling counts as waiting."""
        proposer = self.runner.proposer
        scheduler_stats = self.scheduler.make_stats()
        scheduler_stats.num_waiting += self.input_processor.num_compiling
        return EngineStats(scheduler_stats, self.output_processor.num_unfinished_requests,
                           self.runner.num_forward_passes,
                           proposer.num_forward_passes if proposer is not None else 0)

    def debug_snapshot(self) -> EngineDebugSnapshot:
        """Stats, each block's state, recent steps, latency and the effective config: O(num_blocks),
        for debugging pages, not for every step. Call it on the engine's thread."""
        return EngineDebugSnapshot(self.get_stats(), self.block_manager.block_states(),
                                   tuple(self.tracer.recent_steps()), self.tracer.latency(), self.effective_config())

    def effective_config(self) -> dict[str, Any]:
        """The knobs in effect, resolved (block count, context length, kernels), as plain JSON values.
        Model paths are left out: the caller names the model."""
        config = self.config
        values: dict[str, Any] = {**asdict(config.scheduler), **asdict(config.cache), **asdict(config.trace)}
        spec = asdict(config.speculative) if config.speculative is not None else None
        if spec is not None:
            spec.pop("model")
        values.update(max_model_len=self.max_model_len, num_blocks=self.block_manager.num_blocks,
                      num_host_blocks=self.block_manager.num_host_blocks, dtype=config.dtype, seed=config.seed,
                      kernels=config.kernel_backend, quantization=config.weight_quantization,
                      int_dot=config.int_dot, pooling=config.pooling, speculative=spec)
        return values

    def kv_occupancy(self) -> KVOccupancy:
        """How full the KV blocks are (for benchmarks; it walks every block table)."""
        return self.scheduler.kv_occupancy()

    # --- step -----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput | EmbeddingRequestOutput | OutputProgress]:
        """Run one scheduling step and forward pass; return an output for every request that changed
        (an unfinished final-only request's is its OutputProgress).

        A fault in one request's part of a stage (scheduling it, running it, applying its result,
        detokenizing it) ends that request in error and no other. Whatever else raises is a fault
        of the engine itself: it propagates."""
        failed = self._start_compiled_requests()
        started = time.perf_counter()  # the step's time, as the chunking model and the tracer count it
        current = self._in_flight
        if current is None:
            scheduled = self.scheduler.schedule()
            current = self._launch(scheduled)
            if current is None:   # run and waited for, as every step is without async scheduling
                touched = failed + self.scheduler.update(scheduled, self._execute(scheduled))
                return self._step_done(started, scheduled, touched)
        # Async scheduling: the next step is queued behind this one before its tokens are back.
        self._in_flight = self._launch_ahead(current)
        result = current.step.result()
        ahead = self._in_flight.scheduled if self._in_flight is not None else None
        touched = failed + self.scheduler.update(current.scheduled, result, ahead)
        return self._step_done(started, current.scheduled, touched)

    def _step_done(self, started: float, scheduled: SchedulerOutput, touched: list[Request]):
        outputs = self._process_outputs(touched)
        self.chunking.observe(scheduled, time.perf_counter() - started)
        self.tracer.step_done(started, scheduled)
        return outputs

    def _launch(self, scheduled: SchedulerOutput) -> InFlight | None:
        """Async scheduling: `scheduled` queued on the device, not waited for; None if async
        scheduling is off or the runner cannot queue it (the caller executes it)."""
        if not self.config.scheduler.async_scheduling or not self.runner.can_launch(scheduled):
            return None
        self.runner.copy_blocks(scheduled)
        try:
            return InFlight(scheduled, self.runner.launch(scheduled))
        except Exception:   # _execute runs it again, and alone each sequence that still fails
            logger.exception("queueing a decode step failed; running it in the foreground")
            return None

    def _launch_ahead(self, current: InFlight) -> InFlight | None:
        """The step after `current`, scheduled and queued behind it (scheduler.schedule_ahead), or
        None: the next step() schedules as usual once current's tokens are applied."""
        ahead = self.scheduler.schedule_ahead(current.scheduled)
        if ahead is None or not self.runner.can_launch(ahead):
            return None
        self.runner.copy_blocks(ahead)
        try:
            return InFlight(ahead, self.runner.launch(ahead, after=current.step))
        except Exception:   # current's update trims the slots taken for it; the next step retries
            logger.exception("queueing a decode step ahead failed; scheduling it after the step before")
            return None

    def _start_compiled_requests(self) -> list[Request]:
        """Queue the requests whose grammar has compiled; return the samples of those whose grammar
        failed (finished in error), for their outputs."""
        compiled = self.input_processor.pop_compiled(idle=not self.scheduler.has_unfinished_requests())
        for request in compiled.failed:
            self.tracer.finished(request)
        for first, *forks in compiled.ready:
            self.scheduler.add_request(first, forks)
        return compiled.failed

    def _process_outputs(self, touched: list[Request]) -> list[RequestOutput | EmbeddingRequestOutput | OutputProgress]:
        """Detokenize what this step changed, end the requests a stop string (or a detokenizer fault)
        ends, and make the outputs."""
        for finish in self.output_processor.detokenize(touched):
            if isinstance(finish, StopStringHit):
                self.scheduler.finish(finish.request, FinishReason.STOP, finish.stop_str)
            else:
                self.scheduler.finish(finish.request, FinishReason.ERROR, error=finish.error)
        self._forget_finished(touched)
        return self.output_processor.make_outputs()

    def _execute(self, scheduled: SchedulerOutput) -> RunnerOutput:
        """Run the batch; if it raises, run each sequence alone so only the failing ones end in error.

        Each rerun rewrites its K/V into the same slots and starts from the generator states the
        batch started from, so a request that succeeds alone gets exactly the tokens it would have
        got. The block copies run once, before the batch, and are not retried: if they fail, K/V
        is in an unknown state, a fault of the engine.
        """
        self.runner.copy_blocks(scheduled)
        states = _generator_states(scheduled)
        try:
            return self.runner.execute(scheduled)
        except Exception as error:
            if len(scheduled.scheduled) == 1:
                return self._failed_alone(scheduled.scheduled[0], error)
        result = RunnerOutput()
        for seq in scheduled.scheduled:
            _restore_generators(seq, states)
            try:
                part = self.runner.execute(SchedulerOutput(scheduled=[seq]))
            except Exception as error:
                part = self._failed_alone(seq, error)
            result.merge(part)
        return result

    def _failed_alone(self, seq: ScheduledSequence, error: Exception) -> RunnerOutput:
        """`seq` fails even alone: its requests end in error, unless the model also fails a forward
        pass that holds no request at all. Then the fault is not the request's: it is raised."""
        if not self.runner.is_model_healthy():
            raise RuntimeError("the model fails even without any request (a request-free canary "
                               "forward pass failed too)") from error
        logger.error("request %s failed inside the engine", seq.request.request_id, exc_info=error)
        message = internal_error(error)
        return RunnerOutput(errors={r.request_id: message for r in [seq.request, *seq.samplers]})

    def _forget_finished(self, requests: list[Request]) -> None:
        """The proposer drops what it kept for requests that are finished (or aborted)."""
        proposer = self.runner.proposer
        if proposer is not None:
            for request in requests:
                if request.is_finished:
                    proposer.forget(request.request_id)


@dataclass
class InFlight:
    """A step queued on the device whose tokens are not yet applied (async scheduling)."""
    scheduled: SchedulerOutput
    step: PendingStep


def _generator_states(scheduled: SchedulerOutput) -> dict[str, dict]:
    """Each sampling request's generator state before the step (greedy requests draw nothing)."""
    return {r.request_id: r.generator.bit_generator.state for seq in scheduled.scheduled
            for r in seq.samplers if not r.sampling_params.is_greedy}


def _restore_generators(seq: ScheduledSequence, states: dict[str, dict]) -> None:
    for request in seq.samplers:
        if request.request_id in states:
            request.generator.bit_generator.state = states[request.request_id]
