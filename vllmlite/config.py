"""Configuration dataclasses: the model's shape, the KV cache, the scheduler and the engine.

Every knob is validated at construction so a bad value fails at start-up, not mid-request. Users
set them through EngineArgs (engine_args.py), which takes its defaults from these classes.
This module knows nothing of requests, tensors or HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

DTYPES = ("float32", "float64")
TORCH_DTYPES = DTYPES + ("bfloat16", "float16")  # the torch backend also computes in half precision
DEVICES = ("cpu", "cuda")
DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}
QK_NORMS = ("head", "full")  # RMSNorm of Q and K: per head over head_dim (Qwen3), over the projection (OLMo 2)
NORM_PLACEMENTS = ("pre", "sandwich", "post")  # Llama; Gemma 2/3 (pre and post); OLMo 2 (post only)
HIDDEN_ACTS = ("silu", "gelu_tanh")  # the gated MLP's activation
LAYER_TYPES = ("full", "sliding")  # attention over the whole context, or the last sliding_window tokens
QUANTIZATIONS = ("none", "int8", "int4")  # weight-only, blocks of 32 (vllmlite/kernels/quant.py)
KERNEL_BACKENDS = ("numba", "numpy", "torch")  # vllmlite/kernels: compiled (default), numpy references, torch
INT_DOT_QUANTIZATIONS = ("int8", "int4")  # what int_dot multiplies as integers
INT_DOT_KERNELS = ("numba", "numpy")      # the backends that have the integer products
PREEMPTION_MODES = ("recompute", "swap")
TORCH_KV_KINDS = {"float16": "fp16", "bfloat16": "bf16"}  # the torch kernels' half dtypes as KV kinds
TORCH_ONLY_KV_KINDS = ("fp8",)   # what only the torch kernels store: float8 e4m3 tensors (kv_dtype.py)
# kv_cache_dtype: vLLM's names and ours -> the kind the KV cache stores (vllmlite/kernels/kv_dtype.py)
KV_CACHE_DTYPES = {"auto": "auto", "fp16": "fp16", "float16": "fp16", "bf16": "bf16", "bfloat16": "bf16",
                   "int8": "int8", "fp8": "fp8", "fp8_e4m3": "fp8"}
PREFILL_CHUNKING = ("fixed", "adaptive")  # vllmlite/core/chunking.py
MAX_SCHEDULER_STEPS = 64
POOLING_TYPES = ("last", "mean")  # embeddings: the values of pooling_params.PoolingType
DEFAULT_KV_CACHE_MEMORY = 1 << 30  # 1 GiB: about 23k tokens of SmolLM2-135M in float32
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's: of the GPU's memory, weights and activations included


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def check_quantization(quantization: str, dtype: str) -> None:
    """A known format, and float32 activations when the weights are quantized (the kernels')."""
    _require(quantization in QUANTIZATIONS, f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    _require(quantization == "none" or dtype == "float32",
             f"quantization {quantization!r} computes in float32; got dtype {dtype!r}")


@dataclass(frozen=True)
class RopeScaling:
    """Rotary scaling: "linear" divides every frequency; "llama3" scales only the low ones;
    "longrope" (Phi-3) divides frequency i by short_factor[i], or by long_factor[i] when the
    engine's context exceeds original_max_position_embeddings (llama.cpp's choice, made once)."""

    rope_type: Literal["linear", "llama3", "longrope"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    attention_factor: float = 1.0  # scales cos and sin (longrope's magnitude correction)
    short_factor: tuple[float, ...] | None = None  # longrope: [rotary_dim / 2]
    long_factor: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        _require(self.rope_type in ("linear", "llama3", "longrope"),
                 f"rope_scaling type {self.rope_type!r} is not supported (linear, llama3, longrope)")
        _require(self.factor > 0, f"rope_scaling factor must be > 0, got {self.factor}")
        _require(self.rope_type != "longrope" or (self.short_factor is not None and self.long_factor is not None
                                                  and len(self.short_factor) == len(self.long_factor)),
                 "longrope needs short_factor and long_factor of one length")


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder, as read from GGUF metadata or config.json by its family module
    (vllmlite/models/families). The fields after `attention_bias` are the per-family features of
    the shared forward pass; each defaults to Llama's behaviour."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    qk_norm: str | None = None  # a QK_NORMS name: RMSNorm of Q and K before RoPE
    norm_placement: str = "pre"  # a NORM_PLACEMENTS name
    hidden_act: str = "silu"  # a HIDDEN_ACTS name
    embedding_multiplier: float = 1.0  # the embedding rows are scaled by it (Gemma: sqrt(hidden), Granite)
    attention_scale: float | None = None  # softmax scale of q.k; None: 1 / sqrt(head_dim)
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcap: float | None = None  # the same on the logits
    logit_multiplier: float = 1.0  # logits are scaled by it (Granite: 1 / logits_scaling)
    residual_multiplier: float = 1.0  # each sublayer's output is scaled by it before the residual add (Granite)
    layer_types: tuple[str, ...] | None = None  # per layer, a LAYER_TYPES name; None: all "full"
    sliding_window: int | None = None  # tokens a "sliding" layer sees, itself included
    rope_layers: tuple[bool, ...] | None = None  # per layer, whether it applies RoPE; None: all do
    rope_local_theta: float | None = None  # RoPE base of the sliding layers, unscaled (Gemma 3); None: as global
    partial_rotary_factor: float = 1.0  # RoPE rotates the first factor * head_dim dims of each head
    num_experts: int = 0  # routed experts of a sparse MoE block; 0: every layer has the dense MLP
    num_experts_per_tok: int = 0  # top_k: the experts each token runs
    moe_intermediate_size: int | None = None  # an expert's width; None: intermediate_size
    norm_topk_prob: bool = True  # the top_k weights renormalized to sum to 1 (Mixtral; per config elsewhere)
    moe_layers: tuple[bool, ...] | None = None  # per layer, whether its MLP is the MoE block; None: all

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            _require(getattr(self, name) >= 1, f"{name} must be >= 1")
        _require(self.num_heads % self.num_kv_heads == 0,
                 f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        _require(self.rotary_dim % 2 == 0 and 2 <= self.rotary_dim <= self.head_dim,
                 f"the rotary dims must be even, >= 2 and <= head_dim {self.head_dim}, got {self.rotary_dim}")
        factors = self.rope_scaling.short_factor if self.rope_scaling is not None else None
        _require(factors is None or len(factors) == self.rotary_dim // 2,
                 f"longrope factors must number rotary_dim / 2 = {self.rotary_dim // 2}")
        _require(self.qk_norm in (None,) + QK_NORMS, f"qk_norm must be one of {QK_NORMS} or None, got {self.qk_norm!r}")
        _require(self.norm_placement in NORM_PLACEMENTS,
                 f"norm_placement must be one of {NORM_PLACEMENTS}, got {self.norm_placement!r}")
        _require(self.hidden_act in HIDDEN_ACTS, f"hidden_act must be one of {HIDDEN_ACTS}, got {self.hidden_act!r}")
        _require(self.num_experts == 0 or 1 <= self.num_experts_per_tok <= self.num_experts,
                 f"num_experts_per_tok must be in [1, num_experts ({self.num_experts})], got {self.num_experts_per_tok}")
        for name in ("layer_types", "rope_layers", "moe_layers"):
            values = getattr(self, name)
            _require(values is None or len(values) == self.num_layers,
                     f"{name} must have one entry per layer ({self.num_layers})")
        _require(all(t in LAYER_TYPES for t in self.layer_types or ()),
                 f"layer_types must be {LAYER_TYPES}, got {self.layer_types}")
        _require("sliding" not in (self.layer_types or ()) or (self.sliding_window or 0) >= 1,
                 "sliding layers need sliding_window >= 1")
        for name in ("attn_logit_softcap", "final_logit_softcap", "attention_scale", "embedding_multiplier",
                     "logit_multiplier", "residual_multiplier"):
            value = getattr(self, name)
            _require(value is None or 0 < value < float("inf"), f"{name} must be finite and > 0, got {value}")

    @property
    def rotary_dim(self) -> int:
        """The dims of each head that RoPE rotates (all, unless partial_rotary_factor < 1)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def first_layers(self, num_layers: int) -> ModelConfig:
        """The model cut to its first `num_layers` layers (a self-draft), per-layer lists with it."""
        def cut(values: tuple | None) -> tuple | None:
            return None if values is None else values[:num_layers]
        return replace(self, num_layers=num_layers, layer_types=cut(self.layer_types), rope_layers=cut(self.rope_layers))

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer] if self.layer_types else "full"

    @property
    def uniform_sliding_window(self) -> int | None:
        """The window when every layer is sliding (Mistral): no token older than it is ever read
        again, so the KV blocks before it can be freed. None when any layer sees the whole context."""
        if self.layer_types is None or "full" in self.layer_types:
            return None
        return self.sliding_window

    def uses_rope(self, layer: int) -> bool:
        return self.rope_layers[layer] if self.rope_layers else True

    def is_moe_layer(self, layer: int) -> bool:
        """Whether the layer's MLP is the routed experts (else the dense gated MLP)."""
        return self.num_experts > 0 and (self.moe_layers[layer] if self.moe_layers else True)

    @property
    def expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """Bytes of K and V one token holds across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size and pool size (a block count, or a byte budget)."""

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | None = None  # bytes; used when num_blocks is not given
    # On a GPU, when neither of the above is given: the fraction of the device's memory the engine
    # may fill, weights and activations included; the KV cache gets what they leave (engine/memory.py).
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    swap_space: float = 1.0  # GiB of host memory for swapped-out blocks (preemption_mode="swap")
    kv_cache_dtype: str = "auto"  # a KV_CACHE_DTYPES name: auto is the model's dtype

    def __post_init__(self) -> None:
        _require(isinstance(self.block_size, int) and 1 <= self.block_size <= 1024,
                 f"block_size must be an integer in [1, 1024], got {self.block_size!r}")
        _require(self.num_blocks is None or self.num_blocks >= 1,
                 f"num_blocks must be >= 1, got {self.num_blocks}")
        _require(self.kv_cache_memory is None or self.kv_cache_memory > 0,
                 f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        _require(self.gpu_memory_utilization is None or 0 < self.gpu_memory_utilization <= 1,
                 f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        _require(self.preemption_mode in PREEMPTION_MODES,
                 f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        _require(self.swap_space >= 0, f"swap_space must be >= 0 GiB, got {self.swap_space}")
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES,
                 f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")

    @property
    def kv_kind(self) -> str:
        """What the KV cache stores: auto (the model's dtype), fp16, bf16, int8 or fp8."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype]

    def resolve_num_blocks(self, bytes_per_block: int) -> int:
        """Blocks in the device pool: num_blocks if given, else the memory budget divided by block bytes."""
        if self.num_blocks is not None:
            return self.num_blocks
        budget = self.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY
        num_blocks = budget // bytes_per_block
        _require(num_blocks >= 1, f"kv_cache_memory {budget} B holds no block of {bytes_per_block} B")
        return num_blocks

    def resolve_num_host_blocks(self, bytes_per_block: int) -> int:
        if self.preemption_mode != "swap":
            return 0
        return int(self.swap_space * (1 << 30)) // bytes_per_block


@dataclass(frozen=True)
class SchedulerConfig:
    """How much work one step may take: sequences and tokens (the chunked-prefill budget)."""

    # Defaults chosen by bench/sweep_defaults.sh (results/serve_defaults_sweep.json): on the 48-request
    # burst, 64 sequences with 256 tokens per step gave the most output tok/s and the lowest TTFT.
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 256
    max_model_len: int | None = None  # defaults to the model's context length
    batching: str = "continuous"  # "static": admit a new batch only when the running one is done (a baseline)
    prefill_chunking: str = "fixed"  # "adaptive": prompt chunks sized to meet target_tpot_ms (chunking.py)
    # adaptive: the step time running decodes should see while prompts are prefilled; None: 1.5x the
    # time of the decodes' own step, as the step-time model predicts it (chunking.DEFAULT_TPOT_SLACK)
    target_tpot_ms: float | None = None
    # Multi-step decoding (vLLM's num_scheduler_steps): a step whose every sequence decodes greedily
    # replays its CUDA graph this many times back to back, each pass fed the last one's tokens on
    # the device, before the host schedules again (worker/cuda_graphs.py). 1: one pass per step.
    num_scheduler_steps: int = 1
    # vLLM's --async-scheduling: queue the next greedy decode step while one runs (core/async_scheduler.py)
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        _require(self.batching in ("continuous", "static"),
                 f"batching must be 'continuous' or 'static', got {self.batching!r}")
        _require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _require(self.max_num_batched_tokens >= 1,
                 f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        _require(self.prefill_chunking in PREFILL_CHUNKING,
                 f"prefill_chunking must be one of {PREFILL_CHUNKING}, got {self.prefill_chunking!r}")
        _require(self.target_tpot_ms is None or self.target_tpot_ms > 0,
                 f"target_tpot_ms must be > 0, got {self.target_tpot_ms}")
        _require(self.max_model_len is None or self.max_model_len >= 2,
                 f"max_model_len must be >= 2, got {self.max_model_len}")
        _require(type(self.num_scheduler_steps) is int and 1 <= self.num_scheduler_steps <= MAX_SCHEDULER_STEPS,
                 f"num_scheduler_steps must be an integer in [1, {MAX_SCHEDULER_STEPS}], "
                 f"got {self.num_scheduler_steps!r}")
        _require(not self.async_scheduling or self.prefill_chunking == "fixed",
                 "async_scheduling needs prefill_chunking 'fixed': adaptive chunking times each step alone")
        _require(self.num_scheduler_steps == 1 or self.prefill_chunking == "fixed",
                 "num_scheduler_steps > 1 needs prefill_chunking 'fixed': adaptive chunking's step-time model "
                 "describes one pass a step")


@dataclass(frozen=True)
class TraceConfig:
    """Request lifecycle tracing (tracing.py): how many recent requests and events per request are kept."""

    trace_ring_size: int = 1000        # requests kept (live plus recently finished); 0 turns tracing off
    trace_max_events: int = 64         # events kept per request (the first ones; the rest are counted)
    debug_store_prompts: bool = False  # keep each traced request's prompt for /debug/requests

    def __post_init__(self) -> None:
        _require(self.trace_ring_size >= 0, f"trace_ring_size must be >= 0, got {self.trace_ring_size}")
        _require(self.trace_max_events >= 1, f"trace_max_events must be >= 1, got {self.trace_max_events}")


SPECULATIVE_METHODS = ("ngram", "draft_model", "self_draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, named as vLLM names it: `{"method": ..., "num_speculative_tokens": k}`."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1           # ngram: shortest suffix to look up
    prompt_lookup_max: int = 4           # ngram: longest suffix to look up
    model: str | None = None          # draft_model: path of a model sharing the tokenizer
    num_draft_layers: int | None = None  # self_draft: the target's first L layers (default: a quarter)

    def __post_init__(self) -> None:
        _require(self.method in SPECULATIVE_METHODS,
                 f"speculative method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        _require(isinstance(self.num_speculative_tokens, int) and 1 <= self.num_speculative_tokens <= 16,
                 f"num_speculative_tokens must be an integer in [1, 16], got {self.num_speculative_tokens!r}")
        _require(1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
                 "need 1 <= prompt_lookup_min <= prompt_lookup_max")
        _require(self.method != "draft_model" or bool(self.model),
                 "speculative method 'draft_model' needs a draft 'model' (a path, or 'random')")
        _require(self.num_draft_layers is None or self.num_draft_layers >= 1,
                 f"num_draft_layers must be >= 1, got {self.num_draft_layers}")

    @classmethod
    def from_dict(cls, values: dict) -> SpeculativeConfig:
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(values) - known
        _require(not unknown, f"unknown speculative_config keys {sorted(unknown)}")
        return cls(**values)


@dataclass(frozen=True)
class EngineConfig:
    """Everything LLMEngine needs to start: which model, its dtype, and the cache and scheduler."""

    model: str = "default"
    dtype: str = "float32"
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None
    kernels: str | None = None  # a KERNEL_BACKENDS name; None: the default (kernel_backend)
    quantization: str | None = None  # a QUANTIZATIONS name; None: "none" (weight_quantization)
    int_dot: bool = False  # quantized weights times activations rounded to 8 bits (kernels/int_dot.py)
    pooling: str = "last"  # embeddings: a POOLING_TYPES name
    trace: TraceConfig = field(default_factory=TraceConfig)
    device: str = "cpu"  # a DEVICES name; "cuda" computes with the torch kernels on the GPU
    enforce_eager: bool = False  # cuda: no CUDA graphs, every step launched from Python

    def __post_init__(self) -> None:
        _require(self.device in DEVICES, f"device must be one of {DEVICES}, got {self.device!r}")
        _require(self.device == "cpu" or self.kernels in (None, "torch"),
                 f"device {self.device!r} computes with the torch kernels, not {self.kernels!r}")
        dtypes = TORCH_DTYPES if self.uses_torch else DTYPES
        _require(self.dtype in dtypes, f"dtype must be one of {dtypes}, got {self.dtype!r}")
        _require(self.kernels is None or self.kernels in KERNEL_BACKENDS,
                 f"kernels must be one of {KERNEL_BACKENDS}, got {self.kernels!r}")
        _require(not self.int_dot or self.kernel_backend in INT_DOT_KERNELS,
                 f"int_dot needs the {' or '.join(INT_DOT_KERNELS)} kernels, got {self.kernel_backend!r}")
        _require(not self.int_dot or self.weight_quantization in INT_DOT_QUANTIZATIONS,
                 f"int_dot multiplies quantized weights as integers: it needs quantization "
                 f"{' or '.join(INT_DOT_QUANTIZATIONS)}, got {self.weight_quantization!r}")
        _require(not self.uses_torch or self.weight_quantization == "none",
                 "the torch kernels compute on dequantized weights: quantization must be 'none'")
        _require(self.pooling in POOLING_TYPES, f"pooling must be one of {POOLING_TYPES}, got {self.pooling!r}")
        check_quantization(self.weight_quantization, self.dtype)
        _require(not self.uses_torch or self.cache.kv_kind in ("auto", "fp8", TORCH_KV_KINDS.get(self.dtype)),
                 f"kv_cache_dtype {self.cache.kv_cache_dtype!r} needs the numpy or numba kernels: the torch "
                 f"kernels keep K/V in the model's dtype ({self.dtype}; kv_cache_dtype auto) or in fp8")
        _require(self.uses_torch or self.cache.kv_kind not in TORCH_ONLY_KV_KINDS,
                 f"kv_cache_dtype {self.cache.kv_cache_dtype!r} needs the torch kernels (kernels='torch' or "
                 f"device='cuda'): the numpy and numba kernels store auto, fp16, bf16 or int8")
        _require(self.scheduler.num_scheduler_steps == 1 or self.speculative is None,
                 "num_scheduler_steps > 1 and speculative decoding both fill the slots after a decode: use one")

    @property
    def kernel_backend(self) -> str:
        """The kernels in effect: the knob, else the first of KERNEL_BACKENDS (numba); torch on a GPU.
        The environment is EngineArgs' to read ($VLLMLITE_KERNELS), never this config's."""
        return "torch" if self.device != "cpu" else self.kernels or KERNEL_BACKENDS[0]

    @property
    def uses_torch(self) -> bool:
        return self.kernel_backend == "torch"

    @property
    def kv_kind(self) -> str:
        """What the KV cache stores on this backend: the torch kernels store auto (their own dtype,
        also when kv_cache_dtype names it) or fp8; the numpy-memory backends any kind of kv_dtype.py."""
        kind = self.cache.kv_kind
        return kind if not self.uses_torch or kind in TORCH_ONLY_KV_KINDS else "auto"

    @property
    def load_dtype(self) -> str:
        """The dtype weights are read into on the host (half precisions: float32, cast on the device)."""
        return self.dtype if self.dtype in DTYPES else "float32"

    @property
    def weight_quantization(self) -> str:
        """The quantization in effect: the knob, else "none" (EngineArgs reads $VLLMLITE_QUANTIZATION)."""
        return self.quantization or "none"


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)

