"""AsyncLLMEngine: one engine thread, one stream per request, aborts that free blocks, admission
limits, a dead loop, and shutdown. No HTTP here."""

from __future__ import annotations

import asyncio
import threading

import pytest
from conftest import greedy, make_prompts, run_to_completion
from server_util import num_aborted, wait_until

from vllmlite.engine.async_engine import AsyncLLMEngine
from vllmlite.engine.exceptions import (
    EngineDeadError,
    EngineDrainingError,
    QueueFullError,
    RequestAbortedError,
    RequestTimeoutError,
)
from vllmlite.engine.request_stream import GenerateRequest


def is_idle(engine: AsyncLLMEngine) -> bool:
    stats = engine.get_stats().scheduler
    return engine.num_unfinished_requests == 0 and stats.num_kv_blocks_free == stats.num_kv_blocks


def assert_aborted_within_a_step(engine: AsyncLLMEngine, num_passes_after_cancel: int, num_aborts: int = 1) -> None:
    """The cancel reached the engine: the request is counted as aborted, and it ran at most the one
    step that was in flight when it was cancelled (the snapshot read after the cancel may be a step
    old) before its blocks were freed. The requests these tests cancel are thousands of steps long,
    so one that ran on to finish by itself fails here."""
    assert wait_until(lambda: is_idle(engine))
    assert num_aborted(engine.metrics.render()) == num_aborts
    assert engine.get_stats().num_forward_passes <= num_passes_after_cancel + 1


async def collect(engine: AsyncLLMEngine, request: GenerateRequest) -> list:
    return [output async for output in engine.generate(request)]


def test_generate_streams_deltas_that_add_up_to_the_offline_output(make_async, make_engine):
    prompts = make_prompts(6, seed=3)
    expected = run_to_completion(make_engine(), [(p, greedy(10)) for p in prompts])
    engine = make_async()

    async def main():
        return await asyncio.gather(*(collect(engine, GenerateRequest(str(i), p, greedy(10)))
                                      for i, p in enumerate(prompts)))

    results = asyncio.run(main())
    assert len(results) == len(expected) == len(prompts)
    for outputs, reference in zip(results, expected):
        assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
        deltas = [t for o in outputs for t in o.outputs[0].delta_token_ids]
        assert deltas == outputs[-1].outputs[0].token_ids == reference.outputs[0].token_ids
    assert wait_until(lambda: is_idle(engine))


def test_a_final_only_stream_gets_the_finished_output_alone(make_async, make_engine):
    """What a response not streamed reads (api final_outputs marks its streams): one output, the
    finished one, whose cumulative ids and text are the offline run's; a plain stream beside it
    still gets every step's."""
    prompts = make_prompts(2, seed=5)
    expected = run_to_completion(make_engine(), [(p, greedy(10)) for p in prompts])
    engine = make_async()

    async def main():
        final = engine.add_request(GenerateRequest("final", prompts[0], greedy(10)))
        final.final_only = True
        every = engine.add_request(GenerateRequest("every", prompts[1], greedy(10)))

        async def read(stream):
            return [o async for o in stream]
        return await asyncio.gather(read(final), read(every))

    final, every = asyncio.run(main())
    assert [o.finished for o in final] == [True]
    assert final[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
    assert final[0].outputs[0].text == expected[0].outputs[0].text
    assert len(every) > 1 and every[-1].outputs[0].token_ids == expected[1].outputs[0].token_ids
    assert wait_until(lambda: is_idle(engine))


def test_consumer_that_stops_early_aborts_and_frees_blocks(make_async):
    engine = make_async()

    async def main():
        generator = engine.generate(GenerateRequest("early", list(range(40)), greedy(3000)))
        async for output in generator:
            assert engine.get_stats().scheduler.num_kv_blocks_used > 0
            break
        await generator.aclose()

    asyncio.run(main())
    assert_aborted_within_a_step(engine, engine.get_stats().num_forward_passes)
    assert num_aborted(engine.metrics.render()) == 1


def test_cancelled_task_aborts_its_request(make_async):
    engine = make_async()

    async def main():
        async def consume():
            async for _ in engine.generate(GenerateRequest("cancel-me", [1, 2, 3], greedy(3000))):
                pass
        task = asyncio.create_task(consume())
        await asyncio.sleep(0.2)
        assert engine.get_stats().scheduler.num_running == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return engine.get_stats().num_forward_passes

    assert_aborted_within_a_step(engine, asyncio.run(main()))


def test_queue_bound_rejects_when_requests_wait(make_async):
    engine = make_async(max_queue=2, max_num_seqs=1)

    async def main():
        first = engine.add_request(GenerateRequest("a", [1, 2], greedy(3000)))
        await anext(first)  # running now: it does not count against the queue
        waiting = [engine.add_request(GenerateRequest(r, [3, 4], greedy(3000))) for r in ("b", "c")]
        with pytest.raises(QueueFullError):
            engine.add_request(GenerateRequest("d", [5], greedy(2)))
        for stream in (first, *waiting):
            stream.cancel()
        return engine.get_stats().num_forward_passes

    assert_aborted_within_a_step(engine, asyncio.run(main()), num_aborts=3)


def test_engine_side_validation_error_reaches_the_stream(make_async):
    engine = make_async()

    async def main():
        with pytest.raises(ValueError, match="prompt token ids"):
            await collect(engine, GenerateRequest("bad", [10**6], greedy(2)))

    asyncio.run(main())


def test_step_failure_marks_the_engine_dead_and_fails_every_stream(make_async):
    engine = make_async()
    started = threading.Event()

    def broken_step():
        started.set()
        raise RuntimeError("boom")

    engine.engine.step = broken_step

    async def main():
        with pytest.raises(EngineDeadError, match="boom"):
            await collect(engine, GenerateRequest("x", [1, 2, 3], greedy(4)))
        with pytest.raises(EngineDeadError):
            engine.add_request(GenerateRequest("y", [1], greedy(1)))

    asyncio.run(main())
    assert started.is_set() and engine.is_dead


def test_request_timeout_aborts_the_request(make_async):
    engine = make_async(request_timeout=0.2)

    async def main():
        with pytest.raises(RequestTimeoutError):
            await collect(engine, GenerateRequest("slow", [1, 2, 3], greedy(4000)))
        return engine.get_stats().num_forward_passes

    assert_aborted_within_a_step(engine, asyncio.run(main()))


def test_shutdown_lets_in_flight_requests_finish(make_async):
    engine = make_async()

    async def main():
        stream = engine.add_request(GenerateRequest("finish-me", [1, 2, 3], greedy(50)))
        await asyncio.to_thread(engine.shutdown, 60.0)
        with pytest.raises(EngineDrainingError):
            engine.add_request(GenerateRequest("late", [1], greedy(1)))
        return [output async for output in stream]

    outputs = asyncio.run(main())
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 50
    assert not engine.is_running


def test_shutdown_past_its_timeout_aborts_the_rest(make_async):
    engine = make_async()

    async def main():
        stream = engine.add_request(GenerateRequest("too-long", [1, 2, 3], greedy(4000)))
        await anext(stream)
        await asyncio.to_thread(engine.shutdown, 0.1)
        with pytest.raises(RequestAbortedError):
            async for _ in stream:
                pass

    asyncio.run(main())
    assert not engine.is_running
    stats = engine.engine.get_stats().scheduler  # the loop has stopped: read the engine itself
    assert stats.num_kv_blocks_free == stats.num_kv_blocks


# What the API calls on an engine (engine/client.py); the Ray ingress's RemoteEngine is checked
# against the same list in tests/api/ray/test_remote_engine.py.
ENGINE_CLIENT_MEMBERS = {"max_queue", "metrics", "is_draining", "tokenizer", "max_model_len", "hidden_size",
                         "request_limits", "health_error", "summary", "check_request", "check_grammar", "add_request", "abort",
                         "inspect", "start", "begin_draining", "shutdown"}


def test_async_engine_implements_the_engine_client_interface(make_async):
    import inspect
    import typing

    from vllmlite.engine.client import INSPECT_READS, EngineClient, EngineSummary

    assert set(typing._get_protocol_attrs(EngineClient)) == ENGINE_CLIENT_MEMBERS
    engine = make_async()
    assert isinstance(engine, EngineClient)
    for name in ENGINE_CLIENT_MEMBERS:
        protocol_member = getattr(EngineClient, name, None)
        if callable(protocol_member):  # same parameters, so callers need not know which engine they hold
            assert (inspect.signature(getattr(AsyncLLMEngine, name)).parameters.keys()
                    == inspect.signature(protocol_member).parameters.keys()), name
    summary = engine.summary()
    assert isinstance(summary, EngineSummary) and summary.max_model_len == engine.max_model_len
    assert summary.memory["kv_blocks"] == engine.request_limits.num_blocks

    async def reads():
        return {read: await engine.inspect(read, *(["no-such-id"] if read == "request" else [])) for read in INSPECT_READS}

    payloads = asyncio.run(reads())
    assert payloads["request"] is None and payloads["requests"] == {"requests": []}
    assert payloads["stats"]["model"] == payloads["engine"]["model"] == "random"
    with pytest.raises(ValueError, match="unknown read 'nope'"):
        asyncio.run(engine.inspect("nope"))
