"""Arbitrary Unicode over HTTP: JSON can carry a lone surrogate ("\\ud800") that no UTF-8 text can
hold; every route answers it with a 400 in OpenAI's shape (never a 500) and keeps serving, while
NUL, astral characters and escaped surrogate pairs work and round-trip through /tokenize and
/detokenize.

Run the property long with VLLMLITE_HYPOTHESIS_EXAMPLES=N (see tests/property_util.py).
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from property_util import examples

LONE = "\\ud800"  # as written inside a JSON string; "@" in a body below stands for it
BAD_BODIES = [(path, body.replace("@", LONE)) for path, body in [
    ("/v1/completions", '{"prompt": "a@b", "max_tokens": 2}'),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "stop": ["@"]}'),
    ("/v1/completions", '{"prompt": ["ok", "\\udfff"], "max_tokens": 2}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x@"}], "max_tokens": 2}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "stop": "@"}'),
    ("/v1/embeddings", '{"input": "@"}'),
    ("/tokenize", '{"prompt": "@"}'),
    ("/tokenize", '{"messages": [{"role": "user", "content": "@"}]}'),
]]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.mark.parametrize("path, body", BAD_BODIES)
def test_a_lone_surrogate_is_a_400_never_a_500(http, path, body):
    response = http.post(path, content=body.encode(), headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    # pydantic's JSON parser refuses the escape itself ("lone leading surrogate in hex escape",
    # "unexpected end of hex escape"), so nothing downstream ever sees such a str
    assert error["code"] == 400 and "not valid JSON" in error["message"] and "escape" in error["message"]
    assert http.get("/health").status_code == 200


def test_invalid_utf8_in_the_body_is_a_400(http):
    body = b'{"prompt": "a\xff\xfeb", "max_tokens": 2}'
    response = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == 400


def test_nul_astral_and_escaped_surrogate_pairs_work(http):
    body = '{"prompt": "a\\u0000\\ud83d\\ude00e\\u0301", "max_tokens": 3, "stop": ["\\ud83c\\udf89"]}'
    response = http.post("/v1/completions", content=body.encode(), headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == 1 + len("a\x00\U0001f600e\u0301".encode())  # BOS + bytes
    chat = {"messages": [{"role": "user", "content": "\x00\U0001f600"}], "max_tokens": 2}
    assert http.post("/v1/chat/completions", json=chat).status_code == 200


@settings(max_examples=examples(25))
@given(text=st.text(max_size=40))
def test_tokenize_then_detokenize_round_trips_any_text(http, text):
    # json.dumps escapes astral characters as surrogate pairs and NUL as \u0000
    tokens = http.post("/tokenize", content=json.dumps({"prompt": text}), headers={"content-type": "application/json"})
    assert tokens.status_code == 200, tokens.text
    ids = tokens.json()["tokens"]
    detokenized = http.post("/detokenize", json={"tokens": ids})
    assert detokenized.status_code == 200 and detokenized.json()["prompt"] == text
