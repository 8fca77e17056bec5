"""Async scheduling's scheduler (vLLM's AsyncScheduler): the step after one still running on the
device, scheduled before that step's tokens are known. It knows nothing of the device: the runner
reads the running step's tokens there (worker/cuda_graphs.py `launch_steps`)."""

from __future__ import annotations

from vllmlite.core.batch import ScheduledSequence, SchedulerOutput
from vllmlite.core.request import Request
from vllmlite.core.scheduler import Scheduler


class AsyncScheduler(Scheduler):
    """The scheduler, and `schedule_ahead` for the engine's async scheduling (LLMEngine.step)."""

    def schedule_ahead(self, current: SchedulerOutput) -> SchedulerOutput | None:
        """Async scheduling: the step after `current`, a step of greedy decodes still running,
        scheduled before its tokens are known. Each sequence is taken to run on through all of
        current's passes; one that max_tokens or the context ends there is left out, and one that
        a stop token or string ends there is dropped when its update comes (its passes here are
        wasted). Each sequence's token is a placeholder (-1): the runner takes it from current's
        tokens on the device. None (the caller waits for current and schedules as usual) unless
        current holds every running request and nothing else wants the step: nothing swapped out, no
        request waiting that could start (requests wait while every seat is taken, and no seat is
        known to come free in current), and room for every sequence's slots without preempting anyone."""
        if self.swapped or len(current.scheduled) != len(self.running):
            return None
        live = [(seq, 1 + seq.num_draft_slots) for seq in current.scheduled if not seq.request.is_finished]
        going = [(seq, emitted) for seq, emitted in live if not self._ends_by_length(seq.request, emitted)]
        if self.waiting and (len(going) < len(live) or self._has_seats_for(self.waiting.peek())):
            return None   # a seat is free, or comes free in current: the head of the queue starts next
        out = SchedulerOutput()
        for seq, emitted in going:
            request = seq.request
            # The request once current's passes are applied: its k + 1 tokens out, k + 1 more computed.
            num_outputs, num_tokens = request.num_output_tokens + emitted, request.num_tokens + emitted
            start = seq.seq_len + seq.num_draft_slots
            k = max(0, min(self.num_lookahead_slots, request.max_tokens - num_outputs - 1,
                           self.max_model_len - num_tokens - 1))
            if not self._allocate(request, 1 + k, start):
                return None   # the slots taken so far go back when current's update trims
            self.tracer.scheduled(request, start, 1)
            out.scheduled.append(ScheduledSequence(request, [-1], start, self.block_manager.block_table(request.request_id),
                                                   k, [request]))
        out.blocks_to_copy = self.block_manager.take_copies()
        return out if out.scheduled else None

    def _ends_by_length(self, request: Request, emitted: int) -> bool:
        """Whether `emitted` more tokens reach the request's max_tokens or the context."""
        return (request.num_output_tokens + emitted >= request.max_tokens
                or request.num_tokens + emitted >= self.max_model_len)
