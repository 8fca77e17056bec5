"""Who runs this step: running requests first (oldest first), then waiting ones, under a token budget.

No prefill or decode phases: each request computes `num_tokens - num_computed_tokens` tokens,
capped by the budget (that is chunked prefill). Under memory pressure the newest running request
is preempted, so the oldest always progresses. Embedding requests are prompts that never sample:
they finish (STOP) on the step that computes their last prompt token, holding the pooled hidden
state the runner handed back. Owns request lifecycles; never touches tensors.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from vllmlite.config import SchedulerConfig
from vllmlite.core.batch import RunnerOutput, ScheduledSequence, SchedulerOutput
from vllmlite.core.block_manager import BlockManager, PrefixHit
from vllmlite.core.chunking import ChunkingPolicy, PrefillShare, StepLoad
from vllmlite.core.request import FinishReason, Request, RequestStatus, internal_error
from vllmlite.core.request_queue import WaitingQueue
from vllmlite.core.scheduler_stats import SpecDecodeCounts, kv_occupancy, scheduler_stats
from vllmlite.core.stop import append_tokens
from vllmlite.core.tracing import Tracer
from vllmlite.pooling_params import PoolingType
from vllmlite.stats import KVOccupancy, SchedulerStats

logger = logging.getLogger(__name__)
T = TypeVar("T")


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int,
                 preemption_mode: str, stop_token_ids: frozenset[int], num_speculative_tokens: int = 0,
                 tracer: Tracer | None = None, chunking: ChunkingPolicy | None = None,
                 num_lookahead_slots: int = 0) -> None:
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.preemption_mode = preemption_mode
        self.stop_token_ids = stop_token_ids      # the model's EOS and end-of-turn tokens
        self.waiting = WaitingQueue()
        self.running: list[Request] = []          # admission order: oldest first
        self.swapped: list[Request] = []          # oldest first
        self.requests: dict[str, Request] = {}
        self.forks: dict[str, list[Request]] = {}  # parent id -> samples waiting for its prompt
        self.num_preemptions = 0
        self._static_batch_open = False  # batching="static": the current batch still takes requests
        self.num_speculative_tokens = num_speculative_tokens
        self.spec_counts = SpecDecodeCounts(num_speculative_tokens)
        # Multi-step decoding: slots after each decode for the runner's extra passes (those it does
        # not fill are returned); unlike guesses, this step's pass computes none of them.
        self.num_lookahead_slots = num_lookahead_slots
        self.tracer = tracer or Tracer()  # told of each lifecycle event; the default records nothing
        self.chunking = chunking or ChunkingPolicy(config, block_manager.block_size)
        self._prefill = PrefillShare(0, 0)  # this step's prompt tokens (chunking.py)

    # --- lifecycle ------------------------------------------------------------------------------

    def add_request(self, request: Request, forks: Iterable[Request] = ()) -> None:
        """Queue a request; `forks` are its extra samples (n > 1), born when its prompt is computed."""
        self.requests[request.request_id] = request
        forks = list(forks)
        for fork in forks:
            fork.status = RequestStatus.FORK_PENDING
            self.requests[fork.request_id] = fork
        if forks:
            self.forks[request.request_id] = forks
        self.waiting.add(request)
        self.tracer.queued(request, len(self.waiting))

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        """Finish the given requests (and pending forks of a parent) as aborted; return them."""
        aborted = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None and not request.is_finished:
                self.finish(request, FinishReason.ABORT)
                aborted.append(request)
        return aborted

    def finish(self, request: Request, reason: FinishReason, stop_reason=None, error=None,
               is_client_error: bool = False) -> None:
        """End a request wherever it is and free its blocks. Forks not yet born (the parent's prompt is
        still being computed) share its fate; born forks are independent requests."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.SWAPPED:
            self.swapped.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        request.finish(reason, stop_reason, error, is_client_error)
        self.tracer.finished(request)
        self.block_manager.free(request.request_id)
        self.requests.pop(request.request_id, None)
        for fork in self.forks.pop(request.request_id, []):
            fork.finish(reason, stop_reason, error, is_client_error)
            self.tracer.finished(fork)
            self.requests.pop(fork.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def kv_occupancy(self) -> KVOccupancy:
        return kv_occupancy(self.running, self.block_manager)

    def make_stats(self) -> SchedulerStats:
        """A snapshot of the request queues, the device blocks and the cumulative counts."""
        return scheduler_stats(self)

    # --- schedule -------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self._prefill = self.chunking.prefill_share(self._step_load() if self.chunking.is_adaptive else None)
        budget = self._schedule_running(out, budget)
        if out.num_preempted == 0:
            budget = self._schedule_swapped(out, budget)
        if out.num_preempted == 0 and not self.swapped and self._may_admit():
            self._schedule_waiting(out, budget)
            if self.config.batching == "static" and (len(self.running) >= self.config.max_num_seqs
                                                     or not len(self.waiting)):
                self._static_batch_open = False
        out.blocks_to_copy = self.block_manager.take_copies()
        return out

    def _step_load(self) -> StepLoad:
        """The decodes this step will run and the prompts in line behind them (adaptive chunking's input)."""
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prompt = next((r for r in self.running if r.num_tokens - r.num_computed_tokens > 1), self.waiting.peek())
        threshold = self.chunking.long_prompt_threshold  # None: no prompt is short or long
        short = sum(r.num_tokens for r in self.waiting if r.num_tokens <= threshold) if threshold is not None else 0
        num_left = prompt.num_tokens - prompt.num_computed_tokens if prompt is not None else 0
        return StepLoad(num_decode_rows=len(decodes) * (1 + self.num_speculative_tokens),
                        decode_attention_pairs=sum(r.num_tokens for r in decodes),
                        prefill_start=prompt.num_computed_tokens if prompt is not None else 0,
                        prompt_tokens_left=num_left,
                        short_prompt_tokens=short,
                        num_free_blocks=self.block_manager.num_free_blocks,
                        prompt_blocks_left=self.block_manager.window.peak_blocks(num_left, self.config.max_num_batched_tokens))

    def _may_admit(self) -> bool:
        """Continuous batching admits whenever there is room. Static batching (a benchmark baseline)
        forms a batch when the machine is empty, admitting over as many steps as the token budget
        needs, until it holds max_num_seqs requests or the queue is empty; then no one joins it."""
        if self.config.batching == "continuous":
            return True
        if not self.running:
            self._static_batch_open = True
        return self._static_batch_open

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_scheduled = self._guarded(out, request, self._schedule_running_one, out, request, index, budget)
            if num_scheduled is not None:  # 0: a prompt held back by the prefill share
                budget -= num_scheduled
                index += 1
        return budget

    def _schedule_running_one(self, out: SchedulerOutput, request: Request, index: int, budget: int) -> int | None:
        """Grow `request` (running[index]) by its next tokens, preempting the newest if needed; the
        tokens scheduled, or None if it left the running list (preempted, or finished for lack of room)."""
        num_new = self._prefill.chunk(request.num_tokens - request.num_computed_tokens, budget)
        if num_new == 0:
            return 0
        num_drafts = self._num_draft_slots(request, budget)
        if num_drafts and not self._allocate(request, num_new + num_drafts):
            num_drafts = 0  # under memory pressure, guesses go before any request is preempted
        while not num_drafts and not self._allocate(request, num_new):   # (with drafts: allocated above)
            victim = self.running[-1]
            if victim is request and index == 0:
                # Alone and still no room: the cache is too small for this sequence to grow.
                self.finish(request, FinishReason.LENGTH)
                out.finished.append(request)
                return None
            self._preempt(victim, out)
            if victim is request:
                return None
        self._add_scheduled(out, request, num_new, num_drafts)
        return num_new + (num_drafts if self.num_speculative_tokens else 0)

    def _num_draft_slots(self, request: Request, budget: int) -> int:
        """Slots after a decoding request's token for guesses or multi-step passes: k, capped so the
        round can never pass the budget (guesses), max_tokens or the context (it emits up to k + 1)."""
        k = self.num_speculative_tokens or self.num_lookahead_slots
        if not k or request.num_computed_tokens != request.num_tokens - 1 or request.is_pooling:
            return 0
        if request.request_id in self.forks:
            return 0  # its last prompt token also births the forks: no guesses on that step
        cap = budget - 1 if self.num_speculative_tokens else k  # guesses are computed by this step's pass
        return max(0, min(k, cap,
                          request.max_tokens - request.num_output_tokens - 1,
                          self.max_model_len - request.num_tokens - 1))

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        bm = self.block_manager
        while self.swapped and budget > 0 and self._has_seats_for(self.swapped[0]):
            request = self.swapped[0]
            num_new = self._prefill.chunk(request.num_tokens - request.num_computed_tokens, budget)
            needed = bm.window.num_blocks_held(request.num_computed_tokens, request.num_computed_tokens + num_new)
            if not num_new or not bm.can_swap_in(request.request_id) or bm.num_free_blocks < needed:
                break
            if self._guarded(out, request, self._swap_in, out, request, num_new) is not None:
                budget -= num_new
        return budget

    def _swap_in(self, out: SchedulerOutput, request: Request, num_new: int) -> int:
        out.blocks_to_swap_in.extend(self.block_manager.swap_in(request.request_id))
        if not self._allocate(request, num_new):  # cannot fail: checked above
            raise AssertionError("allocation after swap-in failed")
        self.swapped.pop(0)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self.tracer.swapped_in(request)
        self._add_scheduled(out, request, num_new)
        return num_new

    def _has_seats_for(self, request: Request) -> bool:
        """Whether `request` and its unborn forks fit beside the running sequences (counted with
        their own unborn forks) within max_num_seqs."""
        def seats(r: Request) -> int:
            return 1 + len(self.forks.get(r.request_id, ()))
        return sum(map(seats, self.running)) + seats(request) <= self.config.max_num_seqs

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while budget > 0:
            request = self._next_waiting()
            if request is None:
                return
            if not self._has_seats_for(request):
                return  # the engine refuses a group larger than max_num_seqs, so this one fits later
            bm = self.block_manager
            error = bm.window.why_never_fits(request.num_tokens, self.config.max_num_batched_tokens, bm.num_blocks)
            if error is not None:
                self.finish(request, FinishReason.ERROR, error=error, is_client_error=True)
                out.finished.append(request)
                continue
            num_scheduled = self._guarded(out, request, self._admit, out, request, budget)
            if num_scheduled == 0:
                return  # no room for the head of the queue: nobody behind it jumps ahead
            budget -= num_scheduled or 0

    def _next_waiting(self) -> Request | None:
        """The head of the waiting queue; but while a long prompt is being prefilled, a long head
        waits and the first short prompt behind it goes (adaptive chunking only: `is_long`)."""
        head = self.waiting.peek()
        if head is None or not self._prefill.is_long(head.num_tokens - head.num_computed_tokens):
            return head
        if not any(self._prefill.is_long(r.num_tokens - r.num_computed_tokens) for r in self.running):
            return head
        return next((r for r in self.waiting if not self._prefill.is_long(r.num_tokens - r.num_computed_tokens)),
                    None)

    def _admit(self, out: SchedulerOutput, request: Request, budget: int) -> int:
        """Move the head of the waiting queue to running with its first chunk; the tokens scheduled
        (0 if there is no room for them)."""
        bm = self.block_manager
        hit = self._prefix_hit(request)
        num_new = self._prefill.chunk(request.num_tokens - hit.num_tokens, budget)
        if num_new == 0:
            return 0
        try:
            if not bm.allocate(request.request_id, hit.num_tokens, hit.num_tokens + num_new, hit):
                return 0
        except MemoryError:
            bm.free(request.request_id)  # whatever it took before failing
            return 0
        bm.record_prefix_lookup(request.num_tokens, hit)
        if request.num_preemptions == 0:
            request.num_cached_tokens = hit.num_tokens
        request.num_computed_tokens = hit.num_tokens
        self.waiting.pop(request)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self.tracer.admitted(request, hit.num_tokens)
        self._add_scheduled(out, request, num_new)
        return num_new

    def _prefix_hit(self, request: Request) -> PrefixHit:
        if request.sampling_params.prompt_logprobs is not None or request.pooling is PoolingType.MEAN:
            return PrefixHit([], 0)  # prompt logprobs and mean pooling need every prompt position computed
        return self.block_manager.find_prefix_hit(request.token_ids, request.extra_keys)

    def _allocate(self, request: Request, num_new: int, start: int | None = None) -> bool:
        """Room for `num_new` more tokens (after `start` computed ones; default: the request's
        count); an allocation that raises MemoryError is no room (the caller preempts), never a
        crash. Blocks it took before failing stay in the request's table and count toward its next try."""
        start = request.num_computed_tokens if start is None else start
        try:
            return self.block_manager.allocate(request.request_id, start, start + num_new)
        except MemoryError:
            logger.warning("allocation for %s raised MemoryError: treated as no free blocks", request.request_id)
            return False

    def _guarded(self, out: SchedulerOutput, request: Request, action: Callable[..., T], *args) -> T | None:
        """`action(*args)` for one request; if it raises, that request alone ends in error (its
        blocks freed, reported in `out.finished`) and None is returned."""
        try:
            return action(*args)
        except Exception as error:
            logger.exception("request %s failed while being scheduled", request.request_id)
            self.finish(request, FinishReason.ERROR, error=internal_error(error))
            out.finished.append(request)
            return None

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Take the newest running request off the machine: swap its KV out, or drop it to recompute."""
        bm = self.block_manager
        self.running.remove(request)
        request.num_preemptions += 1
        self.num_preemptions += 1
        out.num_preempted += 1
        if self.preemption_mode == "swap" and bm.can_swap_out(request.request_id):
            out.blocks_to_swap_out.extend(bm.swap_out(request.request_id))
            request.status = RequestStatus.SWAPPED
            self.swapped.insert(0, request)
            self.tracer.preempted(request, "swap")
            return
        bm.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.push_front(request)
        self.tracer.preempted(request, "recompute")

    def _add_scheduled(self, out: SchedulerOutput, request: Request, num_new: int, num_drafts: int = 0) -> None:
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        start, num_tokens = request.num_computed_tokens, request.num_tokens
        self._prefill.spend(num_new, num_tokens - start)
        self.tracer.scheduled(request, start, num_new)
        samples = start + num_new == num_tokens
        # An embedding request never samples.
        samplers = [request, *self.forks.get(request.request_id, ())] if samples and not request.is_pooling else []
        pooling = request.pooling if request.pooling is PoolingType.MEAN or samples else None
        # Positional, in field order (request, token_ids, start_position, block_table, num_draft_slots,
        # samplers, pooling): this runs for every sequence every step, and keywords double the call.
        block_table = self.block_manager.block_table(request.request_id)  # already a copy
        out.scheduled.append(ScheduledSequence(request, request.token_ids[start:start + num_new], start, block_table,
                                               num_drafts, samplers, pooling))

    # --- update ---------------------------------------------------------------------------------

    def update(self, out: SchedulerOutput, result: RunnerOutput, ahead: SchedulerOutput | None = None) -> list[Request]:
        """Apply a step's results: advance computed counts, publish full blocks, append sampled tokens,
        apply stop conditions. Returns every request that produced a token or finished. A sequence
        whose update raises ends in error with its samples; the others are unaffected. `ahead`: the
        step after this one, already running (schedule_ahead's), whose slots stay allocated."""
        touched: list[Request] = list(out.finished)
        keep = {s.request.request_id: s.seq_len + s.num_draft_slots for s in ahead.scheduled} if ahead else {}
        for seq in out.scheduled:
            if seq.request.is_finished:
                continue
            try:
                self._update_one(seq, result, touched, keep.get(seq.request.request_id, 0))
            except Exception as error:
                logger.exception("request %s failed while its step was applied", seq.request.request_id)
                for request in (seq.request, *seq.samplers[1:]):
                    if not request.is_finished:
                        self.finish(request, FinishReason.ERROR, error=internal_error(error))
                    if request not in touched:
                        touched.append(request)
        return touched

    def _update_one(self, seq: ScheduledSequence, result: RunnerOutput, touched: list[Request], keep: int) -> None:
        request = seq.request
        error = result.errors.get(request.request_id)
        if error is not None:
            self.finish(request, FinishReason.ERROR, error=error)
            touched.append(request)
            touched.extend(seq.samplers[1:])  # pending forks share the parent's fate
            return
        if seq.num_draft_slots or keep:
            self._apply_speculative(seq, result, keep)
            touched.append(request)
            return
        request.num_computed_tokens += len(seq.token_ids)
        if result.prompt_logprobs:
            request.prompt_logprobs.extend(result.prompt_logprobs.get(request.request_id, ()))
        self._computed_advanced(request)
        if seq.pooling is not None:
            self._apply_pooled(seq, result)
            if request.is_finished:
                touched.append(request)
            return
        # Every fork is born before any sample's token can finish the parent (and free its blocks).
        for fork in seq.samplers[1:]:
            self._birth_fork(request, fork)
        for sampler in seq.samplers:
            self._append_tokens(sampler, result.sampled_token_ids.get(sampler.request_id, ()),
                                result.logprobs.get(sampler.request_id))
            touched.append(sampler)

    def _apply_speculative(self, seq: ScheduledSequence, result: RunnerOutput, keep: int = 0) -> None:
        """A verified round: the last token and the accepted guesses now have KV; the tokens emitted
        are the accepted guesses plus one. Slots of rejected or unproposed guesses are returned,
        except the first `keep` slots (a step running ahead writes them)."""
        request = seq.request
        num_accepted = result.num_accepted.get(request.request_id, 0)
        self.spec_counts.record(request, result.num_drafts.get(request.request_id, 0), num_accepted)
        request.num_computed_tokens += len(seq.token_ids) + num_accepted
        self._append_tokens(request, result.sampled_token_ids.get(request.request_id, ()),
                            result.logprobs.get(request.request_id))
        if not request.is_finished:  # a stop mid-round already freed everything
            self.block_manager.trim(request.request_id, max(request.num_computed_tokens, keep))
            self._computed_advanced(request)

    def _computed_advanced(self, request: Request) -> None:
        """Publish the blocks just filled, then release those out of the sliding window (still cached)."""
        bm, request_id, num_computed = self.block_manager, request.request_id, request.num_computed_tokens
        bm.publish_full_blocks(request_id, request.token_ids, num_computed, request.extra_keys)
        bm.remove_skipped_blocks(request_id, num_computed)

    def _apply_pooled(self, seq: ScheduledSequence, result: RunnerOutput) -> None:
        """Hand an embedding request its pooled rows; it finishes once its whole prompt is computed.
        A chunk starting at position 0 starts a mean's sum afresh (after a recompute preemption too)."""
        request = seq.request
        request.add_pooled(result.pooled[request.request_id],
                           restart=seq.pooling is PoolingType.LAST or seq.start_position == 0)
        if request.num_computed_tokens == request.num_tokens:
            self.finish(request, FinishReason.STOP)

    def _birth_fork(self, parent: Request, fork: Request) -> None:
        """An extra sample starts life sharing every block of its parent's computed prompt."""
        self.forks.pop(parent.request_id, None)
        self.block_manager.fork(parent.request_id, fork.request_id)
        fork.num_computed_tokens = parent.num_computed_tokens
        fork.num_cached_tokens = parent.num_cached_tokens
        fork.status = RequestStatus.RUNNING
        self.running.append(fork)

    def _append_tokens(self, request: Request, token_ids: Sequence[int], logprobs: list | None) -> None:
        stop = append_tokens(request, token_ids, logprobs, self.stop_token_ids, self.max_model_len)
        if stop is not None:
            self.finish(request, *stop)
