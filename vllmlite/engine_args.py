"""EngineArgs: every engine knob, declared once, with its default and help (as vLLM's arg_utils).

The CLI flags, the VLLMLITE_<NAME> variables, `LLM(**kwargs)` and the tests' engine factory are derived
from these fields; `create_engine_config()` turns them into the validated runtime EngineConfig. A knob
the runtime configs also hold takes its default from them, so no default is written twice.
Knows nothing of HTTP, requests or tensors.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from vllmlite.config import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_KV_CACHE_MEMORY,
    QUANTIZATIONS,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
    TraceConfig,
)
from vllmlite.utils.argparse_utils import ArgumentContainer, add_dataclass_args

logger = logging.getLogger("vllmlite.engine_args")

# Knobs that LLM() and the tests' engine factory also take from VLLMLITE_<NAME> when not given (the
# server's CLI reads every knob's variable itself). The one place the engine's environment is read.
ENV_KNOBS = ("kernels", "quantization")
RUNNERS = ("auto", "generate", "pooling")  # vLLM's --runner; one engine here generates and embeds

# dtype names vLLM users pass -> the dtype computed here; half precisions are computed in float32
# (numpy has no bfloat16, and float16 matmuls on the CPU are slower than float32 ones).
DTYPE_ALIASES = {"auto": EngineConfig.dtype, "float": "float32", "float32": "float32",
                 "double": "float64", "float64": "float64"}
HALF_DTYPES = ("half", "float16", "bfloat16")
TORCH_DTYPE_ALIASES = DTYPE_ALIASES | {"half": "float16", "float16": "float16", "bfloat16": "bfloat16"}


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """A byte count with an optional binary suffix.

    >>> parse_bytes("4096"), parse_bytes("512M"), parse_bytes("1G"), parse_bytes("1.5KiB")
    (4096, 536870912, 1073741824, 1536)
    """
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a byte size (e.g. 4096, 512M, 1G)")
    scale = 1 << (10 * " kmgt".index(match.group(2).lower() or " "))
    return int(float(match.group(1)) * scale)


def knob(default: Any, help: str, *, parse: Callable[[str], Any] | None = None,
         ignored: str | None = None) -> Any:
    """A field with its help text; `parse` reads it from text when its type does not say how;
    `ignored` says why a value other than the default has no effect on this CPU build."""
    return field(default=default, metadata={"help": help, "parse": parse, "ignored": ignored})


def available_memory_bytes() -> int:
    """RAM the OS can hand out now without swapping: MemAvailable from /proc/meminfo, else free pages."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass(frozen=True)
class EngineArgs:
    """The engine's knobs as users give them; `create_engine_config()` validates them."""

    model: str = knob(EngineConfig.model, "'default' (SmolLM2-135M-Instruct), 'random' (tiny seeded test model), "
                                          "a .gguf file or an HF directory")
    tokenizer: str | None = knob(None, "the tokenizer: unset or the model itself (the model's own tokenizer is "
                                       "always used)")
    dtype: str = knob("auto", f"weights and KV cache: auto (= {EngineConfig.dtype}; bfloat16 on cuda), float32 or "
                              "float64; half, float16 and bfloat16 compute in float32 (logged) except on the torch "
                              "kernels, which compute in them")
    device: str = knob(EngineConfig.device, "cpu, or cuda: the torch kernels on an NVIDIA GPU (the cuda extra)")
    seed: int = knob(EngineConfig.seed, "seed of the random model and of unseeded requests")
    max_model_len: int | None = knob(SchedulerConfig.max_model_len, "context length (default: the model's)")
    block_size: int = knob(CacheConfig.block_size, "tokens per KV cache block")
    num_blocks: int | None = knob(CacheConfig.num_blocks, "KV cache blocks (overrides --kv-cache-memory and "
                                                          "--gpu-memory-utilization)")
    kv_cache_memory: int | None = knob(
        CacheConfig.kv_cache_memory, "KV cache budget in bytes; suffixes K/M/G (binary) accepted, e.g. 512M "
        f"(when neither this nor --gpu-memory-utilization is set: {DEFAULT_KV_CACHE_MEMORY >> 20}M)",
        parse=parse_bytes)
    gpu_memory_utilization: float | None = knob(
        CacheConfig.gpu_memory_utilization, "on cuda, the fraction in (0, 1] of the GPU's memory the engine may fill, weights and activations "
              f"included, the KV cache taking the rest (default {DEFAULT_GPU_MEMORY_UTILIZATION} there); on the "
              "CPU, the fraction of the RAM free at start-up given to the KV cache (exclusive with "
              "--kv-cache-memory)")
    enable_prefix_caching: bool = knob(CacheConfig.enable_prefix_caching,
                                       "reuse cached KV blocks of shared prompt prefixes")
    preemption_mode: str = knob(CacheConfig.preemption_mode, "under memory pressure: recompute or swap")
    swap_space: float = knob(CacheConfig.swap_space, "GiB of host memory for swapped-out blocks "
                                                     "(preemption-mode swap)")
    max_num_seqs: int = knob(SchedulerConfig.max_num_seqs, "most sequences in one step")
    max_num_batched_tokens: int = knob(SchedulerConfig.max_num_batched_tokens,
                                       "token budget of one step (the chunked-prefill chunk)")
    batching: str = knob(SchedulerConfig.batching, "continuous, or static: admit a new batch of up to "
                                                   "max-num-seqs only when the running batch has finished "
                                                   "(a baseline for benchmarks)")
    prefill_chunking: str = knob(SchedulerConfig.prefill_chunking,
                                 "prompt chunk size per step: fixed (whatever max-num-batched-tokens leaves after "
                                 "the decodes) or adaptive (sized from a step-time model fitted online so the "
                                 "running decodes meet --target-tpot-ms; smaller under memory pressure)")
    target_tpot_ms: float | None = knob(SchedulerConfig.target_tpot_ms,
                                        "prefill-chunking adaptive: the step time (ms per output token) the "
                                        "running decodes should see while prompts are prefilled (default: 1.5x "
                                        "their own step's time, from the fitted model)")
    num_scheduler_steps: int = knob(SchedulerConfig.num_scheduler_steps,
                                    "cuda: decode passes replayed back to back per scheduling step when every "
                                    "sequence decodes greedily (multi-step decoding: less host time per token, "
                                    "tokens arrive in groups; ignored without CUDA graphs)")
    async_scheduling: bool = knob(SchedulerConfig.async_scheduling,
                                  "cuda: schedule and launch the next greedy decode step while the device runs "
                                  "this one, so the host's work between steps overlaps the device's (a request "
                                  "arriving at a free seat waits one step more; ignored without CUDA graphs)")
    speculative_config: dict | str | None = knob(
        None, "speculative decoding as JSON (a dict in LLM()), e.g. "
              "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' (methods: ngram, draft_model, self_draft)",
        parse=str)
    kernels: str | None = knob(EngineConfig.kernels, "hot-path kernels: numba (compiled; the default unless "
                                                     "$VLLMLITE_KERNELS says) or numpy (the readable references)")
    quantization: str | None = knob(EngineConfig.quantization, f"weights: {', '.join(QUANTIZATIONS)}, in blocks "
                                                               "of 32; GGUF Q8_0/Q4_0/Q4_1 tensors are kept as "
                                                               "stored, float ones rounded at load")
    int_dot: bool = knob(EngineConfig.int_dot, "round activations to 8 bits and use integer dot products on "
                                               "int8/int4 weights, as llama.cpp does (needs --quantization int8 "
                                               "or int4 and the numba or numpy kernels); changes tokens slightly")
    pooling: str = knob(EngineConfig.pooling, "embeddings (LLM.embed, /v1/embeddings): the final-norm hidden state "
                                              "of the prompt's last token (last) or their average over the "
                                              "prompt (mean), L2-normalized (llama-server's --pooling)")
    trace_ring_size: int = knob(TraceConfig.trace_ring_size, "requests whose lifecycle trace is kept (live plus "
                                                             "recently finished; 0 turns tracing off)")
    trace_max_events: int = knob(TraceConfig.trace_max_events, "events kept per traced request (the first ones; "
                                                               "later ones are only counted)")
    debug_store_prompts: bool = knob(TraceConfig.debug_store_prompts, "keep each traced request's prompt, shown "
                                                                      "by /debug/requests (off: no prompt text "
                                                                      "is kept)")
    tensor_parallel_size: int = knob(1, "must be 1: the engine is one CPU process")
    kv_cache_dtype: str = knob(CacheConfig.kv_cache_dtype, "K/V storage: auto (the model's dtype); fp16/float16, "
                                                           "bf16/bfloat16 or int8 (turned by a Hadamard matrix; "
                                                           "a float32 scale per token, KV head and 16 values) "
                                                           "on the numpy/numba kernels; "
                                                           "fp8/fp8_e4m3 (float8, no scale) on torch/cuda")
    trust_remote_code: bool = knob(False, "accepted for vLLM's scripts; no model code is ever run",
                                   ignored="vllmlite never runs model code")
    enforce_eager: bool = knob(EngineConfig.enforce_eager, "cuda: launch every step from Python, no CUDA graphs (ignored on the CPU)")
    disable_custom_all_reduce: bool = knob(False, "GPU-only; ignored", ignored="GPU-only")
    cpu_offload_gb: float = knob(0.0, "GPU-only (weights already live in RAM); ignored", ignored="GPU-only")
    disable_log_stats: bool = knob(False, "accepted for vLLM's scripts; ignored",
                                   ignored="the engine logs no periodic stats")
    runner: str = knob("auto", f"vLLM's model runner ({', '.join(RUNNERS)}): any engine here both generates "
                               "and embeds, so the choice changes nothing",
                       ignored="one engine serves LLM.generate and LLM.embed alike")

    @staticmethod
    def add_cli_args(parser: ArgumentContainer) -> ArgumentContainer:
        """vLLM's `EngineArgs.add_cli_args`: a flag per knob (`--max-model-len`, `--no-enable-prefix-caching`)
        on `parser` or an argument group of one, defaults the knobs' own; returns it. The flags' values,
        `vars(parser.parse_args())`, are keywords `LLM(...)` takes (less the script's own flags)."""
        return add_dataclass_args(parser, EngineArgs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The EngineArgs in parsed flags (the script's own flags are left out)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    def create_engine_config(self) -> EngineConfig:
        """The validated runtime config (a ValueError names the bad knob); logs what has no effect here."""
        config = self._engine_config()
        for level, message in self._notes():
            logger.log(level, message)
        return config

    def _engine_config(self) -> EngineConfig:
        for f in fields(self):   # LLM(enable_prefix_caching="no") must not pass as true
            value = getattr(self, f.name)
            _require(not isinstance(f.default, bool) or type(value) is bool,
                     f"{f.name} must be True or False, got {value!r}")
        _require(self.tensor_parallel_size == 1,
                 f"tensor_parallel_size must be 1 (one CPU process), got {self.tensor_parallel_size!r}")
        _require(self.cpu_offload_gb >= 0, f"cpu_offload_gb must be >= 0, got {self.cpu_offload_gb!r}")
        _require(self.runner in RUNNERS, f"runner must be one of {RUNNERS}, got {self.runner!r}")
        _require(self.tokenizer in (None, self.model) or Path(self.tokenizer).resolve() == Path(self.model).resolve(),
                 f"tokenizer must be unset or the model ({self.model!r}): a separate tokenizer is not "
                 f"supported, got {self.tokenizer!r}")
        return EngineConfig(model=self.model, dtype=self.resolved_dtype, seed=self.seed,
                            cache=CacheConfig(**self._values_for(CacheConfig, kv_cache_memory=self._kv_budget(),
                                                                 gpu_memory_utilization=self._gpu_fraction())),
                            scheduler=SchedulerConfig(**self._values_for(SchedulerConfig)),
                            speculative=self._speculative(), kernels=self._or_env("kernels"),
                            quantization=self._or_env("quantization"), int_dot=self.int_dot,
                            pooling=self.pooling, trace=TraceConfig(**self._values_for(TraceConfig)),
                            device=self.device, enforce_eager=self.enforce_eager)

    @property
    def resolved_dtype(self) -> str:
        """The dtype computed in: vLLM's names mapped; an unknown name passes on to EngineConfig's check."""
        if self.uses_torch:
            return TORCH_DTYPE_ALIASES.get(self.dtype, self.dtype) if self.dtype != "auto" else \
                ("bfloat16" if self.device == "cuda" else "float32")
        if self.dtype in HALF_DTYPES:
            return "float32"
        return DTYPE_ALIASES.get(self.dtype, self.dtype)

    @property
    def uses_torch(self) -> bool:
        return self.device != "cpu" or self._or_env("kernels") == "torch"

    def _values_for(self, config_class: type, **replaced: Any) -> dict[str, Any]:
        """This object's values for every field of `config_class` (same names), with `replaced` on top."""
        return {f.name: getattr(self, f.name) for f in fields(config_class) if f.name not in replaced} | replaced

    def _or_env(self, name: str) -> Any:
        """Knob `name` (one of ENV_KNOBS), else $VLLMLITE_<NAME> (empty counts as unset), else None."""
        return getattr(self, name) or os.environ.get(f"VLLMLITE_{name.upper()}") or None

    def _kv_budget(self) -> int | None:
        """kv_cache_memory, or on the CPU gpu_memory_utilization of the RAM available now, in bytes
        (on a GPU the engine sizes the cache once the weights are there: _gpu_fraction)."""
        fraction = self.gpu_memory_utilization
        if fraction is None:
            return self.kv_cache_memory
        _require(isinstance(fraction, (int, float)) and 0 < fraction <= 1,
                 f"gpu_memory_utilization must be in (0, 1], got {fraction!r}")
        _require(self.kv_cache_memory is None,
                 "kv_cache_memory and gpu_memory_utilization both size the KV cache: give one")
        return None if self.device == "cuda" else max(1, int(fraction * available_memory_bytes()))

    def _gpu_fraction(self) -> float | None:
        """On cuda, the fraction of the GPU's memory the engine may fill, when the KV cache is not
        sized otherwise (vLLM's default 0.9)."""
        if self.device != "cuda" or self.num_blocks is not None or self.kv_cache_memory is not None:
            return None
        return self.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION

    def _speculative(self) -> SpeculativeConfig | None:
        values = self.speculative_config
        if not values:
            return None
        if isinstance(values, str):
            try:
                values = json.loads(values)
            except json.JSONDecodeError as error:
                raise ValueError(f"speculative_config is not valid JSON: {error}") from error
        _require(isinstance(values, dict), "speculative_config must be a JSON object")
        return SpeculativeConfig.from_dict(values)

    def _notes(self) -> Iterator[tuple[int, str]]:
        """(log level, line) for each knob that was set but does not do here what it says."""
        if self.enforce_eager and self.device == "cpu":
            yield logging.INFO, "ignoring enforce_eager=True: CUDA graphs are GPU-only"
        if self.num_scheduler_steps > 1 and (self.device == "cpu" or self.enforce_eager):
            yield logging.INFO, (f"ignoring num_scheduler_steps={self.num_scheduler_steps}: multi-step decoding "
                                 "replays CUDA graphs (device cuda, not enforce_eager)")
        if self.async_scheduling and (self.device == "cpu" or self.enforce_eager):
            yield logging.INFO, ("ignoring async_scheduling=True: it launches CUDA graphs ahead "
                                 "(device cuda, not enforce_eager)")
        if self.dtype in HALF_DTYPES and not self.uses_torch:
            yield logging.WARNING, f"dtype {self.dtype!r} computes in float32 (no half-precision CPU kernels)"
        for f in fields(EngineArgs):
            reason = f.metadata["ignored"]
            if reason and getattr(self, f.name) != f.default:
                yield logging.INFO, f"ignoring {f.name}={getattr(self, f.name)!r}: {reason}"


ENGINE_ARG_NAMES = frozenset(f.name for f in fields(EngineArgs))
