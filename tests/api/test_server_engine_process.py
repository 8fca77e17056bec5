"""The server with its engine in a process of its own (--engine-process): the same answers as the engine
thread, aborts that reach the engine process, the metrics and debug routes fed across the pipe, and an
engine process killed under load: 503s that say why, streams that end in an error, a server that stays up;
and the CLI's server, whose SIGTERM drains and stops its engine process too."""

from __future__ import annotations

import json
import os
import signal

import httpx
import openai
import pytest
from server_util import (
    SubprocessServer,
    engine_processes,
    is_running,
    metric_value,
    num_aborted,
    running_server,
    wait_until,
)

MODEL = "random"
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True, "return_token_ids": True}}
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.fixture(scope="module")
def process_server(tiny_model):
    with running_server(tiny_model, engine_process=True, enable_debug_endpoints=True) as live:
        yield live


@pytest.fixture(scope="module")
def thread_server(tiny_model):
    with running_server(tiny_model) as live:
        yield live


def openai_client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.base_url, api_key="unused", max_retries=0, timeout=60)


def answers(client: openai.OpenAI) -> list:
    """(text, token ids) of completions and chat, whole and streamed, a prompt list and a JSON schema."""
    messages = [{"role": "user", "content": "Name a number."}]
    whole = client.completions.create(model=MODEL, prompt=["Hello there", "abc" * 9], max_tokens=12, **GREEDY)
    streamed = client.completions.create(model=MODEL, prompt="stream me", max_tokens=12, stream=True, **GREEDY)
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, **GREEDY)
    chat_streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, stream=True,
                                                   **GREEDY)
    constrained = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}})
    chunks = list(streamed)
    chat_chunks = [c for c in chat_streamed if c.choices]
    return [[(c.text, c.token_ids) for c in whole.choices],
            ("".join(c.choices[0].text for c in chunks if c.choices),
             [t for c in chunks if c.choices for t in c.choices[0].token_ids or []]),
            (chat.choices[0].message.content, chat.choices[0].token_ids),
            "".join(c.choices[0].delta.content or "" for c in chat_chunks),
            constrained.choices[0].message.content]


def test_the_engine_process_answers_as_the_engine_thread_does(process_server, thread_server):
    from_process, from_thread = answers(openai_client(process_server)), answers(openai_client(thread_server))
    assert from_process == from_thread
    assert len(from_process[0][0][1]) == 12 and from_process[1][0]  # greedy ids, and a streamed text
    assert process_server.engine.pid != os.getpid()


def test_metrics_count_requests_served_by_the_engine_process(process_server):
    before = httpx.get(process_server.url + "/metrics").text
    client = openai_client(process_server)
    # Not streamed, the outputs before the last reach the metrics as their progress only.
    client.completions.create(model=MODEL, prompt="count me", max_tokens=7, **GREEDY)
    list(client.completions.create(model=MODEL, prompt="count me", max_tokens=7, stream=True, **GREEDY))
    after = httpx.get(process_server.url + "/metrics").text

    def grew(name: str, **labels: str) -> float:
        return metric_value(after, name, **labels) - metric_value(before, name, **labels)

    assert grew("vllmlite:generation_tokens_total") == 14
    assert grew("vllmlite:request_success_total", finished_reason="length") == 2
    assert grew("vllmlite:time_to_first_token_seconds_count") == 2
    assert grew("vllmlite:inter_token_latency_seconds_count") == 12
    assert grew("vllmlite:prompt_tokens_total") == 2 * (len("count me") + 1)


def test_stats_and_debug_routes_read_the_engine_process(process_server):
    stats = httpx.get(process_server.url + "/v1/stats").json()
    assert stats["model"] == MODEL and stats["kv_blocks"]["total"] == 1024
    assert stats["requests"]["finished"] >= 1  # the front end's totals beside the process's numbers
    engine = httpx.get(process_server.url + "/debug/engine").json()
    assert engine["config"]["num_blocks"] == 1024 and len(engine["blocks"]) == 1024
    traced = httpx.get(process_server.url + "/debug/requests").json()["requests"]
    assert traced and all(t["state"] == "finished" for t in traced)
    one = httpx.get(f"{process_server.url}/debug/requests/{traced[0]['request_id']}").json()
    assert one["events"][0]["event"] == "arrived" and one["state"] == "finished"
    assert httpx.get(process_server.url + "/debug/requests/nope").status_code == 404


def test_a_client_that_disconnects_aborts_its_request_in_the_engine_process(process_server):
    aborted_before = num_aborted(httpx.get(process_server.url + "/metrics").text)
    body = {"model": MODEL, "prompt": "a long one", "max_tokens": 3000, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", process_server.url + "/v1/completions", json=body, timeout=60) as response:
        first = next(line for line in response.iter_lines() if line.startswith("data: "))
    request_id = json.loads(first[len("data: "):])["id"]

    def trace() -> dict:
        return httpx.get(f"{process_server.url}/debug/requests/{request_id}").json()

    assert wait_until(lambda: trace()["state"] == "aborted", 10), trace()
    assert trace()["num_output_tokens"] < 3000
    assert any(e["event"] == "aborted" and e.get("why") == "client disconnected" for e in trace()["events"])
    assert wait_until(process_server.is_idle, 10)
    assert num_aborted(httpx.get(process_server.url + "/metrics").text) == aborted_before + 1


def test_a_killed_engine_process_makes_health_503_and_ends_open_streams(tiny_model):
    with running_server(tiny_model, engine_process=True, stream_ping_interval=0) as live:  # no pings: a stream
        body = {"model": MODEL, "prompt": "in flight", "max_tokens": 3000, "temperature": 0,  # left open times out
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=20) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            os.kill(live.engine.pid, signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][len("data: "):])["error"]
        assert error["code"] == 503 and "SIGKILL" in error["message"]
        health = httpx.get(live.url + "/health")
        assert health.status_code == 503
        assert health.json()["error"]["message"] == "the engine process has died: it was killed by SIGKILL (out of memory?)"
        refused = httpx.post(live.url + "/v1/completions", json={"model": MODEL, "prompt": "new", "max_tokens": 2})
        assert refused.status_code == 503 and "SIGKILL" in refused.json()["error"]["message"]
        assert httpx.get(live.url + "/v1/models").status_code == 200  # the server itself stays up


def test_the_cli_server_runs_an_engine_process_that_its_sigterm_stops(tmp_path):
    server = SubprocessServer(["--model", "random", "--dtype", "float64", "--num-blocks", "256", "--engine-process",
                               "--log-level", "info"])
    server.start(tmp_path / "server.log")
    try:
        (engine,) = engine_processes(server.process.pid)
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=30) == 0
        assert wait_until(lambda: not is_running(engine), 10), "the engine process outlived the server"
    finally:
        server.kill()
    log = server.log()
    assert "[engine process]" in log and "Traceback" not in log and "the engine is dead" not in log, log
