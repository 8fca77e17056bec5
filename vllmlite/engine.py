"""LLMEngine: one step = schedule, one forward pass, update, detokenize.

Owns the scheduler, the runner and the per-request output state (detokenizers, n > 1 groups).
Knows nothing of HTTP or threads.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from vllmlite.batch import RunnerOutput, SchedulerOutput
from vllmlite.block_manager import BlockManager
from vllmlite.config import EngineConfig
from vllmlite.detokenizer import IncrementalDetokenizer
from vllmlite.kernels import get_kernels, resolve_backend
from vllmlite.loader import LoadedModel, load_model
from vllmlite.model import LlamaModel
from vllmlite.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestMetrics, RequestOutput
from vllmlite.request import FinishReason, Request
from vllmlite.runner import ModelRunner
from vllmlite.sampling import TokenLogprobs, make_generator
from vllmlite.sampling_params import SamplingParams
from vllmlite.scheduler import Scheduler
from vllmlite.speculative import make_proposer
from vllmlite.stats import EngineStats
from vllmlite.threads import THREAD_ENV, THREAD_ENV_APPLIED

logger = logging.getLogger(__name__)

Prompt = str | list[int]


@dataclass
class _Sample:
    request: Request
    detokenizer: IncrementalDetokenizer
    num_detokenized: int = 0     # output tokens fed to the detokenizer
    num_reported: int = 0        # output tokens already in a returned CompletionOutput
    reported_text: str = ""      # text already in a returned CompletionOutput
    logprobs: list[PositionLogprobs] = field(default_factory=list)  # request.logprobs in vLLM's shape


@dataclass
class _Group:
    """One user request: its samples (n or best_of of them) and what has been reported so far."""

    request_id: str
    prompt: str | None
    params: SamplingParams
    samples: list[_Sample] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs] = field(default_factory=list)  # of prompt tokens 1.., vLLM's shape

    @property
    def wants_logprobs(self) -> bool:
        return self.params.logprobs is not None

    @property
    def ranks_samples(self) -> bool:
        """best_of > n: every candidate runs, the n most likely are reported once all are done."""
        return self.params.best_of is not None and self.params.best_of > self.params.n

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.samples)


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        loaded = loaded or load_model(config.model, config.dtype, config.seed, config.weight_quantization)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_source = loaded.source
        sched = config.scheduler
        self.max_model_len = min(sched.max_model_len or loaded.config.max_position_embeddings,
                                 loaded.config.max_position_embeddings)
        itemsize = np.dtype(config.dtype).itemsize
        bytes_per_block = loaded.config.kv_bytes_per_token(itemsize) * config.cache.block_size
        num_blocks = config.cache.resolve_num_blocks(bytes_per_block)
        num_host_blocks = config.cache.resolve_num_host_blocks(bytes_per_block)
        stop_ids = self.tokenizer.stop_token_ids
        self.block_manager = BlockManager(num_blocks, config.cache.block_size,
                                          config.cache.enable_prefix_caching, num_host_blocks)
        spec = config.speculative
        self.scheduler = Scheduler(sched, self.block_manager, self.max_model_len,
                                   config.cache.preemption_mode, stop_ids,
                                   spec.num_speculative_tokens if spec else 0)
        kernels = get_kernels(config.kernels)
        model = LlamaModel(loaded.config, loaded.weights, self.max_model_len, kernels)
        proposer = make_proposer(spec, loaded, config, num_blocks, self.max_model_len, kernels) if spec else None
        self.runner = ModelRunner(model, num_blocks, config.cache.block_size, num_host_blocks, stop_ids,
                                  proposer)
        logger.info("kernels: %s, ready in %.1f s (compiled, or loaded from the on-disk cache)",
                    resolve_backend(config.kernels), model.warm_up())
        if not THREAD_ENV_APPLIED:
            logger.warning("numpy was imported before vllmlite, so its BLAS threads spin when idle and take "
                           "the cores the attention kernels need (steps up to 2x slower): import vllmlite "
                           "first, or set %s", " ".join(f"{k}={v}" for k, v in THREAD_ENV.items()))
        self.weights_bytes = loaded.weights.num_bytes
        self._seed_rng = np.random.default_rng(config.seed)
        self._groups: dict[str, _Group] = {}

    def memory_report(self) -> dict[str, int]:
        """Bytes held by weights, the device KV cache and the host swap arena."""
        proposer = self.runner.proposer
        return {"weights": self.weights_bytes, "kv_cache": self.runner.kv_cache_bytes,
                "draft_kv_cache": getattr(proposer, "kv_cache_bytes", 0),
                "host_swap": self.runner.host_cache_bytes,
                "kv_blocks": self.block_manager.num_blocks, "block_size": self.block_manager.block_size}

    # --- requests -------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams, *,
                    arrival_time: float | None = None, priority: int = 0,
                    cache_salt: str | None = None, client_id: str | None = None) -> None:
        """Validate and queue a request. Raises ValueError (a client error) before allocating anything.

        The engine keeps its own validated copy of `params` (as vLLM clones them): fields assigned
        since construction are checked here, and assigning fields later never reaches this request.
        """
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = params.clone()
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        group = _Group(request_id, text, params)
        # Ranking needs each candidate's logprobs, asked for or not (they are not reported then).
        internal = dataclasses.replace(params, logprobs=0) if group.ranks_samples and not group.wants_logprobs \
            else params
        internal.update_from_tokenizer(self.tokenizer)
        max_tokens = self.check_request(token_ids, internal)
        token_ids = _truncated_prompt(token_ids, internal)
        for i in range(params.num_sequences):
            # Sample i of a seeded request is that request alone with seed + i (as vLLM does).
            seed = int(self._seed_rng.integers(2**63)) if params.seed is None else params.seed + i
            generator = make_generator(seed)
            request = Request(
                request_id=request_id if i == 0 else f"{request_id}#{i}",
                prompt_token_ids=token_ids, sampling_params=internal, max_tokens=max_tokens,
                generator=generator, arrival_time=arrival_time or time.monotonic(), priority=priority,
                cache_salt=cache_salt, client_id=client_id,
                parent_id=None if i == 0 else request_id, sample_index=i)
            detokenizer = IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens,
                                                 params.stop or (), params.include_stop_str_in_output)
            group.samples.append(_Sample(request, detokenizer))
        self._groups[request_id] = group
        first, *forks = [s.request for s in group.samples]
        self.scheduler.add_request(first, forks)

    def check_request(self, token_ids: list[int], params: SamplingParams) -> int:
        """Check a prompt against the vocabulary and context length (after `truncate_prompt_tokens`);
        return the resolved max_tokens.

        Pure (changes no state), so the HTTP thread may call it to answer 400 before queueing.
        Raises ValueError with a message fit for the client."""
        if not token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        params.verify(vocab)
        token_ids = _truncated_prompt(token_ids, params)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens but this model's maximum context "
                             f"length is {self.max_model_len} tokens (prompt plus output)")
        if params.max_tokens is None:
            return self.max_model_len - len(token_ids)
        if len(token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the request asks "
                f"for {len(token_ids)} prompt tokens plus {params.max_tokens} output tokens "
                f"({len(token_ids) + params.max_tokens}); reduce the prompt or max_tokens")
        return params.max_tokens

    def abort_request(self, request_id: str) -> None:
        """Stop a request (all its samples) and free its blocks; unknown ids are ignored."""
        group = self._groups.pop(request_id, None)
        if group is not None:
            self.scheduler.abort_requests([s.request.request_id for s in group.samples])
            self._forget(group)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._groups)

    def get_stats(self) -> EngineStats:
        """A snapshot of the engine's numbers; what other modules read instead of its parts."""
        proposer = self.runner.proposer
        return EngineStats(self.scheduler.make_stats(), len(self._groups), self.runner.num_forward_passes,
                           proposer.num_forward_passes if proposer is not None else 0)

    # --- step -----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step and forward pass; return an output for every request that changed."""
        scheduled = self.scheduler.schedule()
        result = self._execute(scheduled)
        touched = self.scheduler.update(scheduled, result)
        return self._make_outputs(touched)

    def _execute(self, scheduled: SchedulerOutput) -> RunnerOutput:
        """Run the batch; if it raises, run each sequence alone so only the failing ones end in error.

        Rewriting a sequence's K/V into the same slots is idempotent, so the retry is safe. A fault
        that is not tied to a request (every sequence fails alone too) still ends only those requests;
        only an exception outside this method marks the engine dead.
        """
        try:
            return self.runner.execute(scheduled)
        except Exception as batch_error:
            if len(scheduled.scheduled) <= 1:
                return self._errors_for(scheduled.scheduled, batch_error)
        result = RunnerOutput()
        for seq in scheduled.scheduled:
            alone = SchedulerOutput(scheduled=[seq])
            try:
                part = self.runner.execute(alone)
            except Exception as error:
                part = self._errors_for([seq], error)
            result.merge(part)
        return result

    @staticmethod
    def _errors_for(seqs: list, error: Exception) -> RunnerOutput:
        logger.exception("request failed inside the engine: %s", error)
        message = f"internal error while running this request: {type(error).__name__}: {error}"
        errors = {r.request_id: message for seq in seqs for r in [seq.request, *seq.samplers]}
        return RunnerOutput(errors=errors)

    def _make_outputs(self, touched: list[Request]) -> list[RequestOutput]:
        changed: dict[str, _Group] = {}
        for request in touched:
            group_id = request.parent_id or request.request_id
            group = self._groups.get(group_id)
            if group is None:
                continue
            self._detokenize(group.samples[request.sample_index])
            changed[group_id] = group
        outputs = []
        for group_id, group in changed.items():
            if group.finished:
                del self._groups[group_id]
                self._forget(group)
            elif group.ranks_samples:
                continue  # best_of reports once, when every candidate is done
            outputs.append(self._group_output(group))
        return outputs

    def _forget(self, group: _Group) -> None:
        if self.runner.proposer is not None:
            for sample in group.samples:
                self.runner.proposer.forget(sample.request.request_id)

    def _detokenize(self, sample: _Sample) -> None:
        request = sample.request
        if not request.sampling_params.detokenize:
            return  # token ids only: the text stays "" (stop strings need text, so there are none)
        first = sample.num_detokenized
        new_ids = request.output_token_ids[first:]
        sample.num_detokenized = request.num_output_tokens
        if request.is_finished and request.finish_reason is FinishReason.STOP and new_ids \
                and not isinstance(request.stop_reason, str):
            new_ids = new_ids[:-1]  # EOS or a stop token id: kept in token_ids, never in the text
        delta = sample.detokenizer.add_tokens(new_ids) if new_ids else None
        if delta is not None and delta.stop_str is not None:
            # Tokens sampled past the one that completed the stop string are dropped.
            request.truncate_output(first + delta.num_tokens_used)
            sample.num_detokenized = request.num_output_tokens
            if not request.is_finished:
                self.scheduler.finish(request, FinishReason.STOP, delta.stop_str)
            else:
                request.finish(FinishReason.STOP, delta.stop_str)
        if request.is_finished and sample.detokenizer.stop_str is None:
            sample.detokenizer.flush()

    def _group_output(self, group: _Group) -> RequestOutput:
        completions = [self._completion(group, s) for s in group.samples]
        if group.ranks_samples:
            completions.sort(key=lambda c: c.cumulative_logprob, reverse=True)
            completions = completions[:group.params.n]
            for i, c in enumerate(completions):
                c.index = i
        first = group.samples[0].request
        errors = [s.request.error for s in group.samples if s.request.error]
        metrics = RequestMetrics(first.arrival_time, first.first_token_time,
                                 time.monotonic() if group.finished else None, first.num_preemptions,
                                 sum(s.request.num_draft_tokens for s in group.samples),
                                 sum(s.request.num_accepted_tokens for s in group.samples))
        prompt_logprobs = None
        if group.params.prompt_logprobs is not None:
            converted = _sync_logprobs(group.prompt_logprobs, first.prompt_logprobs, self.tokenizer.token_text)
            prompt_logprobs = [None, *converted]  # the first token has no context
        return RequestOutput(group.request_id, group.prompt, first.prompt_token_ids, completions,
                             group.finished, first.num_cached_tokens, errors[0] if errors else None, metrics,
                             prompt_logprobs)

    def _completion(self, group: _Group, sample: _Sample) -> CompletionOutput:
        request = sample.request
        start, previous_text = sample.num_reported, sample.reported_text
        text = sample.detokenizer.output_text
        sample.num_reported, sample.reported_text = request.num_output_tokens, text
        logprobs = None
        if group.wants_logprobs:
            logprobs = _sync_logprobs(sample.logprobs, request.logprobs, self.tokenizer.token_text)
        return CompletionOutput(
            index=request.sample_index,
            text=text,
            token_ids=list(request.output_token_ids),
            cumulative_logprob=request.cumulative_logprob if group.wants_logprobs or group.ranks_samples else None,
            logprobs=list(logprobs) if logprobs is not None else None,
            finish_reason=request.finish_reason.value if request.finish_reason else None,
            stop_reason=request.stop_reason,
            delta_text=text[len(previous_text):],
            delta_token_ids=request.output_token_ids[start:],
            delta_logprobs=logprobs[start:] if logprobs is not None else None,
        )


def _sync_logprobs(converted: list[PositionLogprobs], entries: Sequence[TokenLogprobs],
                   token_text: Callable[[int], str]) -> list[PositionLogprobs]:
    """Bring `converted` in line with the internal `entries`, converting each position once.

    Entries only grow, or lose their tail when a stop string drops tokens sampled after it.
    """
    del converted[len(entries):]
    converted.extend(_position_logprobs(entry, token_text) for entry in entries[len(converted):])
    return converted


def _position_logprobs(entry: TokenLogprobs, token_text: Callable[[int], str]) -> PositionLogprobs:
    """vLLM's dict for one position: the top candidates best first (ranks 1..k), then the sampled
    token if it is not among them; the sampled token keeps its own rank (ties share the better one)."""
    logprobs = {token_id: Logprob(logprob, i + 1, token_text(token_id))
                for i, (token_id, logprob) in enumerate(entry.top)}
    # Assigning an existing key keeps its place, so the top candidates stay in order.
    logprobs[entry.token_id] = Logprob(entry.logprob, entry.rank, token_text(entry.token_id))
    return logprobs


def _truncated_prompt(token_ids: list[int], params: SamplingParams) -> list[int]:
    """The last `truncate_prompt_tokens` tokens of the prompt, or all of it if that is None."""
    k = params.truncate_prompt_tokens
    return token_ids if k is None else token_ids[-k:]
