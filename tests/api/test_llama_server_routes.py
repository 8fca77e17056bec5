"""llama-server's other routes and fields, as llama.cpp's server tests use them (test_tokenize.py,
test_template.py, test_chat_completion.py, test_security.py): the OpenAI routes without `/v1`,
llama-server's request fields on the OpenAI routes, /tokenize with `content`, /detokenize,
/apply-template and /props. Plain HTTP against a live server on the tiny random model."""

from __future__ import annotations

import json

import httpx
import pytest

USER = [{"role": "user", "content": "What is the capital of France?"}]
CHAT = {"messages": USER, "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def test_chat_answers_without_v1_as_with_it(http):
    answer = ok(http.post("/chat/completions", json=CHAT))
    assert answer["object"] == "chat.completion" and answer["usage"]["completion_tokens"] == 4
    assert answer["choices"][0]["message"]["content"] == ok(http.post("/v1/chat/completions", json=CHAT))[
        "choices"][0]["message"]["content"]


def test_responses_and_models_answer_without_v1(http):
    assert ok(http.post("/responses", json={"input": "hi", "max_output_tokens": 3}))["object"] == "response"
    assert ok(http.get("/models"))["data"][0]["id"] == ok(http.get("/v1/models"))["data"][0]["id"]


def test_a_stream_without_v1_ends_with_done(http):
    with http.stream("POST", "/chat/completions", json={**CHAT, "stream": True}) as response:
        raw = response.read().decode()
    assert raw.rstrip().endswith("data: [DONE]") and '"chat.completion.chunk"' in raw


@pytest.mark.parametrize("response_format", [
    {"type": "json_object", "schema": {"const": "42"}},
    {"type": "json_schema", "schema": {"const": "foo"}},
])
def test_response_format_takes_llama_servers_schema(http, response_format):
    answer = ok(http.post("/chat/completions", json={**CHAT, "max_tokens": 10, "response_format": response_format}))
    assert json.loads(answer["choices"][0]["message"]["content"]) == response_format["schema"]["const"]


def test_grammar_and_json_schema_on_the_openai_routes(http):
    grammar = 'root ::= "yes" | "no"'
    chat = ok(http.post("/chat/completions", json={**CHAT, "grammar": grammar}))
    assert chat["choices"][0]["message"]["content"] in ("yes", "no")
    completion = ok(http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "grammar": grammar}))
    assert completion["choices"][0]["text"] in ("yes", "no")
    answer = ok(http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 8, "json_schema": {"const": 42}}))
    assert json.loads(answer["choices"][0]["message"]["content"]) == 42
    both = http.post("/chat/completions", json={**CHAT, "grammar": grammar, "json_schema": {"const": 1}})
    assert both.status_code == 400 and both.json()["error"]["param"] == "json_schema"
    bad = http.post("/chat/completions", json={**CHAT, "json_schema": {"type": "no such type"}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "json_schema"


def test_n_probs_and_cache_prompt_on_the_openai_routes(http):
    chat = ok(http.post("/chat/completions", json={**CHAT, "n_probs": 3, "cache_prompt": True}))
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and all(len(token["top_logprobs"]) == 3 for token in content)
    completion = ok(http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "n_probs": 2,
                                                       "cache_prompt": False}))
    assert all(len(top) >= 2 for top in completion["choices"][0]["logprobs"]["top_logprobs"])


def test_tokenize_and_detokenize_round_trip(http):
    content = "What is the capital of France ?"
    tokens = ok(http.post("/tokenize", json={"content": content}))["tokens"]
    assert tokens == list(content.encode())  # llama-server's default: no BOS
    detokenized = ok(http.post("/detokenize", json={"tokens": tokens}))
    assert detokenized["content"] == content == detokenized["prompt"]


def test_tokenize_adds_bos_only_when_asked(http):
    assert ok(http.post("/tokenize", json={"content": "hi", "add_special": True}))["tokens"] == [256, 104, 105]
    assert ok(http.post("/tokenize", json={"content": "hi", "add_special": False}))["tokens"] == [104, 105]


def test_tokenize_with_pieces_gives_text_or_bytes(http):
    content = "This is a test string with unicode 媽 and emoji 🤗"
    tokens = ok(http.post("/tokenize", json={"content": content, "with_pieces": True}))["tokens"]
    assert all(set(t) == {"id", "piece"} for t in tokens)
    raw = b"".join(t["piece"].encode() if isinstance(t["piece"], str) else bytes(t["piece"]) for t in tokens)
    assert raw == content.encode() and tokens[0] == {"id": ord("T"), "piece": "T"}
    assert {"id": 0xE5, "piece": [0xE5]} in tokens  # half a character: its bytes


def test_tokenize_keeps_vllms_shape_and_refuses_a_mix(http):
    vllm = ok(http.post("/tokenize", json={"prompt": "hi"}))
    assert vllm["tokens"] == [256, 104, 105] and vllm["count"] == 3
    mixed = http.post("/tokenize", json={"prompt": "hi", "content": "hi"})
    assert mixed.status_code == 400 and mixed.json()["error"]["param"] == "prompt"
    stray = http.post("/tokenize", json={"prompt": "hi", "with_pieces": True})
    assert stray.status_code == 400 and stray.json()["error"]["param"] == "with_pieces"


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_apply_template_renders_the_chat_prompt(http, add_generation_prompt):
    prompt = ok(http.post("/apply-template", json={"messages": USER,
                                                   "add_generation_prompt": add_generation_prompt}))["prompt"]
    assert prompt.startswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n")
    assert prompt.endswith("<|im_start|>assistant\n") == add_generation_prompt
    chat_tokens = ok(http.post("/tokenize", json={"messages": USER, "add_generation_prompt": add_generation_prompt}))
    assert ok(http.post("/tokenize", json={"content": prompt}))["tokens"] == chat_tokens["tokens"]


def test_props_shows_the_defaults_the_context_and_the_template(http, server):
    props = ok(http.get("/props"))
    settings = props["default_generation_settings"]
    assert settings["n_ctx"] == server.engine.max_model_len
    assert (settings["params"]["temperature"], settings["params"]["top_k"], settings["params"]["n_predict"]) == \
        (0.8, 40, -1)
    assert props["total_slots"] >= 1 and props["model_path"] == props["model_alias"] == "random"
    assert "<|im_start|>" in props["chat_template"] and props["bos_token"] == "<|bos|>"
    assert props["build_info"].startswith("vllmlite-")
