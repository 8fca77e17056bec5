"""GET /v1/stats and the /debug/* routes over a live server: off unless enabled (404), behind the API
key (401), the contract's JSON shapes (protocol_debug.py, and the keys of
/work/shared-notes/debug_api_contract.md), counters that agree with the requests sent, and traces
under the ids the API returns."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from server_util import running_server, wait_until

from vllmlite.api.ops.protocol_debug import DebugEngineResponse, RequestDetail, RequestList, StatsResponse

DEBUG_ROUTES = ("/debug/requests", "/debug/requests/chatcmpl-x", "/debug/engine")
STATS_KEYS = {"model", "time", "num_running", "num_waiting", "num_swapped", "kv_blocks", "kv_cache_usage",
              "prefix_cache", "num_preemptions", "tokens", "requests", "latency", "spec_decode"}
SUMMARY_KEYS = {"request_id", "state", "arrival_time", "first_token_time", "finish_time", "ttft", "e2e",
                "num_prompt_tokens", "num_output_tokens", "num_cached_tokens", "num_preemptions", "finish_reason"}
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def debug_server(tiny_model):
    with running_server(tiny_model, enable_debug_endpoints=True, num_blocks=256) as live:
        yield live


@pytest.fixture(scope="module")
def debug_client(debug_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=debug_server.base_url, api_key="unused", max_retries=0, timeout=60)


def get(server, path: str, **kwargs) -> httpx.Response:
    return httpx.get(server.url + path, timeout=30, **kwargs)


def test_debug_routes_are_404_when_not_enabled_and_stats_are_always_served(server):
    for path in DEBUG_ROUTES:
        response = get(server, path)
        assert response.status_code == 404 and response.json()["error"]["code"] == 404
    assert StatsResponse.model_validate(get(server, "/v1/stats").json()).model == "random"


def test_stats_and_debug_routes_need_the_api_key(tiny_model):
    with running_server(tiny_model, api_key="secret", enable_debug_endpoints=True) as live:
        for path in ("/v1/stats", *DEBUG_ROUTES):
            assert get(live, path).status_code == 401, path
            assert get(live, path, headers={"Authorization": "Bearer wrong"}).status_code == 401, path
        ok = {"Authorization": "Bearer secret"}
        assert get(live, "/v1/stats", headers=ok).status_code == 200
        assert get(live, "/debug/requests", headers=ok).status_code == 200
        assert get(live, "/debug/engine", headers=ok).status_code == 200
        assert get(live, "/debug/requests/unknown", headers=ok).status_code == 404


def test_stats_counters_agree_with_the_requests_sent(debug_server, debug_client):
    before = get(debug_server, "/v1/stats").json()
    usages = [debug_client.completions.create(model="random", prompt=f"count me {i}", max_tokens=5 + i, **GREEDY).usage
              for i in range(4)]
    chat = debug_client.chat.completions.create(model="random", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=3, **GREEDY)
    usages.append(chat.usage)
    after = StatsResponse.model_validate(get(debug_server, "/v1/stats").json())
    assert after.tokens.prompt - before["tokens"]["prompt"] == sum(u.prompt_tokens for u in usages)
    assert after.tokens.generation - before["tokens"]["generation"] == sum(u.completion_tokens for u in usages)
    assert after.requests.finished - before["requests"]["finished"] == 5
    assert after.requests.aborted == before["requests"]["aborted"]
    assert (after.num_running, after.num_waiting, after.num_swapped) == (0, 0, 0)
    assert after.kv_blocks.used == 0 and after.kv_blocks.free == after.kv_blocks.total == 256
    assert after.latency.window >= 5 and 0 < after.latency.ttft_p50 <= after.latency.ttft_p90
    assert after.time >= before["time"]


def test_a_chat_completion_is_traced_under_the_id_the_api_returned(debug_server, debug_client):
    chat = debug_client.chat.completions.create(model="random", messages=[{"role": "user", "content": "trace"}],
                                                max_tokens=4, **GREEDY)
    response = get(debug_server, f"/debug/requests/{chat.id}")
    assert response.status_code == 200
    detail = RequestDetail.model_validate(response.json())
    assert set(response.json()) == SUMMARY_KEYS | {"events", "num_dropped_events"}  # no prompt unless asked
    assert detail.request_id == chat.id and detail.state == "finished" and detail.finish_reason == "length"
    assert detail.num_prompt_tokens == chat.usage.prompt_tokens
    assert detail.num_output_tokens == chat.usage.completion_tokens == 4
    events = [e.event for e in detail.events]
    assert events[:3] == ["arrived", "queued", "scheduled"] and events[-1] == "finished"
    assert "first_token" in events and detail.events[-1].reason == "length"
    assert detail.ttft == pytest.approx(detail.first_token_time - detail.arrival_time)
    listed = RequestList.model_validate(get(debug_server, "/debug/requests").json())
    assert chat.id in [r.request_id for r in listed.requests]
    assert all(set(r) == SUMMARY_KEYS for r in get(debug_server, "/debug/requests").json()["requests"])


def test_each_prompt_of_a_completion_has_its_own_trace_and_n_samples_share_one(debug_server, debug_client):
    completion = debug_client.completions.create(model="random", prompt=["one", "two"], max_tokens=3, n=2,
                                                 temperature=1.0, seed=1, extra_body={"ignore_eos": True})
    for i in range(2):
        detail = get(debug_server, f"/debug/requests/{completion.id}-{i}").json()
        assert detail["state"] == "finished" and detail["num_output_tokens"] == 2 * 3
    assert get(debug_server, f"/debug/requests/{completion.id}").status_code == 404


def test_a_client_disconnect_is_recorded_as_an_abort(debug_server):
    body = {"model": "random", "prompt": "leaving " * 5, "max_tokens": 3000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", debug_server.base_url + "/completions", json=body, timeout=60) as response:
        first = next(response.iter_lines())
        request_id = json.loads(first.removeprefix("data: "))["id"]
    assert wait_until(debug_server.is_idle, timeout=30)

    def aborted() -> bool:
        return get(debug_server, f"/debug/requests/{request_id}").json()["state"] == "aborted"
    assert wait_until(aborted, timeout=10)
    detail = get(debug_server, f"/debug/requests/{request_id}").json()
    assert detail["events"][-1] == {"time": detail["finish_time"], "event": "aborted", "why": "client disconnected"}
    assert detail["finish_reason"] == "abort"
    assert get(debug_server, "/v1/stats").json()["requests"]["aborted"] >= 1


def test_debug_engine_shows_block_states_steps_and_config(debug_server, debug_client):
    debug_client.completions.create(model="random", prompt="blocks " * 8, max_tokens=4, **GREEDY)
    payload = get(debug_server, "/debug/engine").json()
    engine = DebugEngineResponse.model_validate(payload)
    assert set(payload) == STATS_KEYS | {"blocks", "recent_steps", "chunking", "config"}
    assert (engine.chunking.policy, engine.chunking.prefill_budget) == ("fixed", 256)
    assert engine.chunking.step_time_model.num_observations >= len(engine.recent_steps)
    assert len(engine.blocks) == engine.kv_blocks.total
    assert sum(state in (1, 3) for state in engine.blocks) == engine.kv_blocks.used == 0
    assert sum(state in (2, 3) for state in engine.blocks) == engine.kv_blocks.cached > 0
    assert 0 < len(engine.recent_steps) <= 256 and engine.recent_steps[-1].num_requests >= 1
    times = [s.time for s in engine.recent_steps]
    assert times == sorted(times)
    config = engine.config
    assert (config["model"], config["block_size"], config["num_blocks"]) == ("random", 16, 256)
    assert config["enable_prefix_caching"] is True and config["max_num_batched_tokens"] == 256
    assert json.loads(json.dumps(config)) == config


def test_prompts_appear_only_with_debug_store_prompts(tiny_model):
    with running_server(tiny_model, enable_debug_endpoints=True, debug_store_prompts=True) as live:
        client = openai.OpenAI(base_url=live.base_url, api_key="unused", max_retries=0, timeout=60)
        completion = client.completions.create(model="random", prompt="remember me", max_tokens=2, **GREEDY)
        detail = get(live, f"/debug/requests/{completion.id}").json()
        assert detail["prompt"] == "<|bos|>remember me"  # the prompt tokens as the model saw them
        assert get(live, "/debug/requests").json()["requests"][0]["prompt"] == detail["prompt"]


def test_stats_shapes_when_tracing_is_off(tiny_model):
    with running_server(tiny_model, enable_debug_endpoints=True, trace_ring_size=0) as live:
        client = openai.OpenAI(base_url=live.base_url, api_key="unused", max_retries=0, timeout=60)
        client.completions.create(model="random", prompt="untraced", max_tokens=2, **GREEDY)
        stats = StatsResponse.model_validate(get(live, "/v1/stats").json())
        assert stats.latency.window == 0 and stats.latency.ttft_p50 is None and stats.tokens.generation == 2
        assert get(live, "/debug/requests").json() == {"requests": []}
        assert DebugEngineResponse.model_validate(get(live, "/debug/engine").json()).recent_steps == []


def test_a_request_timeout_is_recorded_as_an_abort_for_timeout(tiny_model):
    with running_server(tiny_model, enable_debug_endpoints=True, request_timeout=0.3) as live:
        body = {"model": "random", "prompt": "slow", "max_tokens": 3000, "ignore_eos": True}
        response = httpx.post(live.base_url + "/completions", json=body, timeout=60)
        assert response.status_code == 504
        assert wait_until(live.is_idle, timeout=30)

        def aborted_traces() -> list[dict]:
            return [r for r in get(live, "/debug/requests").json()["requests"] if r["state"] == "aborted"]
        assert wait_until(lambda: len(aborted_traces()) == 1, timeout=10)
        detail = get(live, f"/debug/requests/{aborted_traces()[0]['request_id']}").json()
        assert detail["events"][-1]["why"] == "timeout"
