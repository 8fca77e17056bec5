"""The server's knobs and the CLI derived from them: `ServerArgs` extends EngineArgs with the server's
own fields; every field is a flag --<name> and an environment variable VLLMLITE_<NAME>.

Owns the flag table (built from the dataclass fields), text parsing, and the order flag, then variable,
then default. Knows nothing of routes or of the engine loop.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from vllmlite.api.openai.reasoning import REASONING_FORMATS
from vllmlite.api.routing_policy import RoutingPolicy
from vllmlite.engine.metrics import DEFAULT_PREFIX
from vllmlite.engine_args import EngineArgs, knob, parse_bytes
from vllmlite.models.model_source import DEFAULT_ALIASES, RANDOM_MODEL
from vllmlite.utils.argparse_utils import FlexibleArgumentParser, argparse_type, field_parsers, parse_bool

ENV_PREFIX = "VLLMLITE_"
DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def parse_json_list(text: str) -> tuple[str, ...]:
    """A JSON list of strings, as vLLM's --allowed-origins.

    >>> parse_json_list('["http://localhost:3000", "*"]')
    ('http://localhost:3000', '*')
    """
    try:
        values = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{text!r} is not JSON: {error}") from error
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise ValueError(f"{text!r} is not a JSON list of strings")
    return tuple(values)


def default_served_model_name(model: str) -> str:
    """The name clients put in `model`: SmolLM2's for the default model, else the path's name."""
    if model in DEFAULT_ALIASES:
        return DEFAULT_SERVED_NAME
    if model == RANDOM_MODEL:
        return RANDOM_MODEL
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name


@dataclass(frozen=True)
class ServerArgs(EngineArgs):
    """The engine's knobs plus the server's, validated at construction (the engine's too)."""

    host: str = knob("127.0.0.1", "address to listen on")
    port: int = knob(8000, "port to listen on")
    served_model_name: str | None = knob(None, "the name clients must send as `model` (default: "
                                               f"{DEFAULT_SERVED_NAME} for the default model, 'random', "
                                               "else the path's name)")
    api_key: str | None = knob(None, "require `Authorization: Bearer <key>` on every route but /health, "
                                     "/metrics, /version and the web page's files at / and /static/ (prefer the environment variable: flags show in `ps`)")
    api_key_on_metrics: bool = knob(False, "with --api-key, require the key on /metrics and /version too")
    metrics_prefix: str = knob(DEFAULT_PREFIX, "prefix of the Prometheus metric names; 'vllm' makes vLLM's own "
                                               "Grafana dashboard read them unchanged")
    log_stats_interval: float = knob(10.0, "seconds between the engine's stats log lines (throughput, "
                                           "requests, KV usage, prefix hit rate; 0: none)")
    max_queue: int | None = knob(256, "most requests waiting to run; beyond it requests get 503 with Retry-After")
    request_timeout: float | None = knob(None, "seconds a request may run before it is aborted with an error "
                                               "(default: no limit)")
    heartbeat_timeout: float | None = knob(60.0, "seconds a step may run before /health answers 503 and new "
                                                 "requests are refused until it completes (a hung engine loop)")
    max_body_bytes: int = knob(4 << 20, "largest request body in bytes (413 beyond it)", parse=parse_bytes)
    shutdown_timeout: float = knob(30.0, "seconds in-flight requests get to finish after SIGINT/SIGTERM")
    header_timeout: float = knob(10.0, "seconds a client has to send a request's headers (the connection is "
                                       "closed beyond it: half-sent requests hold nothing)")
    body_timeout: float = knob(30.0, "seconds a client has to send a request's body (408 beyond it)")
    limit_concurrency: int = knob(1024, "most open connections served; a request on a connection past it gets "
                                        "503 (but /health), and at most 64 such connections are held, the "
                                        "oldest closed first: file descriptors stay bounded")
    stream_send_timeout: float = knob(30.0, "seconds a streaming client may stop reading before its request "
                                            "is aborted and its KV cache freed")
    stream_ping_interval: float = knob(15.0, "seconds between keep-alive comments on a quiet event stream "
                                             "(0: none)")
    special_tokens_in_messages: bool = knob(False, "read special-token text in chat messages (e.g. "
                                                   "<|im_start|>) as the special tokens: only for trusted "
                                                   "callers, since it lets a message forge a system turn")
    enable_prompt_tokens_details: bool = knob(False, "show usage.prompt_tokens_details.cached_tokens (the prompt "
                                                     "tokens the prefix cache served) on chat and completions, "
                                                     "as vLLM's flag does (off: the field is null)")
    reasoning_parser: str | None = knob(None, "split a reasoning model's output into the message's `reasoning` "
                                              "and its `content`, as vLLM's flag does: one of "
                                              f"{', '.join(sorted(REASONING_FORMATS))} (default: no split)")
    enable_debug_endpoints: bool = knob(False, "serve GET /debug/requests, /debug/requests/{id} and /debug/engine "
                                               "(request traces, KV block states, recent steps, the config; "
                                               "behind the API key when there is one)")
    log_level: str = knob("info", f"one of {', '.join(LOG_LEVELS)}")
    allowed_origins: tuple[str, ...] | None = knob(None, "CORS: origins browsers may call from, a JSON list "
                                                         "(default: none without --api-key, the web page at / "
                                                         "being same-origin; any with it)", parse=parse_json_list)
    allowed_hosts: tuple[str, ...] = knob((), "Host header values accepted besides loopback names and the address "
                                              "listened on (any IP address when that is 0.0.0.0 or ::), a JSON "
                                              "list; '*' accepts any (DNS rebinding defence)", parse=parse_json_list)
    allowed_methods: tuple[str, ...] = knob(("*",), "CORS: allowed methods, a JSON list", parse=parse_json_list)
    allowed_headers: tuple[str, ...] = knob(("*",), "CORS: allowed request headers, a JSON list",
                                            parse=parse_json_list)
    allow_credentials: bool = knob(False, "CORS: let browsers send cookies and credentials")
    engine_process: bool | None = knob(None, "run the engine in a process of its own, so this server's work "
                                             "(HTTP, JSON, tokenizing) never shares a GIL with the engine's steps "
                                             "(default: on with --device cuda, off on the CPU; the Ray replicas "
                                             "are processes of their own already)")
    num_replicas: int = knob(1, "engine replicas: above 1, each is a Ray Serve deployment (pip install "
                                "vllmlite[ray]) behind this server's routes (docs/ray.md)")
    ray_address: str | None = knob(None, "Ray cluster to run the replicas on (default: start a local Ray)")
    routing: str = knob(RoutingPolicy.PREFIX_AWARE.value, "how requests pick a replica: "
                                                          f"{', '.join(p.value for p in RoutingPolicy)}")

    def __post_init__(self) -> None:
        checks = [
            (0 <= self.port <= 65535, f"port must be in [0, 65535], got {self.port}"),
            (self.max_queue is None or self.max_queue >= 1, f"max_queue must be >= 1, got {self.max_queue}"),
            (self.request_timeout is None or self.request_timeout > 0,
             f"request_timeout must be > 0 seconds, got {self.request_timeout}"),
            (self.heartbeat_timeout is None or self.heartbeat_timeout > 0,
             f"heartbeat_timeout must be > 0 seconds, got {self.heartbeat_timeout}"),
            (self.max_body_bytes >= 1, f"max_body_bytes must be >= 1, got {self.max_body_bytes}"),
            (self.shutdown_timeout >= 0, f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}"),
            (self.header_timeout > 0, f"header_timeout must be > 0 seconds, got {self.header_timeout}"),
            (self.body_timeout > 0, f"body_timeout must be > 0 seconds, got {self.body_timeout}"),
            (self.limit_concurrency >= 1, f"limit_concurrency must be >= 1, got {self.limit_concurrency}"),
            (self.stream_send_timeout > 0, f"stream_send_timeout must be > 0 seconds, got {self.stream_send_timeout}"),
            (self.stream_ping_interval >= 0, f"stream_ping_interval must be >= 0, got {self.stream_ping_interval}"),
            (self.log_level in LOG_LEVELS, f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}"),
            (self.api_key is None or len(self.api_key) > 0, "api_key must not be empty"),
            (re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", self.metrics_prefix) is not None,
             f"metrics_prefix must be a Prometheus name (letters, digits, _), got {self.metrics_prefix!r}"),
            (self.log_stats_interval >= 0, f"log_stats_interval must be >= 0, got {self.log_stats_interval}"),
            (self.num_replicas >= 1, f"num_replicas must be >= 1, got {self.num_replicas}"),
            (self.reasoning_parser is None or self.reasoning_parser in REASONING_FORMATS,
             f"reasoning_parser must be one of {sorted(REASONING_FORMATS)}, got {self.reasoning_parser!r}"),
            (self.routing in {p.value for p in RoutingPolicy},
             f"routing must be one of {[p.value for p in RoutingPolicy]}, got {self.routing!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        self._engine_config()  # the engine's own validation, at start-up

    @property
    def model_name(self) -> str:
        return self.served_model_name or default_served_model_name(self.model)

    @property
    def cors_origins(self) -> tuple[str, ...]:
        """The origins CORS lets read responses: --allowed-origins, else none without an API key (any
        page could otherwise drive a keyless server from a visitor's browser), any with one (the key
        is the guard, as in vLLM)."""
        if self.allowed_origins is not None:
            return self.allowed_origins
        return ("*",) if self.api_key else ()

    @property
    def uses_engine_process(self) -> bool:
        """--engine-process, else on a GPU only: there a step's ~150 kernel launches each wait for the GIL,
        which the event loop holds for a burst's intake (the first step of a burst of 256 took 0.64 s
        instead of 0.05 on the H200). The CPU kernels release it for most of a step, in a few long calls: a
        CPU burst served the same either way (bench.gpu --device cpu), and a second process costs memory."""
        return self.device == "cuda" if self.engine_process is None else self.engine_process

    @property
    def uses_ray(self) -> bool:
        return self.num_replicas > 1 or self.ray_address is not None

    def replica_args(self) -> dict[str, Any]:
        """These args as a dict for one replica: a single engine, no Ray of its own, and no API key
        (the ingress checks it; a deployment's arguments are visible to anyone who can see the cluster)."""
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "num_replicas": 1, "ray_address": None,
                "api_key": None}


@dataclass(frozen=True)
class Option:
    field: str                     # the ServerArgs field; the flag is --field with "_" -> "-"
    parse: Callable[[str], Any]    # text (a flag's or a variable's) -> value; ValueError when it is not one
    help: str
    default: Any

    @property
    def name(self) -> str:
        return self.field.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.field.upper()


def options_of(args_class: type) -> tuple[Option, ...]:
    parsers = field_parsers(args_class)
    return tuple(Option(f.name, parsers[f.name], f.metadata["help"], f.default) for f in fields(args_class))


OPTIONS = options_of(ServerArgs)


def _shown(default: Any) -> str:
    if default is None:
        return "unset"
    return json.dumps(list(default)) if isinstance(default, tuple) else str(default)


def build_parser() -> argparse.ArgumentParser:
    parser = FlexibleArgumentParser(  # vLLM's: --max_model_len is --max-model-len
        prog="python -m vllmlite.api.server",
        description="An OpenAI-compatible LLM server (vllmlite). Every option is also an environment "
                    f"variable {ENV_PREFIX}<NAME>; a flag wins over its variable.")
    for option in OPTIONS:
        text = f"{option.help} [env {option.env}; default: {_shown(option.default)}]"
        if option.parse is parse_bool:
            parser.add_argument(f"--{option.name}", action=argparse.BooleanOptionalAction, default=None,
                                help=text)
        else:
            parser.add_argument(f"--{option.name}", type=argparse_type(option.parse), default=None,
                                metavar=option.field.upper(), help=text)
    return parser


def parse_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] = os.environ) -> ServerArgs:
    """Flags, then VLLMLITE_* variables, then ServerArgs' defaults. Exits with a usage error on bad input."""
    parser = build_parser()
    args = parser.parse_args(argv)
    values: dict[str, Any] = {}
    for option in OPTIONS:
        value = getattr(args, option.field)
        if value is None and environ.get(option.env, "") != "":
            try:
                value = option.parse(environ[option.env])
            except ValueError as error:
                parser.error(f"{option.env}={environ[option.env]!r}: {error}")
        if value is not None:
            values[option.field] = value
    try:
        return ServerArgs(**values)
    except ValueError as error:
        parser.error(str(error))
        raise  # unreachable: parser.error exits
