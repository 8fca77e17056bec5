"""The server's configuration: every knob is a CLI flag and an environment variable VLLMLITE_<NAME>.

Owns option names, help, defaults, parsing (byte sizes such as 512M) and `ServerConfig`, which
builds the engine's EngineConfig. A flag wins over its environment variable. Knows nothing of
routes or of the engine loop.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllmlite.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from vllmlite.model_source import DEFAULT_ALIASES, RANDOM_MODEL

ENV_PREFIX = "VLLMLITE_"
DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """A byte count with an optional binary suffix.

    >>> parse_bytes("4096"), parse_bytes("512M"), parse_bytes("1G"), parse_bytes("1.5KiB")
    (4096, 536870912, 1073741824, 1536)
    """
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte size (e.g. 4096, 512M, 1G)")
    scale = 1 << (10 * " kmgt".index(match.group(2).lower() or " "))
    return int(float(match.group(1)) * scale)


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean (true/false)")


def default_served_model_name(model: str) -> str:
    """The name clients put in `model`: SmolLM2's for the default model, else the path's name."""
    if model in DEFAULT_ALIASES:
        return DEFAULT_SERVED_NAME
    if model == RANDOM_MODEL:
        return RANDOM_MODEL
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    model: str = "default"
    served_model_name: str | None = None
    dtype: str = "float32"
    seed: int = 0
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | None = None
    max_num_seqs: int = SchedulerConfig.max_num_seqs                       # the engine's defaults,
    max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens   # chosen by bench/sweep_defaults.sh
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    swap_space: float = 1.0
    batching: str = "continuous"
    speculative_config: str | None = None  # JSON, as vLLM's --speculative-config
    kernels: str | None = None
    quantization: str | None = None
    api_key: str | None = None
    max_queue: int | None = 256
    request_timeout: float | None = None
    max_body_bytes: int = 4 << 20
    shutdown_timeout: float = 30.0
    log_level: str = "info"

    def __post_init__(self) -> None:
        checks = [
            (0 <= self.port <= 65535, f"port must be in [0, 65535], got {self.port}"),
            (self.max_queue is None or self.max_queue >= 1, f"max_queue must be >= 1, got {self.max_queue}"),
            (self.request_timeout is None or self.request_timeout > 0,
             f"request_timeout must be > 0 seconds, got {self.request_timeout}"),
            (self.max_body_bytes >= 1, f"max_body_bytes must be >= 1, got {self.max_body_bytes}"),
            (self.shutdown_timeout >= 0, f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}"),
            (self.log_level in LOG_LEVELS, f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}"),
            (self.api_key is None or len(self.api_key) > 0, "api_key must not be empty"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        self.engine_config()  # the engine's own validation, at start-up

    @property
    def model_name(self) -> str:
        return self.served_model_name or default_served_model_name(self.model)

    def engine_config(self) -> EngineConfig:
        cache = CacheConfig(block_size=self.block_size, num_blocks=self.num_blocks,
                            kv_cache_memory=self.kv_cache_memory, enable_prefix_caching=self.enable_prefix_caching,
                            preemption_mode=self.preemption_mode, swap_space=self.swap_space)
        scheduler = SchedulerConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                                    max_model_len=self.max_model_len, batching=self.batching)
        speculative = None
        if self.speculative_config:
            try:
                values = json.loads(self.speculative_config)
            except json.JSONDecodeError as error:
                raise ValueError(f"speculative_config is not valid JSON: {error}") from error
            if not isinstance(values, dict):
                raise ValueError("speculative_config must be a JSON object")
            speculative = SpeculativeConfig.from_dict(values)
        return EngineConfig(model=self.model, dtype=self.dtype, seed=self.seed, cache=cache, scheduler=scheduler,
                            speculative=speculative, kernels=self.kernels,
                            quantization=self.quantization)


@dataclass(frozen=True)
class Option:
    name: str                      # the flag without "--"; the field is name with "-" -> "_"
    parse: Callable[[str], Any]
    help: str

    @property
    def field(self) -> str:
        return self.name.replace("-", "_")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.field.upper()


OPTIONS = (
    Option("host", str, "address to listen on"),
    Option("port", int, "port to listen on"),
    Option("model", str, "'default' (SmolLM2-135M-Instruct), 'random' (tiny seeded test model), a .gguf "
                         "file or an HF directory"),
    Option("served-model-name", str, "the name clients must send as `model` (default: SmolLM2-135M-Instruct "
                                     "for the default model, 'random', else the path's name)"),
    Option("dtype", str, "weights and KV cache dtype: float32 or float64"),
    Option("seed", int, "seed of the random model and of unseeded requests"),
    Option("block-size", int, "tokens per KV cache block"),
    Option("num-blocks", int, "KV cache blocks (overrides --kv-cache-memory)"),
    Option("kv-cache-memory", parse_bytes, "KV cache budget in bytes; suffixes K/M/G (binary) accepted, "
                                           "e.g. 512M (default when unset: 1G)"),
    Option("max-num-seqs", int, "most sequences in one step"),
    Option("max-num-batched-tokens", int, "token budget of one step (the chunked-prefill chunk)"),
    Option("max-model-len", int, "context length (default: the model's)"),
    Option("enable-prefix-caching", parse_bool, "reuse cached KV blocks of shared prompt prefixes"),
    Option("preemption-mode", str, "under memory pressure: recompute or swap"),
    Option("swap-space", float, "GiB of host memory for swapped-out blocks (preemption-mode swap)"),
    Option("batching", str, "continuous (default), or static: admit a new batch of up to max-num-seqs only "
                            "when the running batch has finished (a baseline for benchmarks)"),
    Option("speculative-config", str, "speculative decoding as JSON, e.g. '{\"method\": \"ngram\", "
                                      "\"num_speculative_tokens\": 4}' (methods: ngram, draft_model, self_draft)"),
    Option("kernels", str, "hot-path kernels: numba (compiled, the default) or numpy (the readable references)"),
    Option("quantization", str, "weights: none (float32), int8 or int4, in blocks of 32; GGUF Q8_0/Q4_0/Q4_1 "
                                "tensors are kept as stored, float ones rounded at load"),
    Option("api-key", str, "require `Authorization: Bearer <key>` on every route but /health "
                           "(prefer the environment variable: flags show in `ps`)"),
    Option("max-queue", int, "most requests waiting to run; beyond it requests get 503 with Retry-After"),
    Option("request-timeout", float, "seconds a request may run before it is aborted with an error "
                                     "(default: no limit)"),
    Option("max-body-bytes", parse_bytes, "largest request body in bytes (413 beyond it)"),
    Option("shutdown-timeout", float, "seconds in-flight requests get to finish after SIGINT/SIGTERM"),
    Option("log-level", str, f"one of {', '.join(LOG_LEVELS)}"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vllmlite.api.server",
        description="An OpenAI-compatible LLM server (vllmlite). Every option is also an environment "
                    f"variable {ENV_PREFIX}<NAME>; a flag wins over its variable.")
    defaults = ServerConfig.__dataclass_fields__
    for option in OPTIONS:
        default = defaults[option.field].default
        shown = "unset" if default is None else default
        text = f"{option.help} [env {option.env}; default: {shown}]"
        if option.parse is parse_bool:
            parser.add_argument(f"--{option.name}", action=argparse.BooleanOptionalAction, default=None,
                                help=text)
        else:
            parser.add_argument(f"--{option.name}", type=option.parse, default=None,
                                metavar=option.field.upper(), help=text)
    return parser


def parse_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] = os.environ) -> ServerConfig:
    """Flags, then VLLMLITE_* variables, then ServerConfig's defaults. Exits with a usage error on bad input."""
    parser = build_parser()
    args = parser.parse_args(argv)
    values: dict[str, Any] = {}
    for option in OPTIONS:
        value = getattr(args, option.field)
        if value is None and environ.get(option.env, "") != "":
            try:
                value = option.parse(environ[option.env])
            except (ValueError, argparse.ArgumentTypeError) as error:
                parser.error(f"{option.env}={environ[option.env]!r}: {error}")
        if value is not None:
            values[option.field] = value
    try:
        return ServerConfig(**values)
    except ValueError as error:
        parser.error(str(error))
        raise  # unreachable: parser.error exits
