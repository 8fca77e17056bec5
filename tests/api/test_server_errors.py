"""Every error path of the server answers in OpenAI's shape with docs/architecture.md's status, and the server
keeps serving afterwards: 400, 401, 404, 413, 500 (one request), 503 (queue full, draining, dead),
504 (request timeout), and SIGTERM's graceful drain."""

from __future__ import annotations

import json
import signal

import httpx
import openai
import pytest
from server_util import SubprocessServer, fault_on, metric_value, num_aborted, running_server, wait_until

MODEL = "random"
MARKER = "@@FAULT@@"


@pytest.fixture(scope="module")
def server(tiny_model):
    with running_server(tiny_model, max_body_bytes=4096) as live:
        yield live


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def assert_openai_error(response: httpx.Response, status: int, param=None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


BAD_COMPLETIONS = [
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": "x", "stream": 1}, "stream"),
    ({"prompt": "x", "n": 100}, "n"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "x", "stop": ["s"] * 17}, "stop"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias"),
    ({"prompt": "x", "stop_token_ids": [1 << 30]}, "stop_token_ids"),
    ({"prompt": "x", "min_tokens": 10, "max_tokens": 5}, "min_tokens"),
    ({"prompt": "x", "best_of": 1, "n": 2}, "best_of"),
    ({"prompt": "x", "best_of": 3, "stream": True}, "best_of"),
    ({"prompt": "x", "suffix": "tail"}, "suffix"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": "", "add_special_tokens": False}, "prompt"),  # no BOS: nothing left to run on
    ({"prompt": "x", "guided_json": {"type": "object", "properties": 5}}, "guided_json"),
    ({"prompt": "x", "guided_json": "{not json"}, "guided_json"),
    ({"prompt": "x", "guided_choice": []}, "guided_choice"),
    ({"prompt": "x", "guided_regex": "(a+"}, "guided_regex"),
    ({"prompt": "x", "guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"prompt": "x", "guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"prompt": "x", "structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs"),
    ({"prompt": "x", "structured_outputs": {"choice": ["a"], "backend": "xgrammar"}}, "structured_outputs.backend"),
    ({"prompt": "x", "structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
    ({"prompt": "x", "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"prompt": "x", "response_format": {"type": "yaml"}}, "response_format.type"),
    ({"prompt": "x", "response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"prompt": [300]}, "prompt"),
    ({"prompt": ["x"] * 65}, "prompt"),
    ({"prompt": ["x"] * 20, "n": 16}, "n"),
    ({}, "prompt"),
    ({"prompt": "x" * 100, "max_tokens": 4090}, "prompt"),
]


@pytest.mark.parametrize("body,param", BAD_COMPLETIONS)
def test_bad_completion_fields_are_400_naming_the_param(server, body, param):
    assert_openai_error(httpx.post(server.base_url + "/completions", json=body), 400, param)


USER = [{"role": "user", "content": "hi"}]
BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user"}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages.0.tool_calls"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "c1", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages.0.tool_calls"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages.0.content"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
     "tools.0.function.parameters"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools"),
    ({"messages": USER, "tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"messages": USER, "tool_choice": "auto"}, "tool_choice"),
    ({"messages": USER, "tool_choice": "always", "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tool_choice"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice.function.name"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                                        "function": {"name": "f"}}]}]}, "messages.0.tool_calls.0.function.arguments"),
    ({"messages": USER, "functions": [{"name": "f"}]}, "functions"),
    ({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"messages": USER, "chat_template": "{{ 7 * 7 }}"}, "chat_template"),
    ({"messages": USER, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": USER, "add_generation_prompt": "yes"}, "add_generation_prompt"),
    ({"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": USER, "max_completion_tokens": 5000}, "messages"),
    ({"messages": USER, "modalities": ["text", "audio"]}, "modalities"),
    ({"messages": USER, "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"messages": USER, "web_search_options": {}}, "web_search_options"),
    ({"messages": USER, "n": 17}, "n"),
]


@pytest.mark.parametrize("body,param", BAD_CHATS)
def test_bad_chat_fields_are_400_naming_the_param(server, body, param):
    assert_openai_error(httpx.post(server.base_url + "/chat/completions", json=body), 400, param)


def test_malformed_bodies_are_400(server):
    url = server.base_url + "/completions"
    as_json = {"Content-Type": "application/json"}  # without it every body is a 415 (test_safe_defaults.py)
    for body in (b"{not json", b"[1, 2]", b"[" * 1000 + b"]" * 1000, b""):
        assert_openai_error(httpx.post(url, content=body, headers=as_json), 400)


def test_openai_client_raises_bad_request_and_the_server_keeps_serving(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body={"suffix": "s"})
    assert caught.value.status_code == 400 and caught.value.body["param"] == "suffix"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=USER, tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": 3}}}])
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].text is not None


def test_unknown_model_and_route_are_404(server, client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert caught.value.body["type"] == "not_found_error" and caught.value.body["param"] == "model"
    error = assert_openai_error(httpx.get(server.url + "/v1/nothing"), 404)
    assert error["type"] == "not_found_error"
    assert_openai_error(httpx.get(server.base_url + "/completions"), 405)


def test_body_over_the_limit_is_413_by_header_and_by_counted_bytes(server):
    url = server.base_url + "/completions"
    body = json.dumps({"prompt": "x" * 5000}).encode()
    assert_openai_error(httpx.post(url, content=body), 413)

    def chunked():  # no Content-Length: the server must count what arrives
        for i in range(0, len(body), 1000):
            yield body[i:i + 1000]

    assert_openai_error(httpx.post(url, content=chunked()), 413)
    assert httpx.post(url, json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_engine_fault_fails_only_that_request(server, client):
    server.engine.engine.runner.fault_hook = fault_on(MARKER)
    try:
        with pytest.raises(openai.InternalServerError) as caught:
            client.completions.create(model=MODEL, prompt=f"boom {MARKER}", max_tokens=4)
        assert caught.value.status_code == 500 and "injected fault" in caught.value.body["message"]
        body = {"prompt": f"boom {MARKER}", "max_tokens": 4, "stream": True}
        events = httpx.post(server.base_url + "/completions", json=body, timeout=60).text.split("\n\n")
        assert "injected fault" in json.loads(events[-3][len("data: "):])["error"]["message"]
        assert events[-2] == "data: [DONE]"
        assert len(client.completions.create(model=MODEL, prompt="fine", max_tokens=3).choices[0].text) > 0
    finally:
        server.engine.engine.runner.fault_hook = None
    assert wait_until(server.is_idle)
    assert httpx.get(server.url + "/health").status_code == 200


def test_api_key_is_required_except_for_health_metrics_and_version(tiny_model):
    with running_server(tiny_model, api_key="s3cret") as live:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=live.base_url, api_key="wrong", max_retries=0).models.list()
        assert_openai_error(httpx.post(live.base_url + "/completions", json={"prompt": "x"}), 401)
        for path in ("/tokenize", "/detokenize", "/openapi.json", "/docs"):
            assert httpx.request("POST" if "tokenize" in path else "GET", live.url + path).status_code == 401, path
        for path in ("/health", "/metrics", "/version"):  # open, as in vLLM
            assert httpx.get(live.url + path).status_code == 200, path
        good = openai.OpenAI(base_url=live.base_url, api_key="s3cret", max_retries=0, timeout=60)
        assert good.completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens == 2
        # The scheme is case-insensitive, the key is not; a key without a scheme is no key.
        for header, status in (("bearer s3cret", 200), ("BEARER s3cret", 200), ("Bearer S3CRET", 401),
                               ("s3cret", 401), ("Basic s3cret", 401), ("Bearer", 401)):
            response = httpx.get(live.base_url + "/models", headers={"Authorization": header})
            assert response.status_code == status, header


def test_api_key_on_metrics_leaves_only_health_open(tiny_model):
    with running_server(tiny_model, api_key="s3cret", api_key_on_metrics=True) as live:
        assert httpx.get(live.url + "/health").status_code == 200
        for path in ("/metrics", "/version"):
            assert_openai_error(httpx.get(live.url + path), 401)
            assert httpx.get(live.url + path, headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_health_and_metrics_answer_head_and_models_reveal_no_file_path(server):
    head = httpx.head(server.url + "/health")
    assert head.status_code == 200 and head.content == b""
    head = httpx.head(server.url + "/metrics")  # scrapers' probes
    get = httpx.get(server.url + "/metrics")
    assert head.status_code == 200 and head.content == b"" and head.headers["content-type"] == get.headers["content-type"]
    card = httpx.get(server.base_url + "/models").json()["data"][0]
    assert card["root"] == card["id"] == MODEL


def test_full_queue_is_503_with_retry_after(tiny_model):
    with running_server(tiny_model, max_queue=1, max_num_seqs=1) as live:
        long = {"model": MODEL, "prompt": "long", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", live.base_url + "/completions", json=long, timeout=60) as running:
            chunks = running.iter_bytes()  # kept referenced: a collected iterator closes the stream
            next(chunks)  # admitted and running
            with httpx.stream("POST", live.base_url + "/completions", json=long, timeout=60) as waiting:
                assert wait_until(lambda: metric_value(httpx.get(live.url + "/metrics").text,
                                                       "vllmlite:num_requests_waiting") == 1)
                client = openai.OpenAI(base_url=live.base_url, api_key="x", max_retries=0)
                with pytest.raises(openai.APIStatusError) as caught:
                    client.completions.create(model=MODEL, prompt="one too many", max_tokens=2)
                assert caught.value.status_code == 503
                assert caught.value.response.headers["Retry-After"] == "1"
                assert waiting.status_code == 200
        assert wait_until(live.is_idle)


def test_more_prompts_than_the_queue_holds_is_a_400_not_a_503(tiny_model):
    # Retrying could never help such a request: it is the client's error, not an overload.
    with running_server(tiny_model, max_queue=2) as live:
        embeddings = httpx.post(live.base_url + "/embeddings", json={"input": ["a", "b", "c"]})
        completions = httpx.post(live.base_url + "/completions", json={"prompt": [[1], [2], [3]], "max_tokens": 1})
        assert_openai_error(embeddings, 400, param="input")
        assert_openai_error(completions, 400, param="prompt")
        assert httpx.post(live.base_url + "/embeddings", json={"input": ["a", "b"]}).status_code == 200
        assert wait_until(live.is_idle)


def test_draining_server_is_503_with_retry_after(tiny_model):
    with running_server(tiny_model) as live:
        live.engine.begin_draining()
        response = httpx.post(live.base_url + "/completions", json={"prompt": "x", "max_tokens": 2})
        assert_openai_error(response, 503)
        assert response.headers["retry-after"] == "1"
        assert_openai_error(httpx.get(live.url + "/health"), 503)


def test_dead_engine_loop_fails_requests_and_health(tiny_model):
    with running_server(tiny_model) as live:
        def broken_step():
            raise RuntimeError("the loop itself broke")

        live.engine.engine.step = broken_step
        response = httpx.post(live.base_url + "/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
        assert_openai_error(response, 503)
        assert wait_until(lambda: live.engine.is_dead)
        assert "broke" in assert_openai_error(httpx.get(live.url + "/health"), 503)["message"]


def test_request_past_the_timeout_is_aborted_with_an_error(tiny_model):
    with running_server(tiny_model, request_timeout=0.3) as live:
        body = {"prompt": "slow", "max_tokens": 4000, "ignore_eos": True}
        response = httpx.post(live.base_url + "/completions", json=body, timeout=60)
        assert "timeout" in assert_openai_error(response, 504)["message"]
        # The 504 is sent after the request was cancelled: at most the step in flight runs after it
        # (the snapshot may be a step old), far from the ~4000 steps it would take to finish alone.
        num_passes = live.engine.get_stats().num_forward_passes
        assert wait_until(live.is_idle)
        assert live.engine.get_stats().num_forward_passes <= num_passes + 1
        assert num_aborted(httpx.get(live.url + "/metrics").text) == 1


def test_sigterm_lets_the_in_flight_request_finish_and_exits_zero(tmp_path):
    server = SubprocessServer(["--model", "random", "--dtype", "float64", "--num-blocks", "512",
                               "--log-level", "info"], env={"VLLMLITE_SHUTDOWN_TIMEOUT": "60"})
    server.start(tmp_path / "server.log")
    try:
        body = {"prompt": "in flight", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            events.append(next(lines))
            server.process.send_signal(signal.SIGTERM)
            events.extend(lines)
        assert server.process.wait(timeout=60) == 0, server.log()
    finally:
        server.kill()
    data = [e[len("data: "):] for e in events if e.startswith("data: ")]
    assert data[-1] == "[DONE]"
    finishes = [c["finish_reason"] for e in data[:-1] for c in json.loads(e)["choices"]]
    assert finishes[-1] == "length" and "draining" in server.log()


def test_prompt_larger_than_the_kv_cache_is_a_400(tiny_model):
    with running_server(tiny_model, num_blocks=4, block_size=4) as live:   # 16 slots: 15 prompt tokens
        for stream in (False, True):
            body = {"model": MODEL, "prompt": "x" * 40, "max_tokens": 2, "stream": stream}
            error = assert_openai_error(httpx.post(live.base_url + "/completions", json=body, timeout=60), 400)
            assert "KV cache holds at most 15 prompt tokens" in error["message"]
        ok = {"model": MODEL, "prompt": "x" * 5, "max_tokens": 2}
        assert httpx.post(live.base_url + "/completions", json=ok, timeout=60).status_code == 200
        assert wait_until(lambda: live.engine.engine.get_stats().scheduler.num_kv_blocks_used == 0)
