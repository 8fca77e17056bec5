"""Schema fuzzing of the whole HTTP API: schemathesis reads the live server's /openapi.json and sends
requests generated from it over a real socket (its examples, coverage and fuzzing phases: boundary
values, valid and schema-violating bodies, wrong methods, `stream: true`). Every answer must be: not
a 5xx; of a declared status and content type; a body matching its declared schema (each server-sent
event of a stream too, through the document's `itemSchema`); a request that violates the schema
rejected; an error OpenAI-shaped and under 16 KB. After each one the engine is alive and holds no
request and no KV block.

Bounded for CI: FUZZ_EXAMPLES per operation and generation mode in the fuzzing phase (the coverage
phase adds its own, a fixed set), derandomized, so every run sends the same requests (about 1,600,
1-1.5 minutes on 2 cores). The long form, with fresh random examples each run:
`VLLMLITE_FUZZ_EXAMPLES=500 VLLMLITE_FUZZ_RANDOM=1 python -m pytest tests/test_api_fuzz.py -p no:cacheprovider`.
"""

from __future__ import annotations

import json
import os

import hypothesis
import pytest
import schemathesis
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)
from server_util import running_server, wait_until

MAX_ERROR_BYTES = 16 * 1024
FUZZ_EXAMPLES = int(os.environ.get("VLLMLITE_FUZZ_EXAMPLES", "12"))
DERANDOMIZE = not os.environ.get("VLLMLITE_FUZZ_RANDOM")
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]


@pytest.fixture(scope="module")
def fuzz_server(tiny_model):
    """A server with a 64-token context, so no generated request runs long; the schema's bounds are
    the served ones (a max_tokens past the context is the engine's 400, as anywhere). The debug
    routes are on, so they are fuzzed too."""
    with running_server(tiny_model, max_model_len=64, num_blocks=64, enable_debug_endpoints=True) as live:
        yield live


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    schema = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")
    schema.config.generation.update(max_examples=FUZZ_EXAMPLES, deterministic=DERANDOMIZE, database="none")
    schema.config.output.sanitization.update(enabled=False)  # show `max_tokens`, not "[Filtered]"
    return schema


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@hypothesis.settings(max_examples=FUZZ_EXAMPLES, derandomize=DERANDOMIZE, database=None, deadline=None,
                     suppress_health_check=list(hypothesis.HealthCheck))
def test_every_answer_matches_the_openapi_document_and_leaves_the_engine_idle(case, fuzz_server):
    response = case.call_and_validate(checks=CHECKS, timeout=300)
    if response.status_code >= 400:
        assert len(response.content) < MAX_ERROR_BYTES, f"a {len(response.content)}-byte error body"
        error = json.loads(response.content)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == response.status_code
    assert wait_until(fuzz_server.is_idle, timeout=30), "the engine still holds requests or KV blocks"
    assert not fuzz_server.engine.is_dead
