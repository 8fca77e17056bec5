"""POST /v1/embeddings end to end: the official `openai` client (and raw httpx) against a live server."""

from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np
import openai
import pytest
from conftest import run_to_completion
from reference import dense_hidden
from server_util import metric_value, running_server, wait_until

from vllmlite import PoolingParams
from vllmlite.config import CacheConfig, EngineConfig
from vllmlite.engine.llm_engine import LLMEngine

MODEL = "random"
HIDDEN = 64  # the tiny random model's hidden size


def offline_embeddings(tiny_model, prompts: list[str | list[int]]) -> list[list[float]]:
    """The offline engine's embeddings of `prompts` (text encoded as the server encodes it)."""
    engine = LLMEngine(EngineConfig(model=MODEL, dtype="float64", cache=CacheConfig(num_blocks=1024)), tiny_model)
    requests = [(engine.tokenizer.encode(p) if isinstance(p, str) else p, PoolingParams()) for p in prompts]
    return [o.outputs.embedding for o in run_to_completion(engine, requests)]


def test_float_embeddings_through_the_openai_client(client, server, tiny_model):
    inputs = ["The cat sat.", "A dog ran far away.", "x"]
    result = client.embeddings.create(model=MODEL, input=inputs, encoding_format="float")
    assert result.object == "list" and result.model == MODEL
    assert [d.index for d in result.data] == [0, 1, 2] and all(d.object == "embedding" for d in result.data)
    want = offline_embeddings(tiny_model, inputs)
    assert len(result.data) == len(want) == len(inputs)
    for data, expected in zip(result.data, want):
        assert len(data.embedding) == HIDDEN
        np.testing.assert_allclose(data.embedding, expected, rtol=0, atol=1e-12)
    num_tokens = sum(len(server.engine.tokenizer.encode(s)) for s in inputs)
    assert (result.usage.prompt_tokens, result.usage.total_tokens) == (num_tokens, num_tokens)
    assert wait_until(server.is_idle)


def test_base64_embeddings_decode_to_the_float_ones(client, server):
    inputs = ["hello world", "bye"]
    floats = client.embeddings.create(model=MODEL, input=inputs, encoding_format="float")
    # Without encoding_format the client asks for base64 and decodes it into floats itself.
    decoded = client.embeddings.create(model=MODEL, input=inputs)
    raw = httpx.post(server.base_url + "/embeddings", json={"input": inputs, "encoding_format": "base64"},
                     timeout=60).json()
    assert len(floats.data) == len(decoded.data) == len(raw["data"]) == len(inputs)
    for f, d, r in zip(floats.data, decoded.data, raw["data"]):
        as_float32 = np.asarray(f.embedding, dtype=np.float32)
        assert isinstance(r["embedding"], str)
        np.testing.assert_array_equal(np.frombuffer(base64.b64decode(r["embedding"]), dtype="<f4"), as_float32)
        np.testing.assert_array_equal(np.asarray(d.embedding, dtype=np.float32), as_float32)


def test_token_id_inputs_embed_like_their_text(client, server):
    tokenizer = server.engine.tokenizer
    texts = ["one two", "three"]
    by_text = client.embeddings.create(model=MODEL, input=texts, encoding_format="float").data
    one = client.embeddings.create(model=MODEL, input=tokenizer.encode(texts[0]), encoding_format="float").data
    many = client.embeddings.create(model=MODEL, input=[tokenizer.encode(t) for t in texts],
                                    encoding_format="float").data
    assert len(one) == 1 and one[0].embedding == by_text[0].embedding
    assert [d.embedding for d in many] == [d.embedding for d in by_text]


def test_embeddings_and_completions_run_together(server, tiny_model):
    """Concurrent completions and embeddings: the completions' greedy text is what it is alone."""
    async def run() -> tuple[list, list]:
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120) as client:
            completions = [client.completions.create(model=MODEL, prompt=f"prompt {i}", max_tokens=12,
                                                     temperature=0.0, extra_body={"ignore_eos": True})
                           for i in range(3)]
            embeddings = [client.embeddings.create(model=MODEL, input=[f"text {i}", f"more {i}"],
                                                   encoding_format="float") for i in range(3)]
            results = await asyncio.gather(*completions, *embeddings)
            return results[:3], results[3:]

    alone = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)
    solo = [alone.completions.create(model=MODEL, prompt=f"prompt {i}", max_tokens=12, temperature=0.0,
                                     extra_body={"ignore_eos": True}).choices[0].text for i in range(3)]
    completions, embeddings = asyncio.run(run())
    assert [c.choices[0].text for c in completions] == solo
    for i, result in enumerate(embeddings):
        want = offline_embeddings(tiny_model, [f"text {i}", f"more {i}"])
        np.testing.assert_allclose([d.embedding for d in result.data], want, rtol=0, atol=1e-12)
    assert wait_until(server.is_idle)
    assert metric_value(httpx.get(server.url + "/metrics").text, "vllmlite:request_success_total",
                        finished_reason="stop") >= 9


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["a", ""]}, "input"),
    ({"input": ["a", [1, 2]]}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": 5}, "input"),
    ({}, "input"),
    ({"input": ["a"] * 257}, "input"),
    ({"input": [10**9]}, "input"),
    ({"input": [[1], [10**9]]}, "input.1"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "a", "dimensions": 8}, "dimensions"),
    ({"input": "a", "dimensions": 0}, "dimensions"),
    ({"input": "a", "user": "u" * 1000}, "user"),
])
def test_bad_requests_are_400s_naming_the_field(server, body, param):
    response = httpx.post(server.base_url + "/embeddings", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert server.is_idle()


def test_errors_through_the_openai_client(client, server):
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=MODEL, input="hi", dimensions=16, encoding_format="float")
    assert caught.value.body["param"] == "dimensions"
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="hi")
    same = client.embeddings.create(model=MODEL, input="hi", dimensions=HIDDEN, encoding_format="float")
    assert len(same.data[0].embedding) == HIDDEN


def test_input_longer_than_the_context_is_a_400(tiny_model):
    with running_server(tiny_model, max_model_len=32) as live:
        response = httpx.post(live.base_url + "/embeddings", json={"input": [[1, 2], list(range(40))]}, timeout=30)
        assert response.status_code == 400 and response.json()["error"]["param"] == "input.1"
        fits = httpx.post(live.base_url + "/embeddings", json={"input": list(range(32))}, timeout=30)
        assert fits.status_code == 200 and len(fits.json()["data"][0]["embedding"]) == HIDDEN
        assert wait_until(live.is_idle)


def test_mean_pooling_server(tiny_model):
    with running_server(tiny_model, pooling="mean") as live:
        client = openai.OpenAI(base_url=live.base_url, api_key="x", max_retries=0, timeout=60)
        ids = live.engine.tokenizer.encode("pool me")
        data = client.embeddings.create(model=MODEL, input="pool me", encoding_format="float").data[0]
    vector = dense_hidden(tiny_model, ids).mean(axis=0)
    np.testing.assert_allclose(data.embedding, vector / np.linalg.norm(vector), rtol=0, atol=1e-12)
