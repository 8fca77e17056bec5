"""Request lifecycle tracing (vllmlite/core/tracing.py): each request's events are recorded in order with
consistent token counts, through prefix hits, chunked prefill, preemption (recompute and swap) and
aborts; memory stays bounded; tracing off changes no output."""

from __future__ import annotations

import pytest
from conftest import greedy, make_prompts, run_to_completion

from vllmlite.core.request import FinishReason, Request
from vllmlite.core.tracing import RequestTracer, Tracer
from vllmlite.sampling_params import SamplingParams
from vllmlite.worker.sampling import make_generator

BLOCK = 4
SHARED = list(range(1, 20))  # a 19-token system prompt: 4 full blocks reusable from the prefix cache
# A cache too small for six 40-token sequences at once, a chunk budget smaller than a prompt.
PRESSURE = dict(num_blocks=12, block_size=BLOCK, max_num_batched_tokens=16, max_num_seqs=4)


def names(trace) -> list[str]:
    return [e.event for e in trace.events]


def segments(trace) -> list[list]:
    """The trace's events split at each scheduled/resumed: one list per stay on the machine."""
    runs: list[list] = []
    for event in trace.events:
        if event.event in ("scheduled", "resumed"):
            runs.append([])
        if runs:
            runs[-1].append(event)
    return runs


def assert_chunks_are_contiguous(run: list, start: int) -> int:
    """The prefill chunks of one stay follow each other from `start`; returns where they end."""
    for event in run:
        if event.event == "prefill_chunk":
            assert event.fields["start"] == start and event.fields["num_tokens"] > 0
            start += event.fields["num_tokens"]
    return start


def test_a_trace_lists_prefix_hit_chunks_preemption_and_resume_in_order_with_consistent_counts(make_engine):
    engine = make_engine(**PRESSURE)
    requests = [(SHARED + p, greedy(20)) for p in make_prompts(6, seed=3, min_len=4, max_len=10)]
    outputs = run_to_completion(engine, requests)
    traces = {t.request_id: t for t in engine.tracer.snapshots(with_events=True)}
    assert sorted(traces) == [str(i) for i in range(6)]
    interesting = [t for t in traces.values()
                   if {"prefix_hit", "preempted", "resumed"} <= set(names(t)) and names(t).count("prefill_chunk") >= 3]
    assert interesting, "no request was chunked, hit the cache and was preempted: the test lost its point"
    for trace in traces.values():
        output = outputs[int(trace.request_id)]
        times = [e.time for e in trace.events]
        assert times == sorted(times)
        assert names(trace)[:3] == ["arrived", "queued", "scheduled"] and names(trace)[-1] == "finished"
        assert trace.events[-1].fields == {"reason": "length"} and trace.finish_reason == "length"
        assert trace.state == "finished" and trace.num_dropped_events == 0
        assert trace.num_prompt_tokens == len(output.prompt_token_ids)
        assert trace.num_output_tokens == len(output.outputs[0].token_ids) == 20
        assert trace.num_cached_tokens == output.num_cached_tokens
        assert trace.num_preemptions == names(trace).count("preempted") == names(trace).count("resumed")
        assert trace.arrival_time <= trace.first_token_time <= trace.finish_time
        assert trace.ttft == pytest.approx(trace.first_token_time - trace.arrival_time)
        first, *later = segments(trace)
        hit = first[1].fields["num_tokens"] if first[1].event == "prefix_hit" else 0
        assert hit == trace.num_cached_tokens and hit % BLOCK == 0
        # The first stay computes the prompt from the hit to its end, then the first token comes.
        assert assert_chunks_are_contiguous(first, hit) == trace.num_prompt_tokens
        assert names(trace).index("first_token") > max(i for i, e in enumerate(trace.events)
                                                       if e.event == "prefill_chunk" and e in first)
        for run in later:  # after a recompute: from its own hit, over the prompt and the tokens so far
            hit = run[1].fields["num_tokens"] if run[1].event == "prefix_hit" else 0
            end = assert_chunks_are_contiguous(run, hit)
            assert trace.num_prompt_tokens < end <= trace.num_prompt_tokens + 20
        for event in trace.events:
            if event.event == "preempted":
                assert event.fields == {"mode": "recompute"}


def test_swap_preemption_is_swapped_out_then_in_then_resumed(make_engine):
    engine = make_engine(**PRESSURE, preemption_mode="swap", swap_space=0.01)
    run_to_completion(engine, [(p, greedy(24)) for p in make_prompts(5, seed=1, min_len=12, max_len=20)])
    swapped = [t for t in engine.tracer.snapshots(with_events=True) if "swapped_in" in names(t)]
    assert swapped, "nothing was swapped"
    for trace in swapped:
        sequence = [n for n in names(trace) if n in ("preempted", "swapped_in", "resumed")]
        assert sequence == ["preempted", "swapped_in", "resumed"] * trace.num_preemptions
        assert all(e.fields == {"mode": "swap"} for e in trace.events if e.event == "preempted")


def test_states_follow_the_request_while_it_lives(make_engine):
    engine = make_engine(**PRESSURE)
    engine.add_request("a", list(range(30)), greedy(5))
    assert engine.tracer.snapshot("a").state == "waiting"
    engine.step()
    live = engine.tracer.snapshot("a")
    assert live.state == "running" and live.finish_time is None and live.e2e is None
    while engine.has_unfinished_requests():
        engine.step()
    done = engine.tracer.snapshot("a")
    assert done.state == "finished" and done.num_output_tokens == 5 and done.e2e > 0
    assert engine.tracer.snapshot("unknown") is None


def test_an_abort_is_recorded_with_why(make_engine):
    engine = make_engine()
    engine.add_request("gone", list(range(1, 9)), greedy(50))
    engine.step()
    engine.abort_request("gone", why="client disconnected")
    trace = engine.tracer.snapshot("gone")
    assert trace.state == "aborted" and trace.finish_reason == "abort"
    assert trace.events[-1].event == "aborted" and trace.events[-1].fields == {"why": "client disconnected"}
    engine.step()  # the scheduler's finish of the aborted request changes nothing after it closed
    assert engine.tracer.snapshot("gone").events[-1].event == "aborted"
    assert engine.tracer.latency().window == 0  # aborted requests are not in the latency window


def test_n_samples_share_one_trace_closed_when_the_last_one_finishes(make_engine):
    engine = make_engine()
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    run_to_completion(engine, [(list(range(1, 11)), params)])
    (trace,) = engine.tracer.snapshots(with_events=True)
    assert trace.request_id == "0" and trace.state == "finished" and trace.num_output_tokens == 18
    assert names(trace).count("finished") == 1


def test_speculative_counts_are_summed_into_one_event(make_engine):
    engine = make_engine(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    prompt = [5, 6, 7, 8] * 6
    run_to_completion(engine, [(prompt, greedy(30))])
    (trace,) = engine.tracer.snapshots(with_events=True)
    spec = engine.get_stats().scheduler.spec_decode
    events = [e for e in trace.events if e.event == "speculative"]
    assert spec.num_draft_tokens > 0 and len(events) == 1
    assert events[0].fields == {"num_draft_tokens": spec.num_draft_tokens, "num_accepted": spec.num_accepted_tokens}


def test_prompts_are_kept_only_when_asked(make_engine):
    prompt = list(b"hello tracing")
    plain = make_engine()
    run_to_completion(plain, [(prompt, greedy(2))])
    assert plain.tracer.snapshots()[0].prompt is None
    storing = make_engine(debug_store_prompts=True)
    run_to_completion(storing, [(prompt, greedy(2))])
    assert storing.tracer.snapshots()[0].prompt == storing.tokenizer.decode(prompt)


def test_tracing_off_records_nothing_and_changes_no_output(make_engine):
    requests = [(SHARED + p, greedy(12)) for p in make_prompts(6, seed=4, max_len=12)]
    on, off = make_engine(**PRESSURE), make_engine(**PRESSURE, trace_ring_size=0)
    assert type(off.tracer) is Tracer and off.tracer.snapshots() == [] and off.tracer.recent_steps() == []
    tokens_on = [o.outputs[0].token_ids for o in run_to_completion(on, requests)]
    tokens_off = [o.outputs[0].token_ids for o in run_to_completion(off, requests)]
    assert tokens_on == tokens_off
    assert off.debug_snapshot().latency.window == 0 and len(on.debug_snapshot().recent_steps) > 0


def test_recent_steps_count_decodes_and_prefill_tokens(make_engine):
    engine = make_engine(max_num_batched_tokens=16)
    run_to_completion(engine, [(list(range(1, 21)), greedy(4))])
    shapes = [(s.num_decode, s.num_prefill_tokens, s.num_requests) for s in engine.tracer.recent_steps()]
    assert shapes == [(0, 16, 1), (0, 4, 1), (1, 0, 1), (1, 0, 1), (1, 0, 1)]
    assert all(s.duration_ms > 0 for s in engine.tracer.recent_steps())



def _trace_through(tracer: RequestTracer, request, num_cached: int) -> None:
    """One request's whole life through the tracer's hooks: arrived, queued, admitted with a prefix
    hit of `num_cached`, prefilled in chunks of 8 up to 40 tokens, finished, its step done."""
    tracer.arrived(request.request_id, [request], None)
    tracer.queued(request, 1)
    tracer.admitted(request, num_cached)
    for start in range(num_cached, 40, 8):
        tracer.scheduled(request, start, 8)
    request.finish(FinishReason.STOP)
    tracer.finished(request)
    tracer.step_done(0.0, _no_step())

def test_the_ring_stays_bounded_under_ten_thousand_requests():
    """10,000 requests through the tracer's hooks, each with more events than the cap: the records
    and events held stay bounded, the newest are kept."""
    tracer = RequestTracer(ring_size=100, max_events=4)
    for i in range(10_000):
        _trace_through(tracer, _request(str(i)), num_cached=8)
        assert tracer.num_records <= 100
    assert tracer.num_records == 100 and tracer.num_events() == 100 * (4 + 1)
    snapshots = tracer.snapshots()
    assert [s.request_id for s in snapshots[:3]] == ["9999", "9998", "9997"] and len(snapshots) == 100
    assert all(s.num_dropped_events == 4 and s.events == () for s in snapshots)  # summaries: no events


def test_the_engine_keeps_only_the_ring(make_engine):
    engine = make_engine(trace_ring_size=50, trace_max_events=4, max_num_seqs=64)
    run_to_completion(engine, [([1 + i % 200], greedy(2)) for i in range(300)])
    assert engine.tracer.num_records == 50 and engine.tracer.num_events() <= 50 * (4 + 2)
    assert [s.request_id for s in engine.tracer.snapshots()][0] == "299"


def test_events_past_the_cap_are_counted_and_the_final_one_kept():
    tracer = RequestTracer(ring_size=2, max_events=3)
    _trace_through(tracer, _request("r"), num_cached=0)
    trace = tracer.snapshot("r")
    assert names(trace) == ["arrived", "queued", "scheduled", "finished"] and trace.num_dropped_events == 5


def _request(request_id: str) -> Request:
    return Request(request_id, list(range(40)), SamplingParams(), max_tokens=1, generator=make_generator(0))


def _no_step():
    from vllmlite.core.batch import SchedulerOutput
    return SchedulerOutput()
