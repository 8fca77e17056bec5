"""A hostile web page, in headless Chromium, against a keyless server with its debug routes and stored
prompts on (issue 35): from another origin, and from its own name pointed at 127.0.0.1 (DNS
rebinding), it must neither read a stored prompt nor run a request. Browsers refuse what the server
does not allow: no Access-Control-Allow-Origin by default, and a JSON POST needs a preflight; the
server refuses the rest itself, a POST not sent as JSON (a text/plain fetch, a Blob, a text/plain
form, none of which needs a preflight) and a Host it does not answer to.

The rebinding page is served by Playwright at http://rebind.example:<the server's port>/, whose
name Chromium resolves to 127.0.0.1 (--host-resolver-rules): its later same-origin requests reach
the server. Chromium's own guards against pages reaching local addresses (Private/Local Network
Access) are turned off, so the server's defences are what is tested (Firefox and Safari have none).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from server_util import parse_prometheus, running_server
from test_web_page import TIMEOUT_MS, launched_chromium

pytestmark = pytest.mark.browser
SECRET = "the victim's secret prompt 7f3a"
ATTACK_PAGE = "<!doctype html><title>cat pictures</title><iframe name=sink></iframe>"
LOCAL_NETWORK_GUARDS = ("BlockInsecurePrivateNetworkRequests,PrivateNetworkAccessSendPreflights,"
                        "PrivateNetworkAccessRespectPreflightResults,LocalNetworkAccessChecks")
# Every way a page can reach the server, each step's outcome by name: what it read, or the error.
ATTACK = """async ({server, body}) => {
  const out = {};
  const attempt = async (name, run) => {
    try { out[name] = await run(); } catch (error) { out[name] = "refused: " + error.name; }
  };
  await attempt("read_debug", async () => (await fetch(server + "/debug/requests")).text());
  await attempt("read_models", async () => (await fetch(server + "/v1/models")).text());
  await attempt("json_post", async () => (await fetch(server + "/v1/completions",
    {method: "POST", headers: {"Content-Type": "application/json"}, body})).text());
  await attempt("text_post", async () => {
    const response = await fetch(server + "/v1/completions", {method: "POST", mode: "no-cors",
      headers: {"Content-Type": "text/plain"}, body});
    return response.type === "opaque" ? "sent, unreadable" : await response.text();
  });
  await attempt("blob_post", async () => {
    const response = await fetch(server + "/v1/completions", {method: "POST", mode: "no-cors",
      body: new Blob([body])});
    return response.type === "opaque" ? "sent, unreadable" : await response.text();
  });
  await attempt("form_post", () => new Promise((resolve) => {
    // enctype text/plain writes `name=value`: a name ending in an open string makes the body JSON
    const form = document.createElement("form");
    Object.assign(form, {method: "POST", action: server + "/v1/completions", enctype: "text/plain", target: "sink"});
    const input = document.createElement("input");
    Object.assign(input, {name: body.slice(0, -1) + ', "pad": "', value: '"}'});
    form.appendChild(input);
    document.body.appendChild(form);
    document.querySelector("iframe").onload = () => resolve("submitted");
    form.submit();
  }));
  return out;
}"""


@pytest.fixture(scope="module")
def browser():
    yield from launched_chromium("--host-resolver-rules=MAP rebind.example 127.0.0.1",
                                 f"--disable-features={LOCAL_NETWORK_GUARDS}")


@pytest.fixture(scope="module")
def live(tiny_model):
    """A keyless server on the defaults, holding one earlier request's prompt in its traces."""
    with running_server(tiny_model, enable_debug_endpoints=True, debug_store_prompts=True) as server:
        assert httpx.post(server.base_url + "/completions", json={"prompt": SECRET, "max_tokens": 2}).status_code == 200
        assert SECRET in httpx.get(server.url + "/debug/requests").text
        yield server


@pytest.fixture(scope="module")
def other_origin():
    """The attacker's site: another port on loopback is another origin."""
    class Page(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(ATTACK_PAGE.encode())

        def log_message(self, *args):
            pass

    site = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{site.server_address[1]}"
    site.shutdown()


def num_finished(live) -> float:
    samples = parse_prometheus(httpx.get(live.url + "/metrics").text)[1]
    return sum(s.value for s in samples if s.name == "vllmlite:request_success_total")


def run_attack(browser, page_url: str, server: str, route_page: bool = False) -> dict:
    context = browser.new_context()
    try:
        page = context.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        if route_page:  # the first answer for the name is the attacker's page; the rest go to the network
            page.route(page_url, lambda route: route.fulfill(status=200, content_type="text/html", body=ATTACK_PAGE))
        page.goto(page_url)
        body = json.dumps({"prompt": "sent by the page", "max_tokens": 1})
        return page.evaluate(ATTACK, {"server": server, "body": body})
    finally:
        context.close()


def test_a_page_on_another_origin_can_neither_read_nor_drive_the_server(browser, live, other_origin):
    before = num_finished(live)
    results = run_attack(browser, other_origin + "/", live.url)
    # no Access-Control-Allow-Origin: the browser hands the page nothing it asked to read
    for name in ("read_debug", "read_models", "json_post"):
        assert results[name] == "refused: TypeError", results
    assert results["text_post"] == results["blob_post"] == "sent, unreadable" and results["form_post"] == "submitted"
    assert num_finished(live) == before, "a request sent by the page ran"  # each was a 415
    assert live.engine.num_unfinished_requests == 0


def test_a_rebound_name_gets_nothing_from_the_server(browser, live):
    """Same-origin for the browser, so everything is sent and readable: the server refuses the Host."""
    port = live.url.rsplit(":", 1)[1]
    origin = f"http://rebind.example:{port}"
    before = num_finished(live)
    results = run_attack(browser, origin + "/", origin, route_page=True)
    for name in ("read_debug", "read_models", "json_post"):
        error = json.loads(results[name])["error"]
        assert error["code"] == 400 and "Host header" in error["message"], results
    assert SECRET not in json.dumps(results)
    assert num_finished(live) == before, "a request sent by the page ran"
