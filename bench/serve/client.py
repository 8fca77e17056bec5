"""The serving benchmark's client: one streamed completion against an OpenAI-compatible server.

Owns SSE parsing and per-request timing; sends one `BenchRequest` (bench/workload.py) and knows nothing of
how workloads are built, of arrivals or of summaries.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field

import httpx

from bench.workload import BenchRequest

DONE = "[DONE]"


class SSEParser:
    """Server-sent events, fed one line at a time (the line break already stripped).

    An event is its `data:` lines joined by newlines, complete at the blank line that ends it;
    comment lines (`:`) and other fields (`event:`, `id:`, `retry:`) are ignored.

    >>> parser = SSEParser()
    >>> [parser.feed(line) for line in ['data: {"a": 1}', '', ': ping', 'data: x', 'data:y', '']]
    [None, '{"a": 1}', None, None, None, 'x\\ny']
    """

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        """Take one line; return the event's data when this line completes an event."""
        if line == "":
            return self.flush()
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def flush(self) -> str | None:
        """End the current event (at a blank line or the end of the stream)."""
        if not self._data:
            return None
        data, self._data = "\n".join(self._data), []
        return data


def sse_events(lines: Iterable[str]) -> Iterator[str]:
    """Every event's data in a sequence of lines; a final event without a blank line still counts."""
    parser = SSEParser()
    for line in lines:
        data = parser.feed(line.rstrip("\r"))
        if data is not None:
            yield data
    data = parser.flush()
    if data is not None:
        yield data


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds, relative to the run's start."""

    request_id: str
    prompt_tokens: int
    max_tokens: int
    scheduled_s: float                     # when the arrival process released it
    sent_s: float = math.nan               # when it was sent (later than scheduled under fixed concurrency)
    ttft_s: float = math.nan               # first streamed token - sent
    e2e_s: float = math.nan                # last byte - sent
    output_tokens: int | None = None    # usage.completion_tokens, else the number of token chunks
    usage_reported: bool = False
    num_chunks: int = 0                    # streamed chunks that carried tokens
    cached_tokens: int | None = None    # usage.prompt_tokens_details.cached_tokens, if reported
    finish_reason: str | None = None
    error: str | None = None
    chunk_times_s: list[float] = field(default_factory=list)  # arrival of each token chunk - sent

    @property
    def is_exact(self) -> bool:
        """Succeeded with exactly max_tokens output tokens."""
        return self.error is None and self.output_tokens == self.max_tokens

    @property
    def tpot_s(self) -> float:
        """(e2e - TTFT) / (output tokens - 1): the mean time per output token after the first."""
        if self.error is not None or not self.output_tokens or self.output_tokens < 2:
            return math.nan
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def itl_s(self) -> list[float]:
        """Gaps between consecutive token chunks (a chunk may carry several tokens, as in vLLM's bench)."""
        times = self.chunk_times_s
        return [b - a for a, b in zip(times, times[1:])]

    def to_dict(self) -> dict:
        record = asdict(self)
        record.pop("chunk_times_s")
        return dict(record, tpot_s=self.tpot_s, is_exact=self.is_exact,
                    itl_s=[round(x, 6) for x in self.itl_s])


def request_body(model: str, prompt: BenchRequest) -> dict:
    """Greedy, EOS ignored, exactly max_tokens; usage in the last chunk."""
    return {"model": model, "prompt": prompt.prompt_token_ids, "max_tokens": prompt.max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


def apply_chunk(result: RequestResult, chunk: dict, elapsed: float) -> None:
    """Fold one parsed `data:` JSON chunk into `result`."""
    if "error" in chunk:
        result.error = str(chunk["error"])[:300]
        return
    for choice in chunk.get("choices") or []:
        if choice.get("text"):
            if not result.chunk_times_s:
                result.ttft_s = elapsed
            result.chunk_times_s.append(elapsed)
            result.num_chunks += 1
        if choice.get("finish_reason"):
            result.finish_reason = choice["finish_reason"]
    usage = chunk.get("usage")
    if usage:
        result.output_tokens = usage.get("completion_tokens")
        result.usage_reported = True
        details = usage.get("prompt_tokens_details") or {}
        result.cached_tokens = details.get("cached_tokens")


async def send_request(client: httpx.AsyncClient, url: str, model: str, prompt: BenchRequest,
                       result: RequestResult, run_start: float) -> RequestResult:
    """POST one streamed completion to `url` (.../v1/completions) and time it into `result`."""
    sent = time.perf_counter()
    result.sent_s = sent - run_start
    try:
        async with client.stream("POST", url, json=request_body(model, prompt)) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:300]}"
                return result
            parser = SSEParser()
            async for line in response.aiter_lines():
                data = parser.feed(line.rstrip("\r"))
                if data is None or data == DONE:
                    continue
                apply_chunk(result, json.loads(data), time.perf_counter() - sent)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    result.e2e_s = time.perf_counter() - sent
    if result.error is None and not result.usage_reported:
        result.output_tokens = result.num_chunks  # one token per chunk: true of llama.cpp, not of every server
    if result.error is None and not result.chunk_times_s:
        result.error = "no tokens streamed"
    return result
