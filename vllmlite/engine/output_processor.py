"""Output processing: from requests that changed in a step to the RequestOutputs handed back.

Owns the n/best_of groups (one user request, its samples), incremental detokenization, stop strings
and the RequestOutput/CompletionOutput of each group, logprobs included; and the one
EmbeddingRequestOutput of each finished embedding request. A final-only group (its caller reads the
finished output alone: a response not streamed) gets a small OutputProgress from each step before
that, and, without stop strings, its text decoded once, when it finishes. It does not finish requests:
a stop string found in the text (or a detokenization that raised) is handed back, and the engine core
finishes the request through the scheduler.
Knows nothing of the scheduler, the runner or blocks.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

from vllmlite.core.request import FinishReason, Request, internal_error
from vllmlite.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    OutputProgress,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from vllmlite.pooling_params import finish_embedding
from vllmlite.sampling_params import SamplingParams
from vllmlite.tokenizer import Tokenizer
from vllmlite.tokenizer.detokenizer import IncrementalDetokenizer
from vllmlite.worker.sampling import TokenLogprobs

logger = logging.getLogger(__name__)


class StopStringHit(NamedTuple):
    """A running request whose text completed a stop string: the engine finishes it (STOP)."""

    request: Request
    stop_str: str


class OutputFailure(NamedTuple):
    """A request whose output processing raised: the engine finishes it (ERROR); its group goes on."""

    request: Request
    error: str


@dataclass
class _Sample:
    request: Request
    detokenizer: IncrementalDetokenizer | None   # None: detokenize=False, token ids only
    deferred: bool = False       # decode the text once, when the request finishes (final-only, no stop strings)
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
    final_only: bool = False   # its caller reads the finished output alone: OutputProgress before that
    samples: list[_Sample] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs] = field(default_factory=list)  # of prompt tokens 1.., vLLM's shape

    # Its params (the engine's own copy) and its samples are fixed once the group is tracked: what
    # they say is read once.
    @cached_property
    def wants_logprobs(self) -> bool:
        return self.params.logprobs is not None

    @cached_property
    def ranks_samples(self) -> bool:
        return ranks_samples(self.params)

    @cached_property
    def requests(self) -> list[Request]:
        return [s.request for s in self.samples]

    @property
    def finished(self) -> bool:
        return all([r.is_finished for r in self.requests])  # a list: faster for one or a few


def ranks_samples(params: SamplingParams) -> bool:
    """best_of > n: every candidate runs, the n most likely are reported once all are done."""
    return params.best_of is not None and params.best_of > params.n


class OutputProcessor:
    """Per step: `detokenize(touched)` returns the stop strings found, the engine finishes those
    requests, then `make_outputs()` returns one RequestOutput per group that changed (best_of
    groups only once all their candidates are done). A finished group is forgotten."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._groups: dict[str, _Group] = {}
        self._changed: dict[str, _Group] = {}  # groups touched since the last make_outputs()
        self._embeddings: dict[str, tuple[str | None, Request]] = {}  # request id -> (prompt, request)
        self._finished_embeddings: dict[str, None] = {}  # ids finished since the last make_outputs()

    @staticmethod
    def sampling_params_for(params: SamplingParams) -> SamplingParams:
        """The params a group's samples run with: ranking best_of candidates needs each one's
        logprobs, asked for or not (they are not reported then)."""
        if ranks_samples(params) and params.logprobs is None:
            return dataclasses.replace(params, logprobs=0)
        return params

    def add_request(self, request_id: str, prompt: str | None, params: SamplingParams,
                    samples: list[Request], final_only: bool = False) -> None:
        """Track a user request and its samples; `params` are the ones the user gave (cloned).
        `final_only`: see LLMEngine.add_request."""
        group = _Group(request_id, prompt, params, final_only)
        deferred = final_only and not params.stop   # stop strings are looked for in each step's text
        for request in samples:
            detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                                 params.skip_special_tokens, params.stop or (),
                                                 params.include_stop_str_in_output) if params.detokenize else None
            group.samples.append(_Sample(request, detokenizer, deferred))
        self._groups[request_id] = group

    def add_embedding_request(self, request_id: str, prompt: str | None, request: Request) -> None:
        """Track an embedding request: one output, when it finishes."""
        self._embeddings[request_id] = (prompt, request)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._groups or request_id in self._embeddings

    def abort_request(self, request_id: str) -> list[Request]:
        """Forget a group; return its samples (none for an unknown id) for the engine to abort."""
        embedding = self._embeddings.pop(request_id, None)
        self._finished_embeddings.pop(request_id, None)
        if embedding is not None:
            return [embedding[1]]
        group = self._groups.pop(request_id, None)
        self._changed.pop(request_id, None)
        return [s.request for s in group.samples] if group is not None else []

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._groups) + len(self._embeddings)

    # --- per step -------------------------------------------------------------------------------

    def detokenize(self, touched: list[Request]) -> list[StopStringHit | OutputFailure]:
        """Feed each touched request's new tokens to its detokenizer. Returns the running requests
        whose text completed a stop string (tokens sampled after it are already dropped), and those
        whose detokenization raised."""
        hits: list[StopStringHit | OutputFailure] = []
        for request in touched:
            if request.is_pooling:
                if request.is_finished and request.request_id in self._embeddings:
                    self._finished_embeddings[request.request_id] = None
                continue
            group_id = request.parent_id or request.request_id
            group = self._groups.get(group_id)
            if group is None:
                continue
            try:
                hit = self._detokenize(group.samples[request.sample_index])
            except Exception as error:
                logger.exception("request %s failed while its output was detokenized", request.request_id)
                hit = OutputFailure(request, internal_error(error))
            if hit is not None:
                hits.append(hit)
            self._changed[group_id] = group
        return hits

    def make_outputs(self) -> list[RequestOutput | EmbeddingRequestOutput | OutputProgress]:
        """An output for every group touched since the last call (an unfinished final-only group's is
        its OutputProgress); finished groups are dropped."""
        changed, self._changed = self._changed, {}
        outputs = []
        for group_id, group in changed.items():
            is_finished = group.finished
            if is_finished:
                del self._groups[group_id]
            elif group.ranks_samples:
                continue  # best_of reports once, when every candidate is done
            elif group.final_only:
                outputs.append(_progress(group))
                continue
            outputs.append(self._group_output(group, is_finished))
        finished, self._finished_embeddings = self._finished_embeddings, {}
        outputs.extend(self._embedding_output(*self._embeddings.pop(i)) for i in finished)
        return outputs

    @staticmethod
    def _embedding_output(prompt: str | None, request: Request) -> EmbeddingRequestOutput:
        """A finished embedding request's output: its embedding, or an error (it ended some other way)."""
        error = request.error
        embedding: list[float] = []
        if request.finish_reason is FinishReason.STOP:
            embedding = finish_embedding(request.pooled, request.num_prompt_tokens, request.pooling,
                                         request.pooling_params.normalize)
        elif error is None:
            error = f"the request ended ({request.finish_reason.value}) before its prompt was computed"
        metrics = RequestMetrics(request.arrival_time, None, time.monotonic(), request.num_preemptions,
                                 first_scheduled_time=request.first_scheduled_time)
        return EmbeddingRequestOutput(request.request_id, request.prompt_token_ids, EmbeddingOutput(embedding),
                                      True, prompt, request.num_cached_tokens, error, metrics)

    def _detokenize(self, sample: _Sample) -> StopStringHit | None:
        request = sample.request
        if sample.detokenizer is None:
            return None  # token ids only: the text stays "" (stop strings need text, so there are none)
        if sample.deferred and not request.is_finished:
            return None  # all of it in one decode at the end (the detokenizer gives the same text)
        first = sample.num_detokenized
        new_ids = request.output_token_ids[first:]
        sample.num_detokenized = request.num_output_tokens
        if new_ids and self._ends_on_stop_token(request):
            new_ids = new_ids[:-1]  # EOS or a stop token id: kept in token_ids, never in the text
        if sample.deferred:   # finished, and no stop strings (deferred has none)
            sample.detokenizer.finish(new_ids)
            return None
        delta = sample.detokenizer.add_tokens(new_ids) if new_ids else None
        hit = None
        if delta is not None and delta.stop_str is not None:
            # Tokens sampled past the one that completed the stop string are dropped.
            request.truncate_output(first + delta.num_tokens_used)
            sample.num_detokenized = request.num_output_tokens
            if request.is_finished:
                # It already ended this step (length, stop token) and holds no blocks: the stop
                # string that completed first is its reason.
                request.finish(FinishReason.STOP, delta.stop_str)
            else:
                hit = StopStringHit(request, delta.stop_str)
        if request.is_finished and sample.detokenizer.stop_str is None:
            sample.detokenizer.flush()
        return hit

    def _ends_on_stop_token(self, request: Request) -> bool:
        """Whether the request stopped on a stop token id or EOS (not a stop string, nor a grammar
        that completed on an ordinary token)."""
        if not request.is_finished or request.finish_reason is not FinishReason.STOP:
            return False
        return isinstance(request.stop_reason, int) or (
            request.stop_reason is None and request.output_token_ids[-1] in self.tokenizer.stop_token_ids)

    def _group_output(self, group: _Group, finished: bool) -> RequestOutput:
        """The group's RequestOutput; `finished`: every sample is (group.finished, read once)."""
        completions = [self._completion(group, s) for s in group.samples]
        if group.ranks_samples:
            completions.sort(key=lambda c: c.cumulative_logprob, reverse=True)
            completions = completions[:group.params.n]
            for i, c in enumerate(completions):
                c.index = i
        requests = group.requests
        first = requests[0]
        failed = [r for r in requests if r.error]
        metrics = _request_metrics(requests, finished)
        prompt_logprobs = None
        if group.params.prompt_logprobs is not None:
            converted = _sync_logprobs(group.prompt_logprobs, first.prompt_logprobs, self.tokenizer.token_text)
            prompt_logprobs = [None, *converted]  # the first token has no context
        return RequestOutput(group.request_id, group.prompt, first.prompt_token_ids, completions,
                             finished, first.num_cached_tokens, failed[0].error if failed else None, metrics,
                             prompt_logprobs, bool(failed) and failed[0].is_client_error)

    def _completion(self, group: _Group, sample: _Sample) -> CompletionOutput:
        request = sample.request
        output_token_ids = request.output_token_ids
        start, previous_text = sample.num_reported, sample.reported_text
        text = sample.detokenizer.output_text if sample.detokenizer is not None else ""
        sample.num_reported, sample.reported_text = len(output_token_ids), text
        logprobs = cumulative_logprob = delta_logprobs = None
        if group.wants_logprobs:
            logprobs = _sync_logprobs(sample.logprobs, request.logprobs, self.tokenizer.token_text)
            logprobs, delta_logprobs = list(logprobs), logprobs[start:]
        if group.wants_logprobs or group.ranks_samples:
            cumulative_logprob = request.cumulative_logprob
        finish_reason = request.finish_reason.value if request.finish_reason else None
        # Positional, in field order: this runs for every sample every step, and keywords double the call.
        return CompletionOutput(request.sample_index, text, list(output_token_ids), cumulative_logprob, logprobs,
                                finish_reason, request.stop_reason, text[len(previous_text):],
                                output_token_ids[start:], delta_logprobs)


def _progress(group: _Group) -> OutputProgress:
    """An unfinished final-only group's OutputProgress: the tokens its samples gained since the last."""
    num_new = 0
    for sample in group.samples:
        num_tokens = sample.request.num_output_tokens
        num_new += max(num_tokens - sample.num_reported, 0)   # a stop string may have dropped some
        sample.num_reported = num_tokens
    first = group.samples[0].request
    return OutputProgress(group.request_id, first.arrival_time, first.num_prompt_tokens, num_new)


def _request_metrics(requests: list[Request], finished: bool) -> RequestMetrics:
    """A group's metrics: its first sample's times, the speculative counts of all its samples."""
    first = requests[0]
    num_draft_tokens = num_accepted_tokens = 0
    for request in requests:
        num_draft_tokens += request.num_draft_tokens
        num_accepted_tokens += request.num_accepted_tokens
    return RequestMetrics(first.arrival_time, first.first_token_time, time.monotonic() if finished else None,
                          first.num_preemptions, num_draft_tokens, num_accepted_tokens, first.first_scheduled_time)


def coalesce_outputs(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """One output standing for two consecutive outputs of a request that nobody has read yet: `newer`
    (its cumulative fields already hold everything) with each sample's deltas since `older` included.
    A slow reader then holds one output, not one per step (whose cumulative copies grow with each)."""
    before = {c.index: c for c in older.outputs}
    completions = []
    for c in newer.outputs:
        old = before.get(c.index)
        if old is not None:
            c = dataclasses.replace(
                c, delta_text=old.delta_text + c.delta_text, delta_token_ids=old.delta_token_ids + c.delta_token_ids,
                delta_logprobs=None if c.delta_logprobs is None else (old.delta_logprobs or []) + c.delta_logprobs)
        completions.append(c)
    return dataclasses.replace(newer, outputs=completions)


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
