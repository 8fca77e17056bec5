"""Tracing where today's tests do not look: an n > 1 request whose samples finish on different steps,
the latency percentiles against hand-computed values (on a fake clock), and the `swapped` state."""

from __future__ import annotations

import pytest
from conftest import greedy, make_prompts

import vllmlite.core.tracing as tracing
from vllmlite.core.batch import SchedulerOutput
from vllmlite.core.request import FinishReason, Request
from vllmlite.core.tracing import RequestTracer
from vllmlite.sampling_params import SamplingParams
from vllmlite.worker.sampling import make_generator


class FakeClock:
    """Stands in for the `time` module inside tracing.py (and for the requests' token times)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    time = perf_counter = monotonic


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(tracing, "time", fake)
    return fake


def make_sample(request_id: str, parent_id: str | None = None, index: int = 0) -> Request:
    return Request(request_id=request_id, prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(),
                   max_tokens=100, generator=make_generator(0), arrival_time=0.0, parent_id=parent_id,
                   sample_index=index)


def emit(request: Request, num_tokens: int) -> None:
    for _ in range(num_tokens):
        request.append_token(7)


def end_step(tracer: RequestTracer) -> None:
    tracer.step_done(0.0, SchedulerOutput())


def test_an_n_request_closes_when_its_last_sample_finishes_with_every_token_counted(clock):
    """Sample 0 finishes first; the trace stays open (running) until sample 1 finishes, then counts
    both samples' tokens."""
    tracer = RequestTracer(ring_size=10, max_events=64)
    first, second = make_sample("g"), make_sample("g#1", parent_id="g", index=1)
    tracer.arrived("g", [first, second], None)
    tracer.admitted(first, 0)
    emit(first, 3)
    emit(second, 3)
    first.finish(FinishReason.STOP)
    tracer.finished(first)
    end_step(tracer)
    live = tracer.snapshot("g")
    assert live.state == "running" and live.finish_time is None
    clock.now += 5.0
    emit(second, 8)
    second.finish(FinishReason.LENGTH)
    tracer.finished(second)
    end_step(tracer)
    done = tracer.snapshot("g")
    assert done.state == "finished" and done.num_output_tokens == 3 + 3 + 8
    assert done.finish_time == clock.now  # closed at the last finish (the fake's unix offset is 0)
    assert [e.event for e in done.events].count("finished") == 1


def test_tpot_percentiles_match_hand_computed_values(clock):
    """tpot = (finish - first token) / (outputs - 1); p50 and p90 interpolate linearly over them."""
    tracer = RequestTracer(ring_size=10, max_events=64)
    # (output tokens, seconds from first token to finish): tpots 0.1, 0.2, 0.3, 0.4, 0.5 s
    shapes = [(11, 1.0), (6, 1.0), (3, 0.6), (5, 1.6), (2, 0.5)]
    for i, (num_outputs, seconds) in enumerate(shapes):
        request = make_sample(f"r{i}")
        tracer.arrived(request.request_id, [request], None)
        request.append_token(7)
        request.first_token_time = clock.now
        for _ in range(num_outputs - 1):
            request.append_token(7)
        clock.now += seconds
        request.finish(FinishReason.LENGTH)
        tracer.finished(request)
        end_step(tracer)
    latency = tracer.latency()
    assert latency.window == 5
    assert latency.tpot_p50 == pytest.approx(0.3)
    # rank 0.9 * (5 - 1) = 3.6: 0.4 + 0.6 * (0.5 - 0.4)
    assert latency.tpot_p90 == pytest.approx(0.46)


def test_a_swap_preempted_request_shows_state_swapped(make_engine):
    """While a request's KV sits in the host arena its trace says `swapped`; back on the device, `running`."""
    engine = make_engine(num_blocks=12, block_size=4, max_num_batched_tokens=16, max_num_seqs=4,
                         preemption_mode="swap", swap_space=0.01)
    for i, prompt in enumerate(make_prompts(5, seed=1, min_len=12, max_len=20)):
        engine.add_request(str(i), prompt, greedy(24))
    seen_swapped: set[str] = set()
    while engine.has_unfinished_requests():
        engine.step()
        for request in engine.scheduler.swapped:
            assert engine.tracer.snapshot(request.request_id).state == "swapped"
            seen_swapped.add(request.request_id)
        for request in engine.scheduler.running:
            assert engine.tracer.snapshot(request.parent_id or request.request_id).state == "running"
    assert seen_swapped, "nothing was swapped: the test lost its point"
