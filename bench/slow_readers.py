"""Slow readers (`python -m bench.slow_readers`): what streaming clients that read slowly cost the server.

Launches our server, opens `--clients` streaming completions (n=8, logprobs=5, max_tokens=3000,
ignore_eos: the issue-18 case) from clients that read `--read-bytes` every `--pause` seconds through
a small receive window, and prints the server's RSS, tokens generated and running sequences every
5 s. A server that buffers output per stream grows with the reader's lag (the issue measured 71 MB
to 1.24 GB); ours merges unread outputs, so its RSS follows the tokens generated, as a full-speed
reader's does (`--pause 0 --read-bytes 65536`), and cuts a stream off after `--stream-send-timeout`.
Prints only; nothing is written to results/.
"""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time

import httpx

from bench.report import REPO_ROOT
from bench.serve.targets import OURS, Target, memory_mib, start, stop
from bench.soak import parse_metrics

REQUEST = {"prompt": "hello", "stream": True, "n": 8, "logprobs": 5, "max_tokens": 3000, "ignore_eos": True}


def slow_client(url: str, read_bytes: int, pause: float, totals: list[int], index: int) -> None:
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps(REQUEST).encode()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((host, int(port)))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        try:
            while data := sock.recv(read_bytes):
                totals[index] += len(data)
                time.sleep(pause)
        except OSError:
            pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random")
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--read-bytes", type=int, default=200)
    parser.add_argument("--pause", type=float, default=1.0, help="seconds between reads")
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--stream-send-timeout", type=float, default=30.0)
    args = parser.parse_args(argv)

    target = Target(OURS, "ours", ["--stream-send-timeout", str(args.stream_send_timeout)])
    start(target, args.model, None, 0, REPO_ROOT / "bench" / "serve-logs" / "slow_readers.log")
    try:
        print(f"server: {target.command}; RSS at start {memory_mib(target)['rss_mib']:.0f} MiB")
        totals = [0] * args.clients
        for i in range(args.clients):
            threading.Thread(target=slow_client, args=(target.url, args.read_bytes, args.pause, totals, i),
                             daemon=True).start()
        began = time.monotonic()
        while time.monotonic() - began < args.seconds:
            time.sleep(5)
            metrics = parse_metrics(httpx.get(f"{target.url}/metrics").text)
            generated = sum(v for k, v in metrics.items() if k.startswith("generation_tokens_total"))
            running = sum(v for k, v in metrics.items() if k.startswith("num_requests_running"))
            print(f"{time.monotonic() - began:5.0f} s  RSS {memory_mib(target)['rss_mib']:6.0f} MiB  "
                  f"tokens {generated:8.0f}  running {running:3.0f}  read {sum(totals)} bytes", flush=True)
        print(f"peak RSS {memory_mib(target)['peak_rss_mib']:.0f} MiB")
    finally:
        stop(target)


if __name__ == "__main__":
    main()
