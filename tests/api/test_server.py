"""The OpenAI-compatible server, end to end: the official `openai` client against a live uvicorn."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from conftest import greedy, run_to_completion
from server_util import metric_value, parse_prometheus, running_server, wait_until
from server_util import num_aborted as count_aborted

from vllmlite.api.cli import OPTIONS, build_parser, parse_config
from vllmlite.config import CacheConfig, EngineConfig
from vllmlite.engine.llm_engine import LLMEngine

MODEL = "random"
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


def offline_greedy(tiny_model, prompts: list[str], max_tokens: int) -> list[str]:
    """The offline engine's greedy texts for `prompts` (encoded as the server encodes them)."""
    engine = LLMEngine(EngineConfig(model=MODEL, dtype="float64", cache=CacheConfig(num_blocks=1024)), tiny_model)
    requests = [(engine.tokenizer.encode(p), greedy(max_tokens)) for p in prompts]
    return [r.outputs[0].text for r in run_to_completion(engine, requests)]


def sse_events(raw: bytes) -> list[str]:
    """Split a raw SSE body, checking the framing: every event is exactly `data: <payload>\\n\\n`."""
    text = raw.decode("utf-8")
    assert text.endswith("\n\n")
    events = text[:-2].split("\n\n")
    for event in events:
        assert event.startswith("data: ") and "\n" not in event, repr(event)
    return [event[len("data: "):] for event in events]


def test_completion_matches_offline_greedy(client, tiny_model):
    result = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=10, **GREEDY)
    assert result.object == "text_completion" and result.model == MODEL
    assert result.choices[0].text == offline_greedy(tiny_model, ["Hello there"], 10)[0]
    assert result.choices[0].finish_reason == "length"
    assert result.usage.prompt_tokens == len("Hello there") + 1  # byte tokens plus BOS
    assert result.usage.completion_tokens == 10
    assert result.usage.total_tokens == result.usage.prompt_tokens + 10


def test_chat_completion_returns_an_assistant_message(client):
    result = client.chat.completions.create(model=MODEL, messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
    ], max_completion_tokens=6, **GREEDY)
    choice = result.choices[0]
    assert result.object == "chat.completion"
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length" and result.usage.completion_tokens == 6


def test_streaming_completion_with_usage_equals_the_whole_response(client):
    whole = client.completions.create(model=MODEL, prompt="stream me", max_tokens=12, **GREEDY)
    chunks = list(client.completions.create(model=MODEL, prompt="stream me", max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_streaming_chat_sends_role_first_and_finish_reason_last(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=8, stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    assert chunks[-1].usage.completion_tokens == 8


def test_n2_returns_two_indexed_choices(client):
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=2,
                                          max_tokens=5, temperature=1.0, seed=3)
    assert sorted(c.index for c in chat.choices) == [0, 1]
    assert chat.usage.completion_tokens == 10
    completion = client.completions.create(model=MODEL, prompt=["a", "b"], n=2, max_tokens=4, **GREEDY)
    assert [c.index for c in completion.choices] == [0, 1, 2, 3]
    # Greedy samples of one prompt agree; index = prompt_index * n + sample.
    assert completion.choices[0].text == completion.choices[1].text
    assert completion.choices[2].text == completion.choices[3].text
    solo = client.completions.create(model=MODEL, prompt="b", max_tokens=4, **GREEDY)
    assert completion.choices[2].text == solo.choices[0].text


def test_token_id_prompts_and_echo(client):
    by_text = client.completions.create(model=MODEL, prompt="abc", max_tokens=4, echo=True, **GREEDY)
    by_ids = client.completions.create(model=MODEL, prompt=[256, 97, 98, 99], max_tokens=4, **GREEDY)
    assert by_text.choices[0].text == "abc" + by_ids.choices[0].text


def test_completion_logprobs_format(client):
    result = client.completions.create(model=MODEL, prompt="logprobs", max_tokens=5, logprobs=3, **GREEDY)
    logprobs = result.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    assert len(logprobs.text_offset) == 5 and logprobs.text_offset == sorted(logprobs.text_offset)
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert value <= 0.0 and 3 <= len(top) <= 4 and token in top
        assert value == pytest.approx(max(top.values()))  # greedy: the sampled token is the best


def test_chat_logprobs_format(client):
    result = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=4, logprobs=True, top_logprobs=2, **GREEDY)
    content = result.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert entry.logprob <= 0.0 and isinstance(entry.bytes, list) and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)


def test_stop_string_truncates_the_text(client):
    full = client.completions.create(model=MODEL, prompt="stop test", max_tokens=16, **GREEDY).choices[0].text
    position = next(i for i, ch in enumerate(full) if i > 0 and ch.isascii() and ch.isprintable())
    stopped = client.completions.create(model=MODEL, prompt="stop test", max_tokens=16, stop=[full[position]],
                                        **GREEDY).choices[0]
    assert stopped.text == full[:full.index(full[position])]
    assert stopped.finish_reason == "stop"


def test_seeded_sampling_is_reproducible_and_seed_dependent(client):
    def sample(seed: int) -> str:
        return client.completions.create(model=MODEL, prompt="seed", max_tokens=16, temperature=1.0,
                                         seed=seed).choices[0].text
    assert sample(42) == sample(42)
    assert sample(1) != sample(2)


def test_best_of_returns_n_choices(client):
    result = client.completions.create(model=MODEL, prompt="best", max_tokens=4, n=1, best_of=3, seed=0)
    assert len(result.choices) == 1 and result.choices[0].index == 0


def test_prompt_tokens_details_are_null_without_the_flag(client):
    """As vLLM without --enable-prompt-tokens-details (tests/api/test_server_dropin.py has the flag)."""
    prompt = "a shared system prompt that spans several blocks of sixteen tokens each, " * 2
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, **GREEDY)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, **GREEDY)
    assert again.usage.prompt_tokens_details is None


def test_models_version_tokenize_detokenize(server, client):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(server.url + "/version").json()["version"]
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": "hé"}).json()
    assert tokens == {"tokens": [256, 104, 195, 169], "count": 4, "max_model_len": 4096}
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "x"}]}).json()
    assert chat["count"] == len(chat["tokens"]) > 1
    assert httpx.post(server.url + "/detokenize", json={"tokens": [104, 195, 169]}).json() == {"prompt": "hé", "content": "hé"}
    assert httpx.get(server.url + "/health").status_code == 200


def test_sse_framing_on_raw_bytes(server):
    body = {"model": MODEL, "prompt": "raw", "max_tokens": 5, "stream": True, "temperature": 0}
    completion = sse_events(httpx.post(server.base_url + "/completions", json=body, timeout=60).content)
    assert completion[-1] == "[DONE]"
    assert all(json.loads(e)["object"] == "text_completion" for e in completion[:-1])
    chat_body = {"messages": [{"role": "user", "content": "raw"}], "max_tokens": 5, "stream": True, "n": 2}
    response = httpx.post(server.base_url + "/chat/completions", json=chat_body, timeout=60)
    assert response.headers["content-type"].startswith("text/event-stream")
    chat = sse_events(response.content)
    assert chat[-1] == "[DONE]"
    first = [json.loads(e) for e in chat[:2]]
    assert [c["choices"][0]["delta"] for c in first] == [{"role": "assistant", "content": ""}] * 2
    finishes = [c for e in chat[2:-1] for c in json.loads(e)["choices"] if c["finish_reason"]]
    assert sorted(c["index"] for c in finishes) == [0, 1]


def num_aborted(server) -> float:
    return count_aborted(httpx.get(server.url + "/metrics").text)


def test_client_disconnect_mid_stream_frees_every_block(server):
    body = {"model": MODEL, "prompt": "disconnect " * 10, "max_tokens": 3000, "stream": True,
            "ignore_eos": True}
    aborted = num_aborted(server)
    with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=60) as response:
        chunks = response.iter_bytes()
        next(chunks)
        assert server.engine.num_unfinished_requests == 1
        chunks.close()
        num_passes = server.engine.get_stats().num_forward_passes
    assert wait_until(server.is_idle, timeout=30)
    metrics = httpx.get(server.url + "/metrics").text
    assert metric_value(metrics, "vllmlite:kv_cache_usage_perc") == 0.0
    assert num_aborted(server) == aborted + 1
    # Aborted when the server noticed the client gone, not after running its 3000 steps alone.
    assert server.engine.get_stats().num_forward_passes - num_passes < 1000


def test_client_disconnect_while_waiting_for_a_whole_response_aborts_it(server):
    body = {"model": MODEL, "prompt": "patience", "max_tokens": 4000, "ignore_eos": True}
    aborted = num_aborted(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/completions", json=body, timeout=httpx.Timeout(60, read=0.3))
    num_passes = server.engine.get_stats().num_forward_passes
    assert wait_until(server.is_idle, timeout=30)
    assert num_aborted(server) == aborted + 1
    assert server.engine.get_stats().num_forward_passes - num_passes < 1000  # not its 4000 steps


def test_twenty_concurrent_streaming_clients_match_offline_greedy(server, tiny_model):
    prompts = [f"client {i}: " + "xyz"[i % 3] * (i + 1) for i in range(20)]
    expected = offline_greedy(tiny_model, prompts, 12)

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, stream=True, **GREEDY)
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    assert asyncio.run(main()) == expected
    assert wait_until(server.is_idle, timeout=30)


def test_metrics_parse_and_count_requests(server, client):
    before = metric_value(httpx.get(server.url + "/metrics").text, "vllmlite:e2e_request_latency_seconds_count")
    client.completions.create(model=MODEL, prompt="count me", max_tokens=3, **GREEDY)
    text = httpx.get(server.url + "/metrics").text
    types, _ = parse_prometheus(text)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert types["vllmlite:" + name] == "gauge"
    for name in ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens",
                 "generation_tokens", "request_success"):
        assert types[f"vllmlite:{name}_total"] == "counter"
    for name in ("time_to_first_token", "inter_token_latency", "e2e_request_latency"):
        assert types[f"vllmlite:{name}_seconds"] == "histogram"
    assert metric_value(text, "vllmlite:e2e_request_latency_seconds_count") == before + 1
    assert metric_value(text, "vllmlite:request_success_total", finished_reason="length") >= 1
    assert metric_value(text, "vllmlite:generation_tokens_total") >= 3


@pytest.mark.real_model
def test_real_model_chat_answers_in_english():
    from vllmlite.models.loader import load_model

    loaded = load_model("default", "float32", 0)
    with running_server(loaded, model="default", dtype="float32", num_blocks=256) as live:
        client = openai.OpenAI(base_url=live.base_url, api_key="x", max_retries=0, timeout=120)
        result = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", max_tokens=24, temperature=0,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
    text = result.choices[0].message.content
    letters = [ch for ch in text if ch.isalpha()]
    assert len(letters) >= 5 and all(ch.isascii() for ch in letters), text
    assert len(set(text.lower().split()) & {"the", "is", "of", "paris", "a", "capital", "france"}) >= 1, text


def test_cli_flags_win_over_environment_variables(capsys):
    environ = {"VLLMLITE_PORT": "9001", "VLLMLITE_KV_CACHE_MEMORY": "512M", "VLLMLITE_MODEL": "random",
               "VLLMLITE_ENABLE_PREFIX_CACHING": "false", "VLLMLITE_API_KEY": "k"}
    config = parse_config(["--port", "9002", "--max-body-bytes", "1K"], environ)
    assert (config.port, config.kv_cache_memory, config.max_body_bytes) == (9002, 512 << 20, 1024)
    assert config.enable_prefix_caching is False and config.api_key == "k" and config.model_name == "random"
    assert parse_config(["--enable-prefix-caching"], environ).enable_prefix_caching is True
    assert parse_config([], {}).model_name == "SmolLM2-135M-Instruct"
    assert parse_config([], {"VLLMLITE_KERNELS": "numpy"}).create_engine_config().kernels == "numpy"
    assert parse_config(["--kernels", "numba"], {"VLLMLITE_KERNELS": "numpy"}).create_engine_config().kernels == "numba"
    for argv, env in ((["--block-size", "0"], {}), ([], {"VLLMLITE_PORT": "eighty"}), (["--dtype", "int8"], {}),
                      (["--kernels", "cuda"], {})):
        with pytest.raises(SystemExit):
            parse_config(argv, env)
    assert "VLLMLITE_PORT" in capsys.readouterr().err
    help_text = build_parser().format_help()
    for option in OPTIONS:
        assert f"--{option.name}" in help_text and option.env in help_text.replace("\n", " ").replace(" ", "")


def test_echo_with_logprobs_scores_the_prompt_tokens_too(server):
    import httpx
    body = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 3, "temperature": 0,
            "echo": True, "logprobs": 2}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    logprobs = response.json()["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == 4 + 3
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(isinstance(lp, float) and lp <= 0 for lp in logprobs["token_logprobs"][1:])
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"])


def test_speculative_server_gives_offline_greedy_text_and_reports_acceptance(tiny_model):
    import httpx
    from server_util import metric_value
    spec = '{"method": "self_draft", "num_draft_layers": 1, "num_speculative_tokens": 3}'
    prompts = ["abcabcabcabc", "hello there"]
    want = offline_greedy(tiny_model, prompts, 12)
    with running_server(tiny_model, speculative_config=spec) as live:
        client = openai.OpenAI(base_url=live.base_url, api_key="unused", max_retries=0, timeout=60)
        got = [client.completions.create(model=MODEL, prompt=p, max_tokens=12, **GREEDY).choices[0].text
               for p in prompts]
        metrics = httpx.get(live.url + "/metrics").text
    assert len(got) == len(prompts) and got == want
    num_scored = metric_value(metrics, "vllmlite:spec_decode_num_draft_tokens_total")
    num_kept = metric_value(metrics, "vllmlite:spec_decode_num_accepted_tokens_total")
    assert 0 < num_kept < num_scored  # the first layer as the draft agrees with the target, not always
    assert metric_value(metrics, "vllmlite:spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0


def test_client_id_and_priority_reach_the_scheduler(server, client):
    seen = []
    engine = server.engine.engine
    original = engine.add_request

    def spy(request_id, prompt, params, **kwargs):
        seen.append(kwargs)
        return original(request_id, prompt, params, **kwargs)

    engine.add_request = spy
    try:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_headers={"X-Client-Id": "tenant-7"},
                                  extra_body={"priority": 3})
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2)  # bearer "unused" hashes to a client
    finally:
        del engine.add_request
    assert seen[0]["client_id"] == "tenant-7" and seen[0]["priority"] == 3
    assert seen[1]["client_id"].startswith("key-") and seen[1]["priority"] == 0
