"""CORS as vLLM's server flags set it (--allowed-origins, --allowed-methods, --allowed-headers,
--allow-credentials), against a live server: preflights, simple requests, a disallowed origin, and
the defaults (no other origin without an API key, any with one)."""

from __future__ import annotations

import httpx
import pytest
from server_util import running_server

ALLOWED = "http://app.example"
DENIED = "http://evil.example"


def preflight(url: str, origin: str, method: str = "POST", headers: str = "content-type") -> httpx.Response:
    return httpx.options(url, timeout=30, headers={"Origin": origin, "Access-Control-Request-Method": method,
                                                   "Access-Control-Request-Headers": headers})


@pytest.fixture(scope="module")
def strict(tiny_model):
    """Only ALLOWED, only GET and POST, only content-type and authorization, credentials on, an API key."""
    with running_server(tiny_model, allowed_origins=(ALLOWED,), allowed_methods=("GET", "POST"),
                        allowed_headers=("content-type", "authorization"), allow_credentials=True,
                        api_key="secret") as live:
        yield live


def test_a_preflight_from_an_allowed_origin_is_answered_without_the_api_key(strict):
    response = preflight(strict.base_url + "/chat/completions", ALLOWED, headers="content-type, authorization")
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == ALLOWED
    assert response.headers["access-control-allow-credentials"] == "true"
    assert set(response.headers["access-control-allow-methods"].split(", ")) == {"GET", "POST"}
    assert "authorization" in response.headers["access-control-allow-headers"].lower()


@pytest.mark.parametrize("origin, method, headers, refused", [(DENIED, "POST", "content-type", "origin"),
                                                              (ALLOWED, "DELETE", "content-type", "method"),
                                                              (ALLOWED, "POST", "x-secret-header", "headers")])
def test_a_preflight_outside_the_lists_is_refused(strict, origin, method, headers, refused):
    response = preflight(strict.base_url + "/chat/completions", origin, method, headers)
    assert response.status_code == 400 and response.text == f"Disallowed CORS {refused}"
    assert ("access-control-allow-origin" in response.headers) == (origin == ALLOWED)


def test_simple_requests_carry_the_origin_only_when_it_is_allowed(strict):
    key = {"Authorization": "Bearer secret"}
    allowed = httpx.get(strict.base_url + "/models", headers={**key, "Origin": ALLOWED}, timeout=30)
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ALLOWED
    denied = httpx.get(strict.base_url + "/models", headers={**key, "Origin": DENIED}, timeout=30)
    assert denied.status_code == 200 and "access-control-allow-origin" not in denied.headers
    unauthorized = httpx.get(strict.base_url + "/models", headers={"Origin": ALLOWED}, timeout=30)
    assert unauthorized.status_code == 401 and unauthorized.headers["access-control-allow-origin"] == ALLOWED


def test_by_default_a_keyless_server_answers_no_other_origin(tiny_model):
    """Without an API key nothing guards a server but the browser's same-origin rule, so by default
    CORS opens nothing: a preflight is refused and no response carries Allow-Origin (the web page at
    / is same-origin and needs none)."""
    with running_server(tiny_model) as live:
        response = preflight(live.base_url + "/completions", DENIED)
        assert response.status_code == 400 and "access-control-allow-origin" not in response.headers
        simple = httpx.get(live.url + "/health", headers={"Origin": DENIED}, timeout=30)
        assert simple.status_code == 200 and "access-control-allow-origin" not in simple.headers


def test_by_default_a_keyed_server_allows_any_origin_without_credentials(tiny_model):
    """With a key, the key is the guard (as in vLLM): any origin, no cookies."""
    with running_server(tiny_model, api_key="k") as live:
        response = preflight(live.base_url + "/completions", DENIED, "PUT", "x-anything")
        assert response.status_code == 200 and response.headers["access-control-allow-origin"] == "*"
        assert "access-control-allow-credentials" not in response.headers
        simple = httpx.get(live.url + "/health", headers={"Origin": DENIED}, timeout=30)
        assert simple.status_code == 200 and simple.headers["access-control-allow-origin"] == "*"
        assert httpx.get(live.url + "/health", timeout=30).headers.get("access-control-allow-origin") is None


def test_allowed_origins_open_a_keyless_server_to_those_origins(tiny_model):
    with running_server(tiny_model, allowed_origins=(ALLOWED,)) as live:
        assert preflight(live.base_url + "/completions", ALLOWED).headers["access-control-allow-origin"] == ALLOWED
        assert preflight(live.base_url + "/completions", DENIED).status_code == 400
