"""Safe on a laptop by default: what a web page on another site can make a browser send to a keyless
local server is refused. A POST whose body is not sent as JSON is a 415 (a form or a text/plain
fetch needs no CORS preflight, so it would run); a Host header naming anything but loopback and the
address listened on is a 400 (DNS rebinding: a page pointing its own name at 127.0.0.1 reads the
answers as same-origin). Browsers driving all this for real: tests/api/ops/test_cross_origin_page.py."""

from __future__ import annotations

import json

import httpx
import pytest
from server_util import running_server

from vllmlite.api.cli import parse_config

POST_ROUTES = {"/v1/completions": {"prompt": "hi", "max_tokens": 1},
               "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
               "/v1/responses": {"input": "hi", "max_output_tokens": 1},
               "/v1/embeddings": {"input": "hi"}, "/tokenize": {"prompt": "hi"}, "/detokenize": {"tokens": [104]}}
NOT_JSON = [None, "text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x", "application/jsonp", "application/json-patch+json", ""]


@pytest.fixture(scope="module")
def live(tiny_model):
    with running_server(tiny_model, enable_debug_endpoints=True, debug_store_prompts=True) as server:
        yield server


def assert_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text[:300]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error


@pytest.mark.parametrize("route", POST_ROUTES)
@pytest.mark.parametrize("content_type", NOT_JSON)
def test_a_body_not_sent_as_json_is_a_415_and_runs_nothing(live, route, content_type):
    headers = {} if content_type is None else {"Content-Type": content_type}
    response = httpx.post(live.url + route, content=json.dumps(POST_ROUTES[route]), headers=headers)
    message = assert_error(response, 415)["message"]
    assert "Content-Type: application/json" in message
    assert live.engine.num_unfinished_requests == 0
    requests = httpx.get(live.url + "/debug/requests").json()["requests"]
    assert requests == [], "a request that was refused ran anyway"


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8", "Application/JSON"])
def test_json_with_parameters_or_any_case_is_json(live, content_type):
    response = httpx.post(live.url + "/tokenize", content=b'{"prompt": "hi"}', headers={"Content-Type": content_type})
    assert response.status_code == 200
    assert response.json() == httpx.post(live.url + "/tokenize", json={"prompt": "hi"}).json()


@pytest.mark.parametrize("host", ["attacker.example", "attacker.example:8000", "127.0.0.1.nip.io",
                                  "localhost.attacker.example", "[::ffff:7f00:1]", "0x7f000001", "", "a:b:c"])
@pytest.mark.parametrize("method, path", [("GET", "/health"), ("GET", "/debug/requests"), ("GET", "/"),
                                          ("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/metrics")])
def test_a_foreign_host_header_is_a_400_on_every_route(live, host, method, path):
    response = httpx.request(method, live.url + path, headers={"Host": host}, json=POST_ROUTES["/v1/completions"])
    assert "--allowed-hosts" in assert_error(response, 400)["message"]


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:8000", "localhost.", "127.0.0.1", "127.0.0.1:1234",
                                  "127.5.6.7", "[::1]:8000"])
def test_loopback_names_and_addresses_are_answered(live, host):
    assert httpx.get(live.url + "/v1/models", headers={"Host": host}).status_code == 200


@pytest.mark.parametrize("overrides, host, answered", [
    ({"allowed_hosts": ("my.server.example",)}, "my.server.example:8000", True),
    ({"allowed_hosts": ("my.server.example",)}, "other.example", False),
    ({"allowed_hosts": ("*",)}, "anything.example", True),
    ({"host": "0.0.0.0"}, "192.168.1.20:8000", True),  # listening everywhere: any IP address
    ({"host": "0.0.0.0"}, "attacker.example", False),
    ({"host": "::"}, "[fd00::1]", True),
])
def test_allowed_hosts_and_the_bound_address_widen_the_check(tiny_model, overrides, host, answered):
    with running_server(tiny_model, **overrides) as server:
        response = httpx.get(server.url + "/v1/models", headers={"Host": host})
        assert response.status_code == (200 if answered else 400)


def test_the_knobs_parse_from_flags_and_environment():
    config = parse_config(["--allowed-hosts", '["a.example", "b.example"]'])
    assert config.allowed_hosts == ("a.example", "b.example") and config.cors_origins == ()
    keyed = parse_config([], {"VLLMLITE_API_KEY": "k", "VLLMLITE_ALLOWED_HOSTS": '["*"]'})
    assert keyed.allowed_hosts == ("*",) and keyed.cors_origins == ("*",)
    assert parse_config(["--allowed-origins", '["http://app.example"]']).cors_origins == ("http://app.example",)
