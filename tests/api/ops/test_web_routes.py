"""The web page's routes without a browser: the page's files are public and served from the package,
nothing else is; GET /v1/stats answers the debug API contract's shape and its counts follow the
traffic; /openapi.json documents the new routes (tests/test_web_page.py drives the page itself)."""

from __future__ import annotations

import re

import httpx
import pytest
from server_util import running_server

from vllmlite.api.ops.web import is_page_path, load_static_files

STATS_KEYS = {"model", "time", "num_running", "num_waiting", "num_swapped", "kv_blocks", "kv_cache_usage",
              "prefix_cache", "num_preemptions", "tokens", "requests", "latency", "spec_decode"}


def test_every_file_the_page_refers_to_is_shipped():
    files = load_static_files()
    text = {name: content.decode() for name, content in files.items()}
    referenced = set(re.findall(r'"/static/([\w.]+)"', text["index.html"]))
    for name, source in text.items():
        if name.endswith(".js"):
            referenced |= set(re.findall(r'from "\./([\w.]+)"', source))
    assert {"app.js", "style.css", "api.js", "playground.js", "dashboard.js", "charts.js"} <= referenced
    assert referenced <= set(files)


@pytest.mark.parametrize("path,is_open", [("/", True), ("/static/app.js", True), ("/static/x", True),
                                          ("/static/", False), ("/static/../v1/stats", False),
                                          ("/static/a/b", False), ("/v1/stats", False), ("/index.html", False)])
def test_only_the_page_paths_are_open(path, is_open):
    assert is_page_path(path) is is_open


def test_the_page_is_public_and_the_stats_are_keyed(tiny_model):
    with running_server(tiny_model, api_key="k") as live:
        page = httpx.get(live.url + "/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "/static/app.js" in page.text
        assert httpx.get(live.url + "/static/style.css").headers["content-type"].startswith("text/css")
        missing = httpx.get(live.url + "/static/nothing.js")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == 404
        assert httpx.get(live.url + "/v1/stats").status_code == 401
        assert httpx.get(live.url + "/v1/stats", headers={"Authorization": "Bearer k"}).status_code == 200


def test_stats_have_the_contract_shape_and_count_the_traffic(server):
    before = httpx.get(server.url + "/v1/stats").json()
    assert set(before) == STATS_KEYS
    kv = before["kv_blocks"]
    assert kv["used"] + kv["free"] == kv["total"] == 1024
    response = httpx.post(server.base_url + "/completions", json={"prompt": "hello", "max_tokens": 5,
                                                                  "ignore_eos": True}, timeout=60)
    assert response.status_code == 200
    after = httpx.get(server.url + "/v1/stats").json()
    assert after["tokens"]["generation"] == before["tokens"]["generation"] + 5
    assert after["tokens"]["prompt"] > before["tokens"]["prompt"]
    assert after["requests"]["finished"] == before["requests"]["finished"] + 1
    assert after["latency"]["window"] >= 1 and 0 < after["latency"]["ttft_p50"] <= after["latency"]["ttft_p90"]
    assert after["time"] >= before["time"] and after["model"] == "random"


def test_the_openapi_document_lists_the_page_and_the_stats(server):
    paths = httpx.get(server.url + "/openapi.json").json()["paths"]
    assert "text/html" in paths["/"]["get"]["responses"]["200"]["content"]
    assert "404" in paths["/static/{name}"]["get"]["responses"]
    assert "/v1/stats" in paths
