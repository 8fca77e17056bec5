"""Screenshots of the web page for the docs: the playground after a streamed reply and the dashboard
under load, taken in headless Chromium (Playwright, the system's chromium) from a live server.

    python tools/screenshots.py                  # the default model (SmolLM2-135M-Instruct), float32
    python tools/screenshots.py --model random   # the tiny random model: seconds, not minutes

Writes docs/screenshots/playground.png and docs/screenshots/dashboard.png. The server is the real
one (build_app over a loaded model), with whatever endpoints this checkout has; any other argument is
a server flag (e.g. --enable-debug-endpoints, once the server has it).
"""

from __future__ import annotations

import argparse
import shutil
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from vllmlite.api.cli import ServerArgs, parse_config
from vllmlite.api.server import build_app, make_async_engine, uvicorn_config
from vllmlite.models.loader import load_model

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "docs" / "screenshots"
VIEWPORT = {"width": 1280, "height": 860}
SYSTEM = "You are a concise assistant who explains systems software."
QUESTION = "What does a paged KV cache do in an LLM server? Two sentences."
LOAD_PROMPTS = ["Write a haiku about {}.", "List three facts about {}.", "Explain {} to a child.",
                "Give one tip about {}."]
LOAD_TOPICS = ["rivers", "compilers", "bees", "caches", "volcanoes", "trains", "chess", "tea"]


def serve(args: ServerArgs, model: str, dtype: str) -> tuple[uvicorn.Server, str]:
    """The app over a loaded model, served from a thread on a free loopback port."""
    engine = make_async_engine(args, load_model(model, dtype, 0))
    server = uvicorn.Server(uvicorn_config(build_app(engine, args), args))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{sock.getsockname()[1]}"


def run_load(url: str, stop: threading.Event, num_clients: int) -> list[threading.Thread]:
    """Chat requests from `num_clients` threads until `stop`, all sharing one system prompt (so the
    prefix cache has something to hit)."""
    def client(index: int) -> None:
        turn = index
        while not stop.is_set():
            prompt = LOAD_PROMPTS[turn % len(LOAD_PROMPTS)].format(LOAD_TOPICS[turn % len(LOAD_TOPICS)])
            httpx.post(url + "/v1/chat/completions", timeout=600, json={
                "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}],
                "max_tokens": 24 + 16 * (turn % 4), "temperature": 0.8})
            turn += num_clients

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(num_clients)]
    for thread in threads:
        thread.start()
    return threads


def playground(page, url: str) -> None:
    page.goto(url + "/")
    page.fill("#system-prompt", SYSTEM)
    page.fill("#max-tokens", "60")
    page.fill("#seed", "1")
    page.fill("#prompt", QUESTION)
    page.click("#send")
    page.wait_for_selector(".message.assistant[data-done]", timeout=600_000)
    page.screenshot(path=str(OUT / "playground.png"))


def dashboard(page, url: str, seconds: float, num_clients: int) -> None:
    stop = threading.Event()
    threads = run_load(url, stop, num_clients)
    page.goto(url + "/?poll=500#dashboard")
    time.sleep(seconds)
    page.screenshot(path=str(OUT / "dashboard.png"), full_page=True)
    stop.set()
    for thread in threads:
        thread.join(timeout=600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seconds", type=float, default=25.0, help="how long the load runs before the dashboard shot")
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    options, server_flags = parser.parse_known_args()
    from playwright.sync_api import sync_playwright  # an optional dependency (the test extra)

    args = parse_config(["--model", options.model, "--dtype", options.dtype, "--port", "0",
                         "--log-level", "warning", *server_flags])
    server, url = serve(args, options.model, options.dtype)
    OUT.mkdir(parents=True, exist_ok=True)
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=options.chromium, headless=True)
            page = browser.new_page(viewport=VIEWPORT)
            playground(page, url)
            dashboard(page, url, options.seconds, options.clients)
            browser.close()
    finally:
        server.should_exit = True
    print(f"wrote {OUT / 'playground.png'} and {OUT / 'dashboard.png'}", file=sys.stderr)


if __name__ == "__main__":
    main()
