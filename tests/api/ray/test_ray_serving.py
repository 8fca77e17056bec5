"""--num-replicas 2 on Ray Serve, through the real stack: `python -m vllmlite.api.server` in a child
process with two replicas of the tiny random model (one local Ray, started once for the module).

Checks the OpenAI client through the ingress (chat, streaming, n>1, errors, auth), prefix-aware
routing (requests sharing a system prompt hit one replica's prefix cache, not the other's), the
merged /metrics, /v1/stats and /debug/* over both replicas, a killed replica (its request gets a clean 503, service goes on, Ray restarts it)
and SIGTERM draining every replica. The last test stops the server: keep it last.
"""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import threading
import time

import httpx
import pytest
from conftest import skip_unless_ci
from server_util import SubprocessServer, parse_prometheus, wait_until

from vllmlite.api.ops.protocol_debug import ReplicasDebugEngineResponse, RequestDetail, RequestList, StatsResponse
from vllmlite.api.ray.routing import preference_order, routing_key

pytestmark = pytest.mark.ray
API_KEY = "ray-test-key"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
BLOCK_SIZE = 16
START_TIMEOUT = 240.0  # Ray's start-up on a busy two-core machine (about 30 s idle; see docs/ray.md)
SYSTEM = "You are the assistant of tenant A. Answer briefly and politely, in plain English, no markdown."


@pytest.fixture(scope="module")
def ray_server(tmp_path_factory):
    if importlib.util.find_spec("ray") is None:  # found, not imported: the ingress imports Ray, not the tests
        skip_unless_ci("ray is not installed (pip install -e .[ray])")
    server = SubprocessServer(["--model", "random", "--num-replicas", "2", "--num-blocks", "512",
                               "--block-size", str(BLOCK_SIZE), "--log-stats-interval", "0",
                               "--enable-debug-endpoints"],
                              env={"VLLMLITE_API_KEY": API_KEY, "VLLMLITE_SHUTDOWN_TIMEOUT": "60"},
                              start_timeout=START_TIMEOUT)
    started = time.monotonic()
    server.start(tmp_path_factory.mktemp("ray") / "server.log")
    print(f"ray: 2 replicas up in {time.monotonic() - started:.1f} s")
    try:
        yield server
    finally:  # a test failed before the drain test: stop it gracefully, so its local Ray stops too
        if server.process.poll() is None:
            server.process.send_signal(signal.SIGTERM)
            try:
                server.process.wait(timeout=90)
            except subprocess.TimeoutExpired:
                server.kill()


def _replicas(server: SubprocessServer) -> dict:
    return httpx.get(server.url + "/health/replicas", headers=HEADERS, timeout=10).json()


def _metrics(server: SubprocessServer) -> str:
    return httpx.get(server.url + "/metrics", timeout=10).text


def _per_replica(text: str, name: str) -> list[float]:
    """Each replica's value of `name`, summed over its other labels (0 before its first sample)."""
    _, samples = parse_prometheus(text)
    return [sum(s.value for s in samples if s.name == name and s.labels["replica"] == str(i)) for i in range(2)]


def _chat(client, user: str, max_tokens: int = 2):
    return client.chat.completions.create(model="random", max_tokens=max_tokens, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": user}])


def test_openai_client_through_the_ingress(ray_server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=ray_server.url + "/v1", api_key=API_KEY, max_retries=0)
    chat = client.chat.completions.create(model="random", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, n=2, temperature=0.8, seed=1)
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 8
    chunks = list(client.completions.create(model="random", prompt="stream me", max_tokens=5, stream=True,
                                            temperature=0))
    assert chunks[-1].choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].text for c in chunks)
    whole = client.completions.create(model="random", prompt="stream me", max_tokens=5, temperature=0)
    assert streamed == whole.choices[0].text  # greedy: the same text whichever replica served it
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model="random", prompt="x", max_tokens=10**6)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=ray_server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert _replicas(ray_server)["status"] == "ok"


def test_shared_system_prompt_lands_on_one_replica(ray_server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=ray_server.url + "/v1", api_key=API_KEY, max_retries=0)
    time.sleep(3 * 0.5)  # the ingress polls each replica's metrics twice a second: let earlier tests' settle
    before = _metrics(ray_server)
    for i in range(4):
        _chat(client, f"question {i}")
    done = lambda: sum(_per_replica(_metrics(ray_server), "vllmlite:request_success_total")) \
        == sum(_per_replica(before, "vllmlite:request_success_total")) + 4  # noqa: E731
    assert wait_until(done, timeout=10, interval=0.2)
    after = _metrics(ray_server)
    hits = [a - b for a, b in zip(_per_replica(after, "vllmlite:prefix_cache_hits_total"),
                                  _per_replica(before, "vllmlite:prefix_cache_hits_total"))]
    queries = [a - b for a, b in zip(_per_replica(after, "vllmlite:prefix_cache_queries_total"),
                                     _per_replica(before, "vllmlite:prefix_cache_queries_total"))]
    served = 0 if hits[0] > 0 else 1
    assert hits[served] > 0 and hits[1 - served] == 0 and queries[1 - served] == 0, (hits, queries)


def _prompt_for_replica(replica: int, length: int = 40) -> list[int]:
    """Token ids whose first block's key prefers `replica` (the byte tokenizer's ids are < 259)."""
    for seed in range(1000):
        tokens = [(seed * 7 + i) % 250 + 3 for i in range(length)]
        if preference_order(routing_key(tokens, BLOCK_SIZE), 2)[0] == replica:
            return tokens
    raise AssertionError("no prompt found")


def _get(server: SubprocessServer, path: str) -> httpx.Response:
    return httpx.get(server.url + path, headers=HEADERS, timeout=30)


def test_stats_and_debug_routes_cover_every_replica(ray_server):
    """After the shared-prefix test: its prefix hits show in the summed /v1/stats, and each request is
    traced on the replica that served it."""
    ids = []
    for replica in (0, 1):
        response = httpx.post(ray_server.url + "/v1/completions", headers=HEADERS, timeout=60, json={
            "model": "random", "prompt": _prompt_for_replica(replica), "max_tokens": 3, "ignore_eos": True})
        ids.append(response.json()["id"])
    stats = StatsResponse.model_validate(_get(ray_server, "/v1/stats").json())
    replicas = stats.replicas
    assert [r.replica for r in replicas] == [0, 1] and stats.missing_replicas == []
    assert stats.kv_blocks.total == sum(r.kv_blocks.total for r in replicas) == 2 * 512
    for pick in (lambda s: s.num_running + s.num_waiting, lambda s: s.kv_blocks.cached, lambda s: s.num_preemptions,
                 lambda s: s.prefix_cache.queries, lambda s: s.prefix_cache.hits, lambda s: s.tokens.prompt,
                 lambda s: s.tokens.generation, lambda s: s.requests.finished, lambda s: s.latency.window):
        assert pick(stats) == sum(pick(r) for r in replicas)
    assert stats.prefix_cache.hits > 0 and all(r.requests.finished > 0 for r in replicas)
    assert stats.prefix_cache.hit_rate == pytest.approx(stats.prefix_cache.hits / stats.prefix_cache.queries)
    assert stats.latency.ttft_p90 == max(r.latency.ttft_p90 for r in replicas if r.latency.ttft_p90 is not None)

    listed = RequestList.model_validate(_get(ray_server, "/debug/requests").json())
    assert listed.missing_replicas == [] and {r.replica for r in listed.requests} == {0, 1}
    served_by = {r.request_id: r.replica for r in listed.requests}
    assert [served_by[request_id] for request_id in ids] == [0, 1]
    for replica, request_id in enumerate(ids):
        detail = RequestDetail.model_validate(_get(ray_server, f"/debug/requests/{request_id}").json())
        assert (detail.replica, detail.num_output_tokens, detail.events[-1].event) == (replica, 3, "finished")
    assert _get(ray_server, "/debug/requests/cmpl-unknown").status_code == 404

    engines = ReplicasDebugEngineResponse.model_validate(_get(ray_server, "/debug/engine").json())
    assert [(r.replica, len(r.blocks), r.config["num_blocks"]) for r in engines.replicas] == [(0, 512, 512),
                                                                                            (1, 512, 512)]
    assert all(sum(state in (2, 3) for state in r.blocks) == r.kv_blocks.cached > 0 for r in engines.replicas)
    assert engines.missing_replicas == []


def _long_completion(server: SubprocessServer, prompt: list[int], results: list, max_tokens: int = 3000) -> None:
    body = {"model": "random", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    started = time.monotonic()
    response = httpx.post(server.url + "/v1/completions", json=body, headers=HEADERS, timeout=120)
    results.append((response, time.monotonic() - started))


def test_killed_replica_gives_clean_503_and_service_continues(ray_server):
    import os
    replicas = _replicas(ray_server)["replicas"]
    victim, survivor = replicas[0], replicas[1]
    results: list = []
    max_tokens = 3000
    worker = threading.Thread(target=_long_completion,
                              args=(ray_server, _prompt_for_replica(0), results, max_tokens))
    worker.start()

    def generating_on_the_victim() -> bool:
        """Its request runs on replica 0 and is far from done: a busy machine can take longer to show a
        request in flight than the tiny model takes to finish it, so look at the replica's own count."""
        listed = RequestList.model_validate(_get(ray_server, "/debug/requests").json())
        return any(r.replica == 0 and r.finish_time is None and 0 < r.num_output_tokens < max_tokens // 2
                   for r in listed.requests)

    assert wait_until(generating_on_the_victim, timeout=10, interval=0.05)
    os.kill(victim["pid"], signal.SIGKILL)
    worker.join(timeout=30)
    assert not worker.is_alive(), "the dead replica's request hung"
    response, _ = results[0]
    assert response.status_code == 503 and "replica 0" in response.json()["error"]["message"], \
        (response.status_code, response.text[:300], ray_server.log()[-2000:])
    assert "Retry-After" in response.headers
    # Meanwhile the other replica serves, even prompts whose first choice is the dead one.
    ok = httpx.post(ray_server.url + "/v1/completions", headers=HEADERS, timeout=60,
                    json={"model": "random", "prompt": _prompt_for_replica(0), "max_tokens": 2})
    assert ok.status_code == 200
    report = _replicas(ray_server)
    assert report["status"] in ("degraded", "ok") and report["replicas"][1]["pid"] == survivor["pid"]
    assert httpx.get(ray_server.url + "/health", timeout=10).status_code == 200
    # Ray restarts the replica in a new process, and the ingress routes to it again.
    assert wait_until(lambda: _replicas(ray_server)["status"] == "ok", timeout=120, interval=0.5)
    assert _replicas(ray_server)["replicas"][0]["pid"] != victim["pid"]


def test_sigterm_drains_every_replica_and_exits_zero(ray_server):
    """Last: stops the module's server."""
    results: list = []
    workers = [threading.Thread(target=_long_completion, args=(ray_server, _prompt_for_replica(r), results, 60))
               for r in (0, 1)]
    for worker in workers:
        worker.start()
    assert wait_until(lambda: [r["in_flight_requests"] for r in _replicas(ray_server)["replicas"]] == [1, 1],
                      timeout=10)
    ray_server.process.send_signal(signal.SIGTERM)
    for worker in workers:
        worker.join(timeout=90)
    assert ray_server.process.wait(timeout=90) == 0, ray_server.log()[-3000:]
    assert [r.status_code for r, _ in results] == [200, 200]
    assert all(r.json()["choices"][0]["finish_reason"] == "length" for r, _ in results)
    assert "draining" in ray_server.log()
