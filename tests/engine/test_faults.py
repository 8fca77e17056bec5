"""Fault confinement: an exception raised for one request at any stage (tokenize, schedule, forward,
sample, apply, detokenize, stream write) fails that request alone with a clean error, and every other
request's tokens are exactly those of a run without the fault. A fault of the engine itself (the model
fails without any request, the scheduler raises outside any request) marks it dead: /health 503 and
new requests 503 at once. A step hung past the heartbeat timeout turns /health 503 until it ends.
An allocation that raises MemoryError while a sequence grows preempts instead of crashing."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time

import httpx
import pytest
from conftest import engine_on, greedy, make_prompts, run_to_completion, step_to_completion
from server_util import running_server, wait_until

from vllmlite.engine.exceptions import EngineDeadError
from vllmlite.engine.llm_engine import LLMEngine
from vllmlite.engine.request_stream import GenerateRequest
from vllmlite.sampling_params import SamplingParams

POISON = "poison"
MAX_TOKENS = 10


def workload() -> list[tuple[str, list[int], SamplingParams]]:
    """Four bystanders (greedy, and one seeded random sampler) and the poisoned request."""
    prompts = make_prompts(5, seed=11, min_len=3, max_len=30)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)
    requests = [(str(i), p, greedy(MAX_TOKENS)) for i, p in enumerate(prompts[:3])]
    return [*requests, ("3", prompts[3], seeded), (POISON, prompts[4], greedy(MAX_TOKENS))]


def run(engine: LLMEngine, requests) -> dict:
    """Every request to completion, all added at once; request id -> its final output. Block
    invariants hold after every step and nothing leaks (conftest.run_to_completion)."""
    outputs = run_to_completion(engine, [(p, params) for _, p, params in requests])
    return {request_id: output for (request_id, _, _), output in zip(requests, outputs)}


# --- injections: each raises for the poisoned request only (ids are the run's indices) ----------

def poison_id(requests) -> str:
    return str([rid for rid, _, _ in requests].index(POISON))


def inject_schedule(engine: LLMEngine, victim: str, at_call: int) -> None:
    """The poisoned request's `at_call`-th block allocation raises (1: on admission, later: while it
    grows mid-decode alongside the others)."""
    bm, calls = engine.block_manager, []
    allocate = bm.allocate

    def faulty(request_id, *args, **kwargs):
        if request_id == victim:
            calls.append(1)
            if len(calls) == at_call:
                raise RuntimeError("injected schedule fault")
        return allocate(request_id, *args, **kwargs)

    bm.allocate = faulty


def inject_forward(engine: LLMEngine, victim: str) -> None:
    """The forward pass raises whenever the poisoned request is in the batch."""
    runner, in_batch = engine.runner, set()
    execute, forward = runner.execute, runner.model.forward_logits

    def tracking_execute(out):
        in_batch.update(s.request.request_id for s in out.scheduled)
        try:
            return execute(out)
        finally:
            in_batch.clear()

    def faulty_forward(*args, **kwargs):
        if victim in in_batch:
            raise RuntimeError("injected forward fault")
        return forward(*args, **kwargs)

    runner.execute, runner.model.forward_logits = tracking_execute, faulty_forward


class FaultySampler:
    """Samples (so every generator in the batch draws), then raises if the victim was in the batch
    with at least two output tokens; the speculative path (`probs`) too."""

    def __init__(self, sampler, victim) -> None:
        self.sampler, self.victim = sampler, victim

    def _check(self, batch) -> None:
        if self.victim.num_output_tokens >= 2 and any(g is self.victim.generator for g in batch.generators):
            raise RuntimeError("injected sample fault")

    def __call__(self, logits, batch):
        sampled = self.sampler(logits, batch)
        self._check(batch)
        return sampled

    def probs(self, logits, batch):
        probs = self.sampler.probs(logits, batch)
        self._check(batch)
        return probs


def inject_sample(engine: LLMEngine, victim: str) -> None:
    engine.runner.sampler = FaultySampler(engine.runner.sampler, engine.scheduler.requests[victim])


def inject_update(engine: LLMEngine, victim: str) -> None:
    """Applying the poisoned request's third token raises."""
    scheduler = engine.scheduler
    append = scheduler._append_tokens

    def faulty(request, token_ids, logprobs):
        if request.request_id == victim and request.num_output_tokens >= 2:
            raise RuntimeError("injected update fault")
        append(request, token_ids, logprobs)

    scheduler._append_tokens = faulty


def inject_detokenize(engine: LLMEngine, victim: str) -> None:
    """Detokenizing the poisoned request's output past its third token raises."""
    processor = engine.output_processor
    detokenize = processor._detokenize

    def faulty(sample):
        if sample.request.request_id == victim and sample.request.num_output_tokens >= 3:
            raise RuntimeError("injected detokenize fault")
        return detokenize(sample)

    processor._detokenize = faulty


INJECTIONS = {
    "schedule-admission": lambda e, v: inject_schedule(e, v, at_call=1),
    "schedule-growth": lambda e, v: inject_schedule(e, v, at_call=4),
    "forward": inject_forward,
    "sample": inject_sample,
    "update": inject_update,
    "detokenize": inject_detokenize,
}


def run_with_fault(engine: LLMEngine, requests, inject) -> dict:
    """Like `run`, with `inject(engine, poisoned request's id)` applied once the requests are queued."""
    victim = poison_id(requests)
    for i, (_, prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params)
    inject(engine, victim)
    finished = step_to_completion(engine)
    return {rid: finished[str(i)] for i, (rid, _, _) in enumerate(requests)}


@pytest.fixture(scope="module")
def expected(tiny_model) -> dict:
    """The bystanders' outputs in a run without the poisoned request."""
    bystanders = [r for r in workload() if r[0] != POISON]
    return {rid: [c.token_ids for c in o.outputs] for rid, o in run(engine_on(tiny_model), bystanders).items()}


TIGHT = {"block_size": 4, "num_blocks": 20, "max_num_batched_tokens": 24}
SWAP = {**TIGHT, "preemption_mode": "swap", "swap_space": 0.01}


@pytest.mark.parametrize("stage", sorted(INJECTIONS))
@pytest.mark.parametrize("knobs", [{}, TIGHT, SWAP], ids=["roomy", "tight-cache-chunked", "swap"])
def test_a_fault_at_any_stage_fails_only_its_request(make_engine, expected, stage, knobs):
    engine = make_engine(**knobs)
    outputs = run_with_fault(engine, workload(), INJECTIONS[stage])
    poisoned = outputs.pop(POISON)
    assert poisoned.finished and poisoned.outputs[0].finish_reason == "error"
    assert f"injected {stage.split('-')[0]} fault" in poisoned.error
    assert {rid: [c.token_ids for c in o.outputs] for rid, o in outputs.items()} == expected
    assert all(o.error is None for o in outputs.values())
    if knobs:
        assert engine.get_stats().scheduler.num_preemptions > 0  # the fault met preemption too


def test_a_swap_in_fault_fails_only_its_request(make_engine, expected):
    engine = make_engine(**SWAP)
    bm, failed = engine.block_manager, []
    swap_in = bm.swap_in

    def faulty(request_id):  # the first request swapped back in is the poisoned one
        if not failed:
            failed.append(request_id)
            raise RuntimeError("injected swap-in fault")
        return swap_in(request_id)

    bm.swap_in = faulty
    outputs = run(engine, [r for r in workload() if r[0] != POISON])
    poisoned = outputs.pop(failed[0])
    assert "injected swap-in fault" in poisoned.error
    assert {rid: [c.token_ids for c in o.outputs] for rid, o in outputs.items()} == \
        {rid: tokens for rid, tokens in expected.items() if rid != failed[0]}


def test_forward_fault_of_an_n2_request_fails_its_samples_only(make_engine, expected):
    requests = [(rid, p, greedy(MAX_TOKENS, n=2) if rid == POISON else params) for rid, p, params in workload()]
    outputs = run_with_fault(make_engine(), requests, inject_forward)
    poisoned = outputs.pop(POISON)
    assert "injected forward fault" in poisoned.error
    assert [c.finish_reason for c in poisoned.outputs] == ["error", "error"]
    assert {rid: [c.token_ids for c in o.outputs] for rid, o in outputs.items()} == expected


def test_sample_fault_with_speculative_decoding_fails_only_its_request(make_engine, expected):
    engine = make_engine(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                             "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    outputs = run_with_fault(engine, workload(), inject_sample)
    assert "injected sample fault" in outputs.pop(POISON).error
    assert {rid: [c.token_ids for c in o.outputs] for rid, o in outputs.items()} == expected
    assert engine.get_stats().scheduler.spec_decode.num_drafts > 0


def test_a_model_that_fails_without_any_request_is_a_fault_of_the_engine(make_engine):
    engine = make_engine()
    engine.add_request("a", [1, 2, 3], greedy(4))

    def broken(*args, **kwargs):
        raise RuntimeError("broken kernels")

    engine.runner.model.forward_logits = broken
    with pytest.raises(RuntimeError, match="request-free canary") as caught:
        engine.step()
    assert "broken kernels" in str(caught.value.__cause__)


def test_a_scheduler_fault_outside_any_request_propagates(make_engine):
    engine = make_engine()
    engine.add_request("a", [1, 2, 3], greedy(4))

    def broken():
        raise RuntimeError("scheduler bookkeeping")

    engine.block_manager.take_copies = broken
    with pytest.raises(RuntimeError, match="scheduler bookkeeping"):
        engine.step()


@pytest.mark.parametrize("grower", ["0", "2"])
def test_memory_error_while_a_sequence_grows_preempts_instead_of_crashing(make_engine, expected, grower):
    engine = make_engine(block_size=4)
    bystanders = [r for r in workload() if r[0] != POISON]
    calls = []
    allocate = engine.block_manager.allocate

    def oom_once(request_id, *args, **kwargs):
        if request_id == grower and engine.scheduler.requests[grower].num_output_tokens >= 3:
            calls.append(1)
            if len(calls) == 1:
                raise MemoryError("injected")
        return allocate(request_id, *args, **kwargs)

    engine.block_manager.allocate = oom_once
    outputs = run(engine, bystanders)
    assert calls and engine.get_stats().scheduler.num_preemptions >= 1
    assert {rid: [c.token_ids for c in o.outputs] for rid, o in outputs.items()} == expected
    assert all(o.error is None for o in outputs.values())


def test_memory_error_on_admission_waits_for_room(make_engine, expected):
    engine = make_engine()
    bystanders = [r for r in workload() if r[0] != POISON]
    failed = []
    allocate = engine.block_manager.allocate

    def oom_first(request_id, *args, **kwargs):
        if request_id == "1" and not failed:
            failed.append(request_id)
            raise MemoryError("injected")
        return allocate(request_id, *args, **kwargs)

    engine.block_manager.allocate = oom_first
    outputs = run(engine, bystanders)
    assert failed and {rid: [c.token_ids for c in o.outputs] for rid, o in outputs.items()} == expected


def test_a_request_that_fails_while_being_queued_leaves_nothing_behind(make_engine):
    engine = make_engine()
    add = engine.scheduler.add_request

    def faulty(request, forks=()):
        raise RuntimeError("injected queue fault")

    engine.scheduler.add_request = faulty
    with pytest.raises(RuntimeError, match="injected queue fault"):
        engine.add_request("x", [1, 2, 3], greedy(4, n=2))
    engine.scheduler.add_request = add
    assert not engine.has_unfinished_requests()
    result = run_to_completion(engine, [([1, 2, 3], greedy(4))])[0]  # the id is free again
    assert result.finished and result.error is None


# --- the async engine: a dead loop, a hung step -------------------------------------------------

def test_a_hung_step_turns_unhealthy_and_refuses_new_requests_until_it_ends(make_async):
    engine = make_async(heartbeat_timeout=0.2)
    gate = threading.Event()
    step = engine.engine.step

    def stuck_step():
        gate.wait(30)
        return step()

    engine.engine.step = stuck_step

    async def main():
        stream = engine.add_request(GenerateRequest("slow", [1, 2, 3], greedy(3)))
        assert await asyncio.to_thread(wait_until, lambda: engine.health_error is not None, 10)
        assert "unresponsive" in engine.health_error
        began = time.monotonic()
        with pytest.raises(EngineDeadError, match="unresponsive"):
            engine.add_request(GenerateRequest("late", [1], greedy(1)))
        assert time.monotonic() - began < 1.0
        gate.set()
        outputs = [o async for o in stream]
        assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 3
        assert engine.health_error is None
        late = [o async for o in engine.add_request(GenerateRequest("late", [1], greedy(1)))]
        assert late[-1].finished

    asyncio.run(main())


def test_a_request_that_fails_while_being_queued_fails_alone(make_async):
    engine = make_async()
    add = engine.engine.scheduler.add_request

    def faulty(request, forks=()):
        if request.request_id == "bad":
            raise RuntimeError("injected queue fault")
        add(request, forks)

    engine.engine.scheduler.add_request = faulty

    async def main():
        with pytest.raises(RuntimeError, match="injected queue fault"):
            [o async for o in engine.add_request(GenerateRequest("bad", [1, 2], greedy(2)))]
        good = [o async for o in engine.add_request(GenerateRequest("good", [1, 2], greedy(2)))]
        assert good[-1].finished and len(good[-1].outputs[0].token_ids) == 2

    asyncio.run(main())
    assert engine.health_error is None and engine.num_unfinished_requests == 0


# --- over HTTP ----------------------------------------------------------------------------------

MARKER = "@@FAULT@@"
PROMPTS = ["the quick brown fox", "jumps over", "a lazy dog and then some more words"]


def complete(url: str, prompt: str, stream: bool = False, **fields) -> httpx.Response:
    body = {"model": "random", "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": stream, **fields}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def streamed_text(response: httpx.Response) -> tuple[str, list[str]]:
    """The text a completions stream carries, and its raw events."""
    events = [e for e in response.text.split("\n\n") if e]
    text = "".join(c["text"] for e in events[:-1] for c in json.loads(e[len("data: "):]).get("choices", []))
    return text, events


def concurrently(url: str, poisoned: dict) -> tuple[list[str], httpx.Response]:
    """The bystanders (streamed and not) and one poisoned request, all at once."""
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        plain = [pool.submit(complete, url, p) for p in PROMPTS]
        streams = [pool.submit(complete, url, p, True) for p in PROMPTS]
        bad = pool.submit(complete, url, **poisoned)
        texts = [f.result().json()["choices"][0]["text"] for f in plain]
        assert [streamed_text(f.result())[0] for f in streams] == texts
        return texts, bad.result()


@pytest.fixture(scope="module")
def live(tiny_model):
    with running_server(tiny_model) as server:
        yield server


@pytest.fixture(scope="module")
def reference_texts(live) -> list[str]:
    return [complete(live.url, p).json()["choices"][0]["text"] for p in PROMPTS]


def test_http_sample_fault_is_a_500_for_that_request_and_others_are_unchanged(live, reference_texts):
    runner = live.engine.engine.runner
    sampler = runner.sampler

    class PoisonSampler(FaultySampler):  # raises for the request whose prompt holds the marker
        def _check(self, batch) -> None:
            if any(MARKER.encode() in bytes(t for t in ids if t < 256) for ids in batch.prompt_token_ids):
                raise RuntimeError("injected sample fault")

    runner.sampler = PoisonSampler(sampler, None)
    try:
        texts, bad = concurrently(live.url, {"prompt": f"x {MARKER}"})
        assert texts == reference_texts
        assert bad.status_code == 500 and "injected sample fault" in bad.json()["error"]["message"]
        _, events = streamed_text(complete(live.url, f"x {MARKER}", stream=True))
        assert "injected sample fault" in json.loads(events[-2][len("data: "):])["error"]["message"]
        assert events[-1] == "data: [DONE]"
    finally:
        runner.sampler = sampler
    assert wait_until(live.is_idle)
    assert httpx.get(live.url + "/health").status_code == 200


def test_http_tokenize_fault_is_a_clean_500(live, reference_texts, monkeypatch):
    tokenizer = live.engine.tokenizer
    encode = tokenizer.encode

    def faulty(text, *args, **kwargs):
        if MARKER in text:
            raise RuntimeError("injected tokenize fault")
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", faulty)
    texts, bad = concurrently(live.url, {"prompt": f"x {MARKER}"})
    assert texts == reference_texts
    assert bad.status_code == 500 and bad.json()["error"]["message"].startswith("internal error")
    assert complete(live.url, f"x {MARKER}", stream=True).status_code == 500
    assert wait_until(live.is_idle)


def test_http_stream_write_fault_ends_that_stream_with_an_error_and_aborts_it(live, reference_texts, monkeypatch):
    import vllmlite.api.openai.serving_completions as serving_completions
    sse_event = serving_completions.sse_event

    def faulty(payload):
        event = sse_event(payload)
        if MARKER in event:  # the echoed prompt is in the poisoned stream's first chunk
            raise RuntimeError("injected stream write fault")
        return event

    monkeypatch.setattr(serving_completions, "sse_event", faulty)
    texts, bad = concurrently(live.url, {"prompt": f"x {MARKER}", "stream": True, "echo": True,
                                         "max_tokens": 200})
    assert texts == reference_texts
    _, events = streamed_text(bad)
    assert "injected stream write fault" in json.loads(events[-2][len("data: "):])["error"]["message"]
    assert events[-1] == "data: [DONE]"
    assert wait_until(live.is_idle)  # its engine request was aborted, its blocks freed


def test_http_loop_fault_makes_health_503_and_new_requests_fail_fast(tiny_model):
    with running_server(tiny_model) as server:
        assert complete(server.url, "warm").status_code == 200
        scheduler = server.engine.engine.scheduler
        gate = threading.Event()

        def broken():
            gate.wait(30)
            raise RuntimeError("injected loop fault")

        scheduler.schedule = broken
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            plain = pool.submit(complete, server.url, "in flight")
            streamed = pool.submit(complete, server.url, "in flight", True)
            assert wait_until(lambda: server.engine.num_unfinished_requests == 2)
            gate.set()
            assert plain.result().status_code == 503
            _, events = streamed_text(streamed.result())
            assert "injected loop fault" in json.loads(events[-2][len("data: "):])["error"]["message"]
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and "injected loop fault" in health.json()["error"]["message"]
        began = time.monotonic()
        for stream in (False, True):
            assert complete(server.url, "new", stream).status_code == 503
        assert time.monotonic() - began < 2.0


def test_http_hung_step_makes_health_503_until_it_ends(tiny_model):
    with running_server(tiny_model, heartbeat_timeout=0.3) as server:
        engine = server.engine.engine
        gate, step = threading.Event(), engine.step

        def stuck_step():
            gate.wait(30)
            return step()

        engine.step = stuck_step
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(complete, server.url, "stuck")
            assert wait_until(lambda: httpx.get(server.url + "/health").status_code == 503, 10)
            assert "unresponsive" in httpx.get(server.url + "/health").json()["error"]["message"]
            began = time.monotonic()
            assert complete(server.url, "new").status_code == 503
            assert time.monotonic() - began < 2.0
            gate.set()
            assert waiting.result().status_code == 200
        assert httpx.get(server.url + "/health").status_code == 200
        assert complete(server.url, "new").status_code == 200
