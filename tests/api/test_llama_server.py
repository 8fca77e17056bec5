"""llama-server's native /completion endpoint, as llama.cpp's own server tests (tools/server/tests/unit/
test_completion.py) use it: plain HTTP against a live server on the tiny random model, its streams
parsed from the raw bytes. The model writes random bytes, so text is compared between requests and
with the OpenAI route, never with fixed strings."""

from __future__ import annotations

import json

import httpx
import pytest
from server_util import running_server

CONTEXT = 128
PROMPT = "I believe the meaning of life is"


@pytest.fixture(scope="module")
def server(tiny_model):
    """A small context, so `n_predict: -1` (until the context is full) stays quick."""
    with running_server(tiny_model, max_model_len=CONTEXT) as live:
        yield live


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def complete(http: httpx.Client, path: str = "/completion", **body) -> dict | list:
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def stream_events(http: httpx.Client, **body) -> list[dict]:
    """The events of a streamed /completion: every one exactly `data: {json}`, and no `[DONE]`."""
    with http.stream("POST", "/completion", json={**body, "stream": True}) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = [block for block in raw.split("\n\n") if block.strip() and not block.startswith(":")]
    assert all(block.startswith("data: ") and "\n" not in block for block in events), raw
    assert "[DONE]" not in raw
    return [json.loads(block[len("data: "):]) for block in events]


def test_a_result_has_llama_servers_fields_and_counts(http):
    result = complete(http, prompt=PROMPT, n_predict=8, temperature=0)
    assert result["stop"] is True and result["stop_type"] == "limit" and result["stopping_word"] == ""
    assert result["tokens_predicted"] == 8 and result["tokens_evaluated"] == len(PROMPT) + 1  # bytes and BOS
    timings = result["timings"]
    assert timings["predicted_n"] == 8 and timings["prompt_n"] + timings["cache_n"] == result["tokens_evaluated"]
    assert result["truncated"] is False and isinstance(result["has_new_line"], bool)
    assert result["tokens"] == [] and "completion_probabilities" not in result
    assert result["prompt"] == "<|bos|>" + PROMPT and result["model"] == "random"
    settings = result["generation_settings"]
    assert settings["n_predict"] == 8 and settings["temperature"] == 0 and settings["seed"] == 4294967295
    with_tokens = complete(http, prompt=PROMPT, n_predict=8, temperature=0, return_tokens=True)
    assert len(with_tokens["tokens"]) == 8 and all(isinstance(t, int) for t in with_tokens["tokens"])
    assert with_tokens["content"] == result["content"]


def test_its_text_is_the_openai_routes_text(http):
    """Greedy /completion and greedy /v1/completions run the same prompt to the same text; /completions
    (no /v1) is llama-server's native endpoint, as in llama-server."""
    native = complete(http, prompt=PROMPT, n_predict=10, temperature=0)
    openai_style = complete(http, "/v1/completions", prompt=PROMPT, max_tokens=10, temperature=0)
    assert native["content"] == openai_style["choices"][0]["text"]
    assert complete(http, "/completions", prompt=PROMPT, n_predict=10, temperature=0)["content"] == native["content"]


def test_a_stream_sends_pieces_then_the_result_and_adds_up_to_the_whole(http):
    events = stream_events(http, prompt=PROMPT, n_predict=8, temperature=0, seed=42)
    assert all(isinstance(e["stop"], bool) for e in events)
    *pieces, final = events
    assert pieces and not any(p["stop"] for p in pieces) and final["stop"]
    assert all(p["tokens"] and all(isinstance(t, int) for t in p["tokens"]) for p in pieces)
    assert sum(len(p["tokens"]) for p in pieces) == 8
    assert final["stop_type"] == "limit" and final["truncated"] is False and isinstance(final["has_new_line"], bool)
    assert final["timings"]["predicted_n"] == 8 and final["content"] == "" and final["tokens"] == []
    assert final["generation_settings"]["n_predict"] == 8 and final["generation_settings"]["seed"] == 42
    whole = complete(http, prompt=PROMPT, n_predict=8, temperature=0)
    assert "".join(e["content"] for e in events) == whole["content"]


def test_a_seed_repeats_a_sample_and_other_seeds_differ(http):
    same = {complete(http, prompt=PROMPT, n_predict=16, temperature=1.0, seed=42)["content"] for _ in range(3)}
    assert len(same) == 1
    different = {complete(http, prompt=PROMPT, n_predict=16, temperature=1.0, seed=seed)["content"]
                 for seed in range(4)}
    assert len(different) == 4


def test_token_id_prompts_several_prompts_and_mixed_prompts(http):
    tokens = http.post("/tokenize", json={"content": PROMPT, "add_special": True}).json()["tokens"]
    one = complete(http, prompt=tokens, n_predict=6, temperature=0)
    assert isinstance(one, dict) and one["content"] == complete(http, prompt=PROMPT, n_predict=6, temperature=0)["content"]
    batch = complete(http, prompt=[tokens, PROMPT], n_predict=6, temperature=0)
    assert isinstance(batch, list) and [r["index"] for r in batch] == [0, 1]
    assert batch[0]["content"] == batch[1]["content"] == one["content"]
    mixed = complete(http, prompt=[256, *PROMPT[:5].encode(), PROMPT[5:]], n_predict=6, temperature=0)
    assert mixed["content"] == one["content"] and mixed["tokens_evaluated"] == len(tokens)
    assert http.post("/completion", json={"prompt": {"prompt_string": "x", "multimodal_data": []}}).status_code == 400


def test_n_predict_minus_one_or_past_the_context_stops_where_the_context_ends(http):
    prompt_len = len(PROMPT) + 1
    for n_predict in (-1, 10 * CONTEXT):
        result = complete(http, prompt=PROMPT, n_predict=n_predict, temperature=0, ignore_eos=True)
        assert result["tokens_predicted"] == CONTEXT - prompt_len
        assert result["stop_type"] == "limit" and result["truncated"] is True
    assert http.post("/completion", json={"prompt": PROMPT * 8, "n_predict": 4}).status_code == 400


def test_n_predict_zero_evaluates_the_prompt_into_the_cache_and_returns_nothing(http):
    prompt = "a prompt only warmed up, long enough to fill a few KV blocks " * 2
    warm = complete(http, prompt=prompt, n_predict=0)
    assert (warm["content"], warm["tokens_predicted"], warm["stop_type"]) == ("", 0, "limit")
    assert warm["timings"]["cache_n"] == 0
    assert complete(http, prompt=prompt, n_predict=1, cache_prompt=True)["timings"]["cache_n"] > 0


def test_stop_words_and_end_of_sequence(http):
    text = complete(http, prompt=PROMPT, n_predict=12, temperature=0)["content"]
    at = next(i for i, c in enumerate(text) if i > 0 and c.isascii() and c.isprintable())
    word = complete(http, prompt=PROMPT, n_predict=12, temperature=0, stop=[text[at]])
    assert (word["content"], word["stop_type"], word["stopping_word"]) == (text[:at], "word", text[at])
    eos = complete(http, prompt=PROMPT, n_predict=12, temperature=0, logit_bias={"257": 100})  # force EOS
    assert (eos["content"], eos["stop_type"], eos["tokens_predicted"]) == ("", "eos", 1)


@pytest.mark.parametrize("form", ["id pairs", "text pairs", "object by id", "object by text"])
def test_logit_bias_in_each_of_llama_servers_forms_bans_tokens(http, form):
    free = complete(http, prompt=PROMPT, n_predict=12, temperature=0, return_tokens=True)
    banned = sorted(set(free["tokens"]))
    bias = {"id pairs": [[t, False] for t in banned], "text pairs": [[chr(t), -100] for t in banned if t < 128],
            "object by id": {str(t): -100 for t in banned},
            "object by text": {chr(t): False for t in banned if t < 128}}[form]
    kept = [t for t in banned if t < 128] if "text" in form else banned
    result = complete(http, prompt=PROMPT, n_predict=12, temperature=0, return_tokens=True, logit_bias=bias)
    assert not set(result["tokens"]) & set(kept)
    assert result["generation_settings"]["logit_bias"]
    bad = http.post("/completion", json={"prompt": PROMPT, "logit_bias": [[1, True]]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias"


def test_n_probs_gives_each_tokens_top_probabilities(http):
    result = complete(http, prompt=PROMPT, n_probs=10, temperature=0, n_predict=5, return_tokens=True)
    probs = result["completion_probabilities"]
    assert [p["id"] for p in probs] == result["tokens"]
    for p in probs:
        assert isinstance(p["token"], str) and p["logprob"] <= 0.0 and isinstance(p["bytes"], list)
        assert len(p["top_logprobs"]) == 10 and p["top_logprobs"][0]["id"] == p["id"]  # greedy: the likeliest
        assert all(set(top) == {"id", "token", "bytes", "logprob"} and top["logprob"] <= 0 for top in p["top_logprobs"])


def test_n_probs_in_a_stream_come_with_each_piece(http):
    events = stream_events(http, prompt=PROMPT, n_probs=3, temperature=0, n_predict=5)
    pieces = [e for e in events if not e["stop"]]
    assert pieces and all([p["id"] for p in e["completion_probabilities"]] == e["tokens"] for e in pieces)
    assert all(len(p["top_logprobs"]) == 3 for e in pieces for p in e["completion_probabilities"])
    assert "completion_probabilities" not in events[-1]


def test_response_fields_keep_only_the_named_fields(http):
    result = complete(http, prompt=PROMPT, n_predict=4, response_fields=["content", "generation_settings/n_predict",
                                                                        "prompt", "no_such_field"])
    assert set(result) == {"content", "generation_settings/n_predict", "prompt"}
    assert result["generation_settings/n_predict"] == 4 and result["prompt"] == "<|bos|>" + PROMPT


def test_grammar_and_json_schema_constrain_the_text(http):
    grammar = 'root ::= ("yes" | "no") "!"'
    assert complete(http, prompt=PROMPT, n_predict=8, grammar=grammar)["content"] in ("yes!", "no!")
    schema = {"enum": ["yes", 42, None]}
    assert json.loads(complete(http, prompt=PROMPT, n_predict=40, json_schema=schema)["content"]) in schema["enum"]
    bad = http.post("/completion", json={"prompt": PROMPT, "grammar": "root ::= ("})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "grammar"


@pytest.mark.parametrize("field,value", [("mirostat", 2), ("typical_p", 0.5), ("dry_multiplier", 0.8),
                                         ("n_cmpl", 2), ("post_sampling_probs", True), ("samplers", ["top_k"])])
def test_fields_it_cannot_honour_are_400s_naming_them_unless_off(http, field, value):
    refused = http.post("/completion", json={"prompt": PROMPT, "n_predict": 1, field: value})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == field
    off = {"mirostat": 0, "typical_p": 1.0, "dry_multiplier": 0.0, "n_cmpl": 1, "post_sampling_probs": False,
           "samplers": None}[field]
    assert http.post("/completion", json={"prompt": PROMPT, "n_predict": 1, field: off}).status_code == 200


def test_penalty_windows_other_than_the_whole_context_are_refused(http):
    assert complete(http, prompt=PROMPT, n_predict=4, repeat_penalty=1.1, repeat_last_n=-1)["stop"]
    assert complete(http, prompt=PROMPT, n_predict=4, repeat_penalty=1.1, repeat_last_n=0)["stop"]
    assert complete(http, prompt=PROMPT, n_predict=4, repeat_last_n=64)["stop"]  # no penalty: moot
    refused = http.post("/completion", json={"prompt": PROMPT, "n_predict": 4, "repeat_penalty": 1.1,
                                             "repeat_last_n": 64})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "repeat_last_n"
