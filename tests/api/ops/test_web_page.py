"""The web page at `/`, driven in headless Chromium (Playwright for Python, the system's chromium):
it loads cleanly, a chat reply streams in with its timing, Stop aborts the server's request and frees
its blocks, the dashboard's numbers move under load, a request's timeline opens, and the API key field
works against a keyed server.

The timeline test runs a server with `--enable-debug-endpoints` and checks the page draws the
server's own trace. Locally, without Playwright or Chromium, these tests skip; in CI (CI=true) a skip
is a failure (tests/conftest.py).
"""

from __future__ import annotations

import os
import shutil
import threading
import time

import httpx
import pytest
from conftest import import_or_skip_unless_ci, skip_unless_ci
from server_util import num_aborted, running_server, wait_until

pytestmark = pytest.mark.browser
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
TIMEOUT_MS = 20_000
# Counts a canvas's painted pixels: a chart that drew nothing has none.
PAINTED_PIXELS = """(id) => {
  const canvas = document.getElementById(id);
  const data = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
  let painted = 0;
  for (let i = 3; i < data.length; i += 4) if (data[i]) painted++;
  return painted;
}"""


def chromium_path() -> str | None:
    """VLLMLITE_CHROMIUM, else the first Chromium on PATH (Debian's `chromium` package)."""
    configured = os.environ.get("VLLMLITE_CHROMIUM")
    return configured or next((path for name in CHROMIUM_NAMES if (path := shutil.which(name))), None)


def launched_chromium(*args: str):
    """Headless Chromium through playwright, with extra command-line `args` (a generator for a
    fixture: skipped without playwright or a Chromium, except in CI)."""
    sync_api = import_or_skip_unless_ci("playwright.sync_api")
    executable = chromium_path()
    if executable is None:
        skip_unless_ci("no Chromium found (apt-get install chromium, or set VLLMLITE_CHROMIUM)")
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=executable, headless=True, args=list(args))
        yield launched
        launched.close()


@pytest.fixture(scope="module")
def browser():
    yield from launched_chromium()


class Page:
    """A fresh browser page that records console errors and uncaught exceptions."""

    def __init__(self, browser) -> None:
        self.context = browser.new_context(viewport={"width": 1280, "height": 900})
        self.page = self.context.new_page()
        self.page.set_default_timeout(TIMEOUT_MS)
        self.console_errors: list[str] = []
        self.page_errors: list[str] = []
        self.page.on("console", lambda m: self.console_errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.page_errors.append(str(e)))

    def number(self, card: str) -> float:
        return float(self.page.text_content(f"#card-{card} .value"))

    def painted(self, canvas_id: str) -> int:
        return self.page.evaluate(PAINTED_PIXELS, canvas_id)


@pytest.fixture
def open_page(browser):
    pages: list[Page] = []

    def factory() -> Page:
        pages.append(Page(browser))
        return pages[-1]

    yield factory
    for page in pages:
        page.context.close()


@pytest.fixture(scope="module")
def live(tiny_model):
    with running_server(tiny_model) as server:
        yield server


def send_chat(page, text: str, max_tokens: int) -> None:
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#prompt", text)
    page.click("#send")


def test_the_page_and_its_files_load_without_console_errors(live, open_page):
    view = open_page()
    response = view.page.goto(live.url + "/")
    assert response.status == 200 and response.headers["content-type"].startswith("text/html")
    view.page.wait_for_function("document.getElementById('server-status').textContent === 'random'")
    assert view.page.is_visible("#playground") and view.page.is_hidden("#dashboard")
    assert view.console_errors == [] and view.page_errors == []
    assert httpx.get(live.url + "/static/app.js").headers["content-type"].startswith("text/javascript")
    assert httpx.get(live.url + "/static/missing.js").status_code == 404


def paced(monkeypatch, engine, seconds: float) -> None:
    """Each engine step sleeps `seconds` after it: the event loop then gets its turn between steps,
    as it does with a real model's steps. Without it a loaded machine may hand the random model's
    whole reply to the reader at once, its outputs coalesced (RequestStream), and a test of
    streaming would measure the machine's load."""
    step = engine.engine.step

    def slow_step():
        outputs = step()
        time.sleep(seconds)
        return outputs

    monkeypatch.setattr(engine.engine, "step", slow_step)


def test_a_chat_message_streams_its_reply_with_ttft_and_tokens_per_second(live, open_page, monkeypatch):
    paced(monkeypatch, live.engine, 0.01)
    view = open_page()
    view.page.goto(live.url + "/")
    view.page.fill("#system-prompt", "Be brief.")
    view.page.fill("#seed", "7")
    view.page.fill("#stop", "zzz")
    # Count the reply's text updates as they land: a streamed reply arrives in many.
    view.page.evaluate("""() => { window.updates = 0; new MutationObserver((records) => {
        window.updates += records.filter((r) => r.target.closest && r.target.closest('.assistant .content')).length;
      }).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true}); }""")
    with view.page.expect_request("**/v1/chat/completions") as sent:
        send_chat(view.page, "Hello there", 48)
    body = sent.value.post_data_json
    assert body["stream"] is True and body["seed"] == 7 and body["stop"] == ["zzz"] and body["max_tokens"] == 48
    assert body["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    view.page.wait_for_selector(".message.assistant[data-done=finished]")
    meta = view.page.text_content(".message.assistant .meta")
    assert "TTFT" in meta and "tokens/s" in meta, meta
    assert view.page.text_content(".message.assistant .content") != ""
    assert view.page.evaluate("window.updates") > 3, "the reply arrived in one piece, not streamed"
    assert view.page_errors == []


def test_raw_completion_mode_posts_to_completions(live, open_page):
    view = open_page()
    view.page.goto(live.url + "/")
    view.page.select_option("#mode", "completions")
    assert view.page.is_hidden("#system-label")
    with view.page.expect_request("**/v1/completions") as sent:
        send_chat(view.page, "Once upon a time", 16)
    assert sent.value.post_data_json["prompt"] == "Once upon a time"
    view.page.wait_for_selector(".message.completion[data-done=finished]")
    assert "16 tokens" in view.page.text_content(".message.completion .meta")


def test_stop_aborts_the_request_on_the_server_and_frees_its_blocks(live, open_page):
    view = open_page()
    view.page.goto(live.url + "/")
    aborted_before = num_aborted(httpx.get(live.url + "/metrics").text)
    send_chat(view.page, "Tell me a long story", 4000)
    view.page.wait_for_function("document.querySelector('.message.assistant .content').textContent.length > 0")
    assert live.engine.num_unfinished_requests == 1, "the request finished before Stop could abort it"
    view.page.click("#stop-button")
    view.page.wait_for_selector(".message.assistant[data-done=stopped]")
    assert wait_until(live.is_idle, 10), "the stopped request still holds the engine or KV blocks"
    assert num_aborted(httpx.get(live.url + "/metrics").text) == aborted_before + 1
    assert "stopped" in view.page.text_content(".message.assistant .meta")
    assert view.page.is_enabled("#regenerate") and view.page.is_disabled("#stop-button")


def load(url: str, stop: threading.Event) -> None:
    """Streams of completions, four at a time, until `stop`."""
    def one() -> None:
        while not stop.is_set():
            httpx.post(url + "/v1/completions", json={"prompt": "load " * 20, "max_tokens": 300}, timeout=60)

    workers = [threading.Thread(target=one) for _ in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


def test_the_dashboard_numbers_move_while_a_load_runs(live, open_page):
    view = open_page()
    view.page.goto(live.url + "/?poll=200#dashboard")
    view.page.wait_for_selector("#card-generated")
    generated_before = view.number("generated")
    stop = threading.Event()
    loader = threading.Thread(target=load, args=(live.url, stop))
    loader.start()
    try:
        view.page.wait_for_function("Number(document.querySelector('#card-running .value').textContent) > 0")
        view.page.wait_for_function("parseFloat(document.querySelector('#card-throughput .value').textContent) > 0")
        view.page.wait_for_function("/^KV blocks: [1-9]/.test(document.getElementById('blocks-caption').textContent)")
        view.page.wait_for_function(f"Number(document.querySelector('#card-generated .value').textContent) "
                                    f"> {generated_before}")
        assert view.painted("chart-requests") > 0 and view.painted("block-grid") > 0
    finally:
        stop.set()
        loader.join()
    view.page.wait_for_function("Number(document.querySelector('#card-finished .value').textContent.split('/')[0]) > 0")
    # This server has no debug endpoints: the page says how to turn them on instead of breaking.
    assert "--enable-debug-endpoints" in view.page.text_content("#debug-notice")
    assert "--enable-debug-endpoints" in view.page.text_content("#requests tbody")
    assert view.page.is_visible("#debug-notice") and view.page_errors == []


def test_clicking_a_request_draws_its_timeline(tiny_model, open_page):
    with running_server(tiny_model, enable_debug_endpoints=True) as live:
        body = {"model": "random", "prompt": "the same long prefix " * 4, "max_tokens": 8, "temperature": 0}
        httpx.post(live.base_url + "/completions", json=body, timeout=60).raise_for_status()
        second = httpx.post(live.base_url + "/completions", json=body, timeout=60).json()  # a prefix hit
        trace = httpx.get(f"{live.url}/debug/requests/{second['id']}").json()
        assert "prefix_hit" in [e["event"] for e in trace["events"]]
        view = open_page()
        view.page.goto(live.url + "/?poll=200#dashboard")
        view.page.click(f"tr[data-request-id='{second['id']}']")
        view.page.wait_for_selector("#timeline:not([hidden])")
        events = view.page.eval_on_selector_all("#timeline-events li", "items => items.map(i => i.dataset.event)")
        assert events == [e["event"] for e in trace["events"]]  # the server's own trace, drawn
        assert view.painted("timeline-canvas") > 0
        caption = view.page.text_content("#blocks-caption")
        assert "from counts" not in caption  # per-block states were read
        assert "Prefill chunking: fixed, up to" in caption  # the policy's decision, from /debug/engine
        assert view.page.is_hidden("#debug-notice") and view.page_errors == []


def test_the_api_key_field_authorizes_the_page_against_a_keyed_server(tiny_model, open_page):
    with running_server(tiny_model, api_key="k") as live:
        view = open_page()
        assert view.page.goto(live.url + "/").status == 200  # the page itself is public
        view.page.wait_for_function("document.getElementById('server-status').textContent.includes('API key')")
        view.page.fill("#api-key", "k")
        view.page.press("#api-key", "Enter")
        view.page.wait_for_function("document.getElementById('server-status').textContent === 'random'")
        assert view.page.evaluate("sessionStorage.getItem('vllmlite.apiKey')") == "k"
        with view.page.expect_request("**/v1/chat/completions") as sent:
            send_chat(view.page, "hi", 8)
        assert sent.value.headers["authorization"] == "Bearer k"
        view.page.wait_for_selector(".message.assistant[data-done=finished]")
        assert not view.page.is_visible(".message.error")
        view.page.reload()
        assert view.page.input_value("#api-key") == "k"  # kept for the tab's session
