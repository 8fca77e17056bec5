"""The OpenAPI document describes the API that is served: request bodies, answers and OpenAI-shaped
errors declared for routes whose bodies are parsed by hand (tests/test_api_fuzz.py checks the server
against it)."""

from __future__ import annotations

import httpx
import pytest

from vllmlite.api.errors import error_body
from vllmlite.api.openai.protocol import ChatMessage, ErrorResponse

BODIES = {"/tokenize": "TokenizeRequest", "/detokenize": "DetokenizeRequest", "/v1/completions": "CompletionRequest",
          "/v1/chat/completions": "ChatCompletionRequest", "/v1/embeddings": "EmbeddingRequest",
          "/v1/responses": "ResponsesRequest"}


@pytest.fixture(scope="module")
def document(server) -> dict:
    return httpx.get(server.url + "/openapi.json").json()


def _refs(node) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return own + [r for value in node.values() for r in _refs(value)]
    if isinstance(node, list):
        return [r for value in node for r in _refs(value)]
    return []


def test_every_reference_resolves_and_every_operation_id_is_unique(document):
    schemas = document["components"]["schemas"]
    assert {ref.removeprefix("#/components/schemas/") for ref in _refs(document)} <= set(schemas)
    operation_ids = [op["operationId"] for path in document["paths"].values() for op in path.values()]
    assert len(operation_ids) == len(set(operation_ids)) and "health_health_head" in operation_ids


@pytest.mark.parametrize("path,model", sorted(BODIES.items()))
def test_post_routes_declare_their_json_body_and_openai_errors(document, path, model):
    operation = document["paths"][path]["post"]
    body = operation["requestBody"]
    assert body["required"] and body["content"]["application/json"]["schema"]["$ref"].endswith("/" + model)
    assert operation["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert "422" not in operation["responses"]  # validation is a 400, never FastAPI's 422


def test_generation_routes_declare_json_and_server_sent_events(document):
    for path, chunk in (("/v1/completions", "CompletionResponse"), ("/v1/chat/completions", "ChatCompletionChunk")):
        content = document["paths"][path]["post"]["responses"]["200"]["content"]
        data = content["text/event-stream"]["itemSchema"]["properties"]["data"]
        assert data["if"] == {"const": "[DONE]"} and data["else"]["contentMediaType"] == "application/json"
        assert data["else"]["contentSchema"]["anyOf"][0]["$ref"].endswith("/" + chunk)
        assert "application/json" in content


def test_fields_accepted_only_to_be_rejected_list_the_values_that_pass(document):
    chat = document["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert chat["use_beam_search"]["enum"] == [None, False] and chat["functions"]["enum"] == [None, []]
    assert chat["chat_template"]["enum"] == [None]


def test_the_error_schema_is_what_the_server_sends():
    assert ErrorResponse.model_validate(error_body(400, "bad", "n")).model_dump() == error_body(400, "bad", "n")
    assert ErrorResponse.model_validate(error_body(503, "busy")).error.param is None


def test_only_an_assistant_message_may_omit_its_content_in_schema_and_in_parsing():
    user, assistant = ChatMessage.model_json_schema()["anyOf"]
    assert "content" in user["required"] and "content" not in assistant["required"]
    assert ChatMessage.model_validate_json('{"role": "assistant"}').content == ""
    with pytest.raises(ValueError, match="content must be a string"):
        ChatMessage.model_validate_json('{"role": "user"}')


def test_request_bodies_allow_no_undeclared_field_but_the_no_ops(document, server):
    """The document says what the server does: an undeclared top-level field is a 400, except
    OpenAI's no-op fields, which are declared; a message may carry extra keys."""
    schemas = document["components"]["schemas"]
    for name in BODIES.values():
        assert schemas[name]["additionalProperties"] is False, name
        assert {"store", "metadata"} <= set(schemas[name]["properties"]), name
    assert schemas["ChatMessage"].get("additionalProperties", True) is not False
    assert httpx.post(server.base_url + "/completions", json={"prompt": "hi", "max_tokens": 1, "store": True,
                                                               "metadata": {"a": "b"}}).status_code == 200
