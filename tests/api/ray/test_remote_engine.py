"""RemoteEngine's bookkeeping without a Ray cluster: fake replica handles stand in for Serve's, so
routing, error pass-through, a replica failing mid-stream and the health states run in milliseconds.
(tests/test_ray_serving.py runs the same paths on real Ray.)"""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
from conftest import skip_unless_ci

from vllmlite.api.cli import ServerArgs
from vllmlite.api.ray.routing import preference_order, routing_key
from vllmlite.engine.client import EngineFacts, EngineSummary
from vllmlite.engine.exceptions import EngineDeadError, QueueFullError
from vllmlite.engine.request_limits import RequestLimits
from vllmlite.engine.request_stream import GenerateRequest
from vllmlite.outputs import RequestOutput
from vllmlite.sampling_params import SamplingParams

pytestmark = [pytest.mark.ray, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
if importlib.util.find_spec("ray") is None:
    skip_unless_ci("ray is not installed (pip install -e .[ray])")


class _Outputs:
    """What `handle.generate.options(stream=True).remote(request)` returns: an async iterator."""

    def __init__(self, items: list) -> None:
        self.items, self.is_cancelled = items, False

    def __aiter__(self):
        return self._run()

    async def _run(self):
        for item in self.items:
            await asyncio.sleep(0)
            if isinstance(item, Exception) and not isinstance(item, QueueFullError):
                raise item  # Ray's own failure (the actor died), not an engine error sent as a value
            yield item

    def cancel(self) -> None:
        self.is_cancelled = True


class _Method:
    def __init__(self, call) -> None:
        self.call = call

    def options(self, **_):
        return self

    def remote(self, *args):
        return self.call(*args)


class _FakeHandle:
    def __init__(self, script) -> None:
        self.requests: list[GenerateRequest] = []
        self.generate = _Method(lambda request: self.requests.append(request) or _Outputs(script(request)))


def _finished(request: GenerateRequest) -> list:
    return [RequestOutput(request.request_id, None, request.prompt_token_ids, [], finished=True)]


def _engine(scripts):
    from vllmlite.api.ray.serving import RemoteEngine
    summary = EngineSummary("random", "float64", 4096, {})
    facts = EngineFacts(tokenizer=None, limits=RequestLimits(259, 4096, 8, 512, 16), hidden_size=64, summary=summary)
    handles = [_FakeHandle(script) for script in scripts]
    return RemoteEngine(handles, facts, ServerArgs(model="random"), owns_ray=False, owns_replicas=False), handles


def _request(i: int, prompt: list[int]) -> GenerateRequest:
    return GenerateRequest(f"r{i}", prompt, SamplingParams(max_tokens=4))


async def _drain(stream) -> list:
    return [output async for output in stream]


def test_requests_sharing_a_first_block_go_to_one_replica():
    async def run():
        engine, handles = _engine([_finished, _finished])
        shared = list(range(3, 19))
        for i in range(6):
            await _drain(engine.add_request(_request(i, shared + [100 + i])))
        return [len(h.requests) for h in handles]
    assert sorted(asyncio.run(run())) == [0, 6]


def test_engine_errors_pass_through_and_a_failed_replica_is_routed_around():
    async def run():
        engine, handles = _engine([lambda r: [QueueFullError("full")], lambda r: [RuntimeError("ActorDiedError")]])
        prompts = {}
        for seed in range(40):  # a prompt preferring each replica
            prompt = [(seed * 5 + j) % 250 + 3 for j in range(20)]
            prompts.setdefault(preference_order(routing_key(prompt, 16), 2)[0], prompt)
        with pytest.raises(QueueFullError):
            await _drain(engine.add_request(_request(100, prompts[0])))
        with pytest.raises(EngineDeadError, match="replica 1 is down"):
            await _drain(engine.add_request(_request(101, prompts[1])))
        assert [r.is_healthy for r in engine.replicas] == [True, False]
        assert engine.health_report()["status"] == "degraded" and engine.health_error is None
        with pytest.raises(QueueFullError):  # its first choice is down: replica 0 answers
            await _drain(engine.add_request(_request(102, prompts[1])))
        assert handles[0].requests[-1].request_id == "r102"
        engine.replicas[0].is_healthy = False
        assert engine.health_report()["status"] == "dead" and "every replica is down" in engine.health_error
        with pytest.raises(EngineDeadError):
            engine.add_request(_request(103, prompts[0]))
        return [r.num_in_flight for r in engine.replicas], [r.load for r in engine.replicas]
    assert asyncio.run(run()) == ([0, 0], [0.0, 0.0])  # nothing leaked


def test_a_replicas_reported_prefix_hit_lowers_the_next_requests_cost_there():
    """The ingress remembers what each replica last found cached for a prefix, and counts a request
    with that prefix as that much less work there (routing.request_cost); the memory is bounded."""
    from vllmlite.api.ray import serving as ray_serving
    from vllmlite.api.ray.routing import DECODE_WEIGHT

    def cached_16(request):
        return [RequestOutput(request.request_id, None, request.prompt_token_ids, [], finished=True,
                              num_cached_tokens=16)]

    async def run():
        engine, handles = _engine([cached_16, cached_16])
        prompt = list(range(3, 19)) + [200, 201]
        await _drain(engine.add_request(_request(0, prompt)))
        home = 0 if handles[0].requests else 1
        key = routing_key(prompt, 16)
        assert engine._reported_hits == {(home, key): 16}
        request = _request(1, prompt)
        assert ray_serving._cost(request, engine._reported_hits[(home, key)]) == 2 + 4 * DECODE_WEIGHT
        assert ray_serving._cost(request, 0) == 18 + 4 * DECODE_WEIGHT
        for i in range(ray_serving.MAX_REPORTED_HITS + 5):
            engine._remember_hit(0, i.to_bytes(8, "little"), 1)
        assert len(engine._reported_hits) == ray_serving.MAX_REPORTED_HITS
        assert (home, key) not in engine._reported_hits  # the oldest went first
    asyncio.run(run())


def test_remote_engine_implements_the_engine_client_interface():
    """The same members as AsyncLLMEngine (tests/engine/test_async_engine.py pins the list), with
    the same parameters."""
    import inspect
    import typing

    from vllmlite.api.ray.serving import RemoteEngine
    from vllmlite.engine.client import EngineClient

    engine, _ = _engine([_finished])
    assert isinstance(engine, EngineClient)
    for name in typing._get_protocol_attrs(EngineClient):
        protocol_member = getattr(EngineClient, name, None)
        if callable(protocol_member):
            assert (inspect.signature(getattr(RemoteEngine, name)).parameters.keys()
                    == inspect.signature(protocol_member).parameters.keys()), name
    assert engine.summary().model_source == "random" and engine.request_limits.block_size == 16


class _InspectHandle:
    """A replica handle whose `inspect(read, *args)` is the coroutine `call(read, *args)`."""

    def __init__(self, call) -> None:
        self.inspect = _Method(call)


async def _echo(read, *args):
    return {"read": read, "args": list(args)}


async def _fail(read, *args):
    raise RuntimeError("RayTaskError(APIError): the engine did not answer\nmore lines")


async def _hang(read, *args):
    await asyncio.sleep(60)


async def _no_trace(read, *args):
    return None


def test_inspecting_replicas_leaves_out_and_names_the_ones_that_fail_hang_or_are_down():
    from vllmlite.api.errors import APIError
    from vllmlite.api.ops.debug import read_payload

    async def run():
        engine, _ = _engine([_finished] * 4)
        for replica, call in zip(engine.replicas, (_echo, _fail, _hang, _echo)):
            replica.handle = _InspectHandle(call)
        engine.replicas[3].is_healthy, engine.replicas[3].error = False, "killed"
        loop = asyncio.get_running_loop()
        started = loop.time()
        replies = await engine.inspect_replicas("request", "r1", timeout=0.2)
        assert loop.time() - started < 2.0  # a hung replica costs the timeout, not a hang
        assert replies.answers == [(0, {"read": "request", "args": ["r1"]})]
        assert replies.missing == [(1, "RuntimeError: RayTaskError(APIError): the engine did not answer"),
                                   (2, "no answer within 0.2 s"), (3, "down (killed)")]
        # Through the routes' read: no replica that answered has the id, and one did not answer.
        engine.replicas[0].handle = engine.replicas[2].handle = _InspectHandle(_no_trace)
        with pytest.raises(APIError, match="did not answer: replica 1: RuntimeError") as not_found:
            await read_payload(engine, "request", "r1")
        assert not_found.value.status == 404
        engine.replicas[0].is_healthy = engine.replicas[2].is_healthy = False
        with pytest.raises(APIError, match="no replica answered") as none:
            await read_payload(engine, "stats")
        assert none.value.status == 503
    asyncio.run(run())


class _Drain:
    """A drain's DeploymentResponse: `result(timeout_s)` raises TimeoutError until `done_at`."""

    def __init__(self, done_at: float) -> None:
        self.done_at = done_at

    def result(self, timeout_s: float) -> None:
        import time
        wait = self.done_at - time.monotonic()
        if wait > timeout_s:
            time.sleep(timeout_s)
            raise TimeoutError("Timed out resolving to ObjectRef.")
        time.sleep(max(wait, 0))


def test_shutdown_waits_for_a_draining_replica_but_not_for_one_that_went_down():
    """A replica that drains is waited for; one whose process (or Ray itself) is gone is given up
    on as soon as the poller marks it down, not at the drain deadline (e.g. a SIGTERM sent to the
    whole process group reaches Ray's own processes too)."""
    import threading
    import time

    from vllmlite.api.ray.serving import RemoteEngine, ReplicaState

    replica = ReplicaState(0, handle=None)
    started = time.monotonic()
    RemoteEngine._wait_for_drain(replica, _Drain(started + 1.0), deadline=started + 30)
    assert 0.9 < time.monotonic() - started < 5  # drained: waited for it
    threading.Timer(0.5, lambda: setattr(replica, "is_healthy", False)).start()
    started = time.monotonic()
    RemoteEngine._wait_for_drain(replica, _Drain(started + 60), deadline=started + 30)
    assert time.monotonic() - started < 5  # went down: not the 30 s deadline
    replica.is_healthy = True
    started = time.monotonic()
    RemoteEngine._wait_for_drain(replica, _Drain(started + 60), deadline=started + 1.0)
    assert time.monotonic() - started < 5  # never drains: the deadline ends the wait
