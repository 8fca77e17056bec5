"""The soak's requests and its client: a seeded mix of request shapes, one HTTP exchange per request
(streamed or whole, cut short on purpose or by a short client timeout), and what a valid answer is.

Knows the OpenAI wire format and nothing of the server's internals; `bench/soak.py` drives it.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import string
from dataclasses import dataclass, field

import httpx

COMPLETE_TIMEOUT_S = 300.0   # a request meant to complete: a generous limit, so only a hang trips it
PREFIX_LENGTHS = (8, 16, 24, 33)  # shared prompt prefixes: block-aligned at block size 8, and one not
VOCAB = 256                  # the random model's byte tokens (256 = BOS, 257 = EOS are left out)
PRINTABLE = string.ascii_letters + string.digits + string.punctuation + " "
FATES = ("complete", "disconnect", "timeout")


@dataclass(frozen=True)
class SoakRequest:
    """One request of the mix: its route and body, and what the client will do to it.

    fate "disconnect": a stream is closed after `cut_events` events, a whole request is cancelled
    after `cut_s` seconds; fate "timeout": the client's read timeout is `cut_s` seconds.
    """

    index: int
    route: str                 # "completions" or "chat"
    body: dict
    fate: str
    cut_events: int = 0
    cut_s: float = 0.0

    @property
    def is_stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def is_greedy(self) -> bool:
        return self.body.get("temperature") == 0

    @property
    def alone_body(self) -> dict:
        """The same request, whole (not streamed): what the alone run sends."""
        return {k: v for k, v in self.body.items() if k not in ("stream", "stream_options")}

    @property
    def key(self) -> str:
        """Requests with equal keys must give equal greedy outputs."""
        return self.route + json.dumps(self.alone_body, sort_keys=True)


@dataclass
class Choice:
    text: str = ""
    finish_reason: str | None = None
    token_ids: list[int] | None = None     # when the request asked for logprobs (tokens as ids)
    num_logprob_entries: int = 0


@dataclass
class Outcome:
    """What the client saw. status: completed, disconnected, timed_out or error."""

    index: int
    status: str = "error"
    http_status: int | None = None
    admitted: bool = False           # a 200 arrived: the server had queued the request
    choices: dict[int, Choice] = field(default_factory=dict)
    completion_tokens: int | None = None   # from usage, when the response carried it
    problems: list[str] = field(default_factory=list)
    error: str | None = None


# --- the mix -----------------------------------------------------------------------------------

def make_mix(num_requests: int, seed: int, disconnect_rate: float = 0.2, timeout_rate: float = 0.05,
             chat_rate: float = 0.15) -> list[SoakRequest]:
    """`num_requests` seeded requests: streamed or not, n 1-4, greedy / sampled / seeded, logprobs,
    stop strings, prompts sharing prefixes (and some repeated whole), completions and chat."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(VOCAB) for _ in range(length)] for length in PREFIX_LENGTHS]
    systems = ["".join(rng.choice(PRINTABLE) for _ in range(40)) for _ in range(2)]
    requests: list[SoakRequest] = []
    for index in range(num_requests):
        route = "chat" if rng.random() < chat_rate else "completions"
        if requests and rng.random() < 0.1:  # the same prompt again: a full prefix hit
            earlier = rng.choice(requests)
            route = earlier.route
            prompt = {k: earlier.body[k] for k in ("prompt", "messages") if k in earlier.body}
        elif route == "chat":
            prompt = {"messages": _messages(rng, systems)}
        else:
            prompt = {"prompt": _prompt(rng, prefixes)}
        body = {"model": "random", **prompt, **_sampling(rng, route)}
        fate_roll = rng.random()
        fate = "disconnect" if fate_roll < disconnect_rate else \
            "timeout" if fate_roll < disconnect_rate + timeout_rate else "complete"
        requests.append(SoakRequest(index, route, body, fate, cut_events=rng.randrange(0, 6),
                                    cut_s=rng.uniform(0.01, 0.4)))
    return requests


def _prompt(rng: random.Random, prefixes: list[list[int]]) -> list[int]:
    if rng.random() < 0.6:
        return rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 25))]
    return [rng.randrange(VOCAB) for _ in range(rng.randint(1, 48))]


def _messages(rng: random.Random, systems: list[str]) -> list[dict]:
    user = {"role": "user", "content": "".join(rng.choice(PRINTABLE) for _ in range(rng.randint(1, 40)))}
    return [{"role": "system", "content": rng.choice(systems)}, user] if rng.random() < 0.5 else [user]


def _sampling(rng: random.Random, route: str) -> dict:
    body: dict = {"max_tokens": rng.randint(1, 32), "n": rng.choices((1, 2, 3, 4), (60, 15, 10, 15))[0]}
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:
        body["temperature"] = round(rng.uniform(0.5, 1.5), 2)
        if rng.random() < 0.3:
            body["top_p"] = 0.9
        if rng.random() < 0.2:
            body["top_k"] = 20
        if rng.random() < 0.5:
            body["seed"] = rng.randrange(1 << 30)
    if rng.random() < 0.3:
        body["return_tokens_as_token_ids"] = True
        if route == "chat":
            body.update(logprobs=True, top_logprobs=rng.randint(0, 3))
        else:
            body["logprobs"] = rng.randint(0, 3)
    if rng.random() < 0.2:
        body["stop"] = ["".join(rng.choice(PRINTABLE) for _ in range(rng.randint(1, 2)))
                        for _ in range(rng.randint(1, 2))]
    if rng.random() < 0.5:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    return body


# --- the client --------------------------------------------------------------------------------

async def send(client: httpx.AsyncClient, base_url: str, request: SoakRequest) -> Outcome:
    """Run one request as its fate says; never raises (failures are the outcome's)."""
    outcome = Outcome(request.index)
    url = f"{base_url}/v1/{'chat/completions' if request.route == 'chat' else 'completions'}"
    read_s = request.cut_s if request.fate == "timeout" else COMPLETE_TIMEOUT_S
    timeout = httpx.Timeout(read_s, connect=30.0, pool=None)
    try:
        if request.is_stream:
            await _stream(client, url, request, timeout, outcome)
        elif request.fate == "disconnect":
            try:
                await asyncio.wait_for(_whole(client, url, request.body, request.route, timeout, outcome),
                                       request.cut_s)
            except asyncio.TimeoutError:
                outcome.status = "disconnected"
        else:
            await _whole(client, url, request.body, request.route, timeout, outcome)
    except httpx.TimeoutException as error:
        outcome.status = "timed_out" if request.fate == "timeout" else "error"
        outcome.error = f"{type(error).__name__}: {error}"
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as error:
        outcome.status, outcome.error = "error", f"{type(error).__name__}: {error}"
    return outcome


async def _whole(client: httpx.AsyncClient, url: str, body: dict, route: str, timeout: httpx.Timeout,
                 outcome: Outcome) -> None:
    response = await client.post(url, json=body, timeout=timeout)
    outcome.http_status = response.status_code
    if response.status_code != 200:
        outcome.error = response.text[:500]
        return
    outcome.admitted = True
    data = response.json()
    for raw in data["choices"]:
        choice = outcome.choices.setdefault(raw["index"], Choice())
        _add_delta(choice, raw, route, whole=True)
        choice.finish_reason = raw["finish_reason"]
    outcome.completion_tokens = data["usage"]["completion_tokens"]
    outcome.status = "completed"


async def _stream(client: httpx.AsyncClient, url: str, request: SoakRequest, timeout: httpx.Timeout,
                  outcome: Outcome) -> None:
    num_events = 0
    async with client.stream("POST", url, json=request.body, timeout=timeout) as response:
        outcome.http_status = response.status_code
        if response.status_code != 200:
            outcome.error = (await response.aread()).decode(errors="replace")[:500]
            return
        outcome.admitted = True
        async for line in response.aiter_lines():
            if request.fate == "disconnect" and num_events >= request.cut_events:
                outcome.status = "disconnected"
                return  # leaving the block closes the connection mid-stream
            if not line or line.startswith(":"):
                continue  # event separator, or a keep-alive comment
            if not line.startswith("data: "):
                outcome.problems.append(f"not an SSE data line: {line[:80]!r}")
                continue
            num_events += 1
            if line == "data: [DONE]":
                outcome.status = "completed"
                return
            _add_chunk(outcome, json.loads(line[len("data: "):]), request.route)
    outcome.problems.append("the stream ended without data: [DONE]")


def _add_chunk(outcome: Outcome, data: dict, route: str) -> None:
    if "error" in data:
        outcome.problems.append(f"error event: {str(data['error'])[:200]}")
        return
    if data.get("usage") is not None and not data["choices"]:
        outcome.completion_tokens = data["usage"]["completion_tokens"]
    for raw in data["choices"]:
        choice = outcome.choices.setdefault(raw["index"], Choice())
        if choice.finish_reason is not None:
            outcome.problems.append(f"choice {raw['index']} got a chunk after its finish_reason")
        _add_delta(choice, raw, route, whole=False)
        choice.finish_reason = raw.get("finish_reason")


def _add_delta(choice: Choice, raw: dict, route: str, whole: bool) -> None:
    """Append one choice's text and logprob tokens (a whole choice, or one chunk's delta)."""
    if route == "chat":
        choice.text += (raw["message"] if whole else raw["delta"]).get("content") or ""
        entries = (raw.get("logprobs") or {}).get("content") or []
        tokens = [entry["token"] for entry in entries]
    else:
        choice.text += raw["text"]
        tokens = (raw.get("logprobs") or {}).get("tokens") or []
    if raw.get("logprobs") is not None:
        choice.token_ids = (choice.token_ids or []) + [int(t.removeprefix("token_id:")) for t in tokens]
        choice.num_logprob_entries += len(tokens)
        _check_logprobs(choice, raw["logprobs"], route)


def _check_logprobs(choice: Choice, logprobs: dict, route: str) -> None:
    """Every logprob is a finite number <= 0; completions' four lists have one entry per token."""
    if route == "chat":
        values = [entry["logprob"] for entry in logprobs.get("content") or []]
    else:
        lengths = {len(logprobs[k]) for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        if len(lengths) != 1:
            raise ValueError(f"completions logprobs lists differ in length: {lengths}")
        values = logprobs["token_logprobs"]
    if any(v is None or not math.isfinite(v) or v > 1e-9 for v in values):
        raise ValueError(f"a logprob is not a finite number <= 0: {values}")


# --- what a valid answer is --------------------------------------------------------------------

def validate(request: SoakRequest, outcome: Outcome) -> list[str]:
    """Problems with a completed answer: choices, finish reasons, lengths, stop strings, usage."""
    body = request.body
    problems = list(outcome.problems)
    n, max_tokens = body["n"], body["max_tokens"]
    if sorted(outcome.choices) != list(range(n)):
        problems.append(f"choice indices {sorted(outcome.choices)}, expected 0..{n - 1}")
    for index, choice in outcome.choices.items():
        if choice.finish_reason not in ("stop", "length"):
            problems.append(f"choice {index}: finish_reason {choice.finish_reason!r}")
        for stop in body.get("stop") or ():
            if stop in choice.text:
                problems.append(f"choice {index}: the stop string {stop!r} is in the text")
        if "return_tokens_as_token_ids" in body:
            num = choice.num_logprob_entries
            if num > max_tokens or (choice.finish_reason == "length" and num != max_tokens):
                problems.append(f"choice {index}: {num} tokens, finish {choice.finish_reason}, max_tokens {max_tokens}")
    if outcome.completion_tokens is not None and not 0 < outcome.completion_tokens <= n * max_tokens:
        problems.append(f"usage: {outcome.completion_tokens} completion tokens for n={n}, max_tokens={max_tokens}")
    return problems


def differences(request: SoakRequest, soaked: Outcome, alone: Outcome) -> list[str]:
    """Where a soaked answer differs from the same request run alone (text, finish, token ids)."""
    if alone.status != "completed":
        return [f"the alone run did not complete: {alone.status} {alone.error}"]
    found = []
    for index, choice in soaked.choices.items():
        other = alone.choices.get(index)
        if other is None:
            found.append(f"choice {index} is missing alone")
        elif (choice.text, choice.finish_reason, choice.token_ids) != (other.text, other.finish_reason, other.token_ids):
            found.append(f"choice {index}: soaked {choice.text!r} ({choice.finish_reason}, {choice.token_ids}) "
                         f"alone {other.text!r} ({other.finish_reason}, {other.token_ids})")
    return found
