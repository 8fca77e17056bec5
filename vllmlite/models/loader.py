"""Weights in: GGUF files, HF safetensors directories, or a seeded random model, as numpy arrays.

Owns tensor naming and layout (undoing llama.cpp's Q/K permutation, fusing QKV and gate/up);
knows nothing of the KV cache, batching or serving.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vllmlite.config import ModelConfig, RopeScaling, check_quantization
from vllmlite.kernels.quant import GGUF_TYPES, BlockRows, QuantizedMatrix, from_gguf, quantize_rows, tile
from vllmlite.models.model_source import RANDOM_MODEL, resolve_model
from vllmlite.progress import progress
from vllmlite.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, read_gguf_fields

logger = logging.getLogger(__name__)

GGUF_ARCHITECTURES = ("llama", "qwen2")
HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                    "Qwen2ForCausalLM": "qwen2"}


Matrix = np.ndarray | QuantizedMatrix  # a float array, or blocks of int8/int4 (vllmlite/kernels/quant.py)


@dataclass
class LayerWeights:
    attn_norm: np.ndarray        # [hidden]
    wqkv: Matrix                 # [(num_heads + 2 * num_kv_heads) * head_dim, hidden]
    bqkv: np.ndarray | None   # [(num_heads + 2 * num_kv_heads) * head_dim] (Qwen2) or None
    wo: Matrix                   # [hidden, num_heads * head_dim]
    ffn_norm: np.ndarray         # [hidden]
    w_gate_up: Matrix            # [2 * intermediate, hidden]
    w_down: Matrix               # [hidden, intermediate]


@dataclass
class ModelWeights:
    embed: Matrix                            # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: np.ndarray                   # [hidden]
    lm_head: Matrix                          # [vocab, hidden]; the embedding itself when tied
    rope_freq_factors: np.ndarray | None  # [head_dim / 2] (llama3 GGUFs) or None

    def _arrays(self) -> list[Matrix]:
        arrays = [self.embed, self.final_norm] + [a for layer in self.layers for a in vars(layer).values()
                                                  if a is not None]
        if self.lm_head is not self.embed:
            arrays.append(self.lm_head)
        return arrays

    @property
    def num_parameters(self) -> int:
        return sum(a.size for a in self._arrays())

    @property
    def num_bytes(self) -> int:
        """Bytes the weights take in memory (quantized matrices with their scales)."""
        return sum(a.nbytes for a in self._arrays())

    @property
    def dtype(self) -> np.dtype:
        """The float dtype of activations (quantized matrices are read as float32)."""
        return self.final_norm.dtype


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: ModelWeights
    tokenizer: Tokenizer
    source: str  # the resolved path, or "random"


def load_model(model: str, dtype: str = "float32", seed: int = 0, quantization: str = "none") -> LoadedModel:
    """Resolve `model` (see model_source) and load its config, weights and tokenizer.

    quantization "int8" or "int4" keeps the weight matrices (the embedding and LM head too) as
    blocks of 32 (vllmlite/kernels/quant.py): a GGUF tensor stored as Q8_0, Q4_0 or Q4_1 as it is stored,
    any float tensor rounded to the chosen format. Norms and biases stay float.
    """
    check_quantization(quantization, dtype)
    start = time.perf_counter()
    source = resolve_model(model)
    matrices = _Matrices(np.dtype(dtype), quantization)
    if source == RANDOM_MODEL:
        loaded = _load_random(matrices, seed)
    elif Path(source).is_dir():
        loaded = _load_hf_directory(Path(source), matrices)
    else:
        loaded = _load_gguf(Path(source), matrices)
    weights = loaded.weights
    logger.info("loaded %s (%s): %.1fM parameters, %.1f MiB as %s, in %.1f s", source,
                loaded.config.architecture, weights.num_parameters / 1e6, weights.num_bytes / 2**20,
                dtype if quantization == "none" else f"{quantization} ({matrices.describe()})",
                time.perf_counter() - start)
    return loaded


def quantize_weights(weights: ModelWeights, quantization: str) -> ModelWeights:
    """Float weights with every matrix rounded to `quantization` ("int8"/"int4"), as the loader
    does at load for an F32/F16 GGUF or an HF directory (norms and biases stay float)."""
    return _Matrices(weights.dtype, quantization).convert(weights)


Rows = np.ndarray | BlockRows  # a matrix while it is being assembled: rows can be reordered and stacked


class _Matrices:
    """Turns the weight matrices a loader reads into what the model runs on: float arrays of
    `dtype`, or with quantization, blocks as stored (GGUF Q8_0/Q4_0/Q4_1) or rounded to the format."""

    def __init__(self, dtype: np.dtype, quantization: str) -> None:
        self.dtype = dtype
        self.quantization = quantization
        self.stored: dict[str, int] = {}   # how many matrices came in each form, for the log

    def from_float(self, array: np.ndarray) -> Rows:
        if self.quantization == "none":
            return np.ascontiguousarray(array, dtype=self.dtype)
        self._count(f"float -> {self.quantization}")
        return quantize_rows(array, self.quantization)

    def from_blocks(self, blocks: BlockRows, type_name: str) -> Rows:
        self._count(f"{type_name} as stored")
        return blocks

    def _count(self, form: str) -> None:
        self.stored[form] = self.stored.get(form, 0) + 1

    @staticmethod
    def stack(parts: list[Rows]) -> Rows:
        """Row-wise, as fused QKV and gate/up matrices are built."""
        if all(isinstance(p, np.ndarray) for p in parts):
            return np.concatenate(parts)
        if not all(isinstance(p, BlockRows) for p in parts):
            raise ValueError("cannot fuse float and quantized matrices; every part must be quantized or none")
        return BlockRows.concat(parts)

    @staticmethod
    def finish(rows: Rows) -> Matrix:
        return tile(rows) if isinstance(rows, BlockRows) else rows

    def describe(self) -> str:
        return ", ".join(f"{count} {form}" for form, count in self.stored.items())

    def convert(self, weights: ModelWeights) -> ModelWeights:
        """Float weights (an HF directory, the random model) in this form; a tied LM head stays
        the embedding itself."""
        if self.quantization == "none":
            return weights

        def convert(a: np.ndarray) -> Matrix:
            return self.finish(self.from_float(a))
        layers = [dataclasses.replace(layer, wqkv=convert(layer.wqkv), wo=convert(layer.wo),
                                      w_gate_up=convert(layer.w_gate_up), w_down=convert(layer.w_down))
                  for layer in progress(weights.layers, f"Quantizing to {self.quantization}", unit="layer")]
        embed = convert(weights.embed)
        lm_head = embed if weights.lm_head is weights.embed else convert(weights.lm_head)
        return ModelWeights(embed, layers, weights.final_norm, lm_head, weights.rope_freq_factors)


# --- GGUF -------------------------------------------------------------------------------------

def _load_gguf(path: Path, matrices: _Matrices) -> LoadedModel:
    import gguf
    from gguf import quants

    reader = gguf.GGUFReader(str(path))
    fields = read_gguf_fields(reader, prefix="")
    arch = fields.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{path.name}: GGUF architecture {arch!r} is not supported ({GGUF_ARCHITECTURES})")
    tensors = {t.name: t for t in reader.tensors}
    dtype = matrices.dtype

    def get(name: str) -> np.ndarray:
        tensor = tensors[name]
        array = quants.dequantize(tensor.data, tensor.tensor_type)  # float32, numpy shape = reversed GGUF dims
        return np.ascontiguousarray(array.reshape(tuple(int(d) for d in reversed(tensor.shape))), dtype=dtype)

    def matrix(name: str) -> Rows:
        tensor = tensors[name]
        kind = tensor.tensor_type.name
        if matrices.quantization != "none" and kind in GGUF_TYPES:
            return matrices.from_blocks(from_gguf(tensor.data, kind, tuple(int(d) for d in reversed(tensor.shape))),
                                        kind)
        return matrices.from_float(get(name))

    config = _gguf_config(fields, arch, tensors)
    tokenizer = HFTokenizer.from_gguf_fields(fields)
    # llama.cpp's converter permutes Llama's Q and K rows for its rotary layout; qwen2 is stored as is.
    unpermute = arch == "llama"
    layers = []
    for i in progress(range(config.num_layers), f"Loading {path.name}", unit="layer"):
        p = f"blk.{i}."
        wq, wk = matrix(p + "attn_q.weight"), matrix(p + "attn_k.weight")
        if unpermute:
            wq, wk = _unpermute_rows(wq, config.num_heads), _unpermute_rows(wk, config.num_kv_heads)
        bias = None
        if p + "attn_q.bias" in tensors:
            bias = np.concatenate([get(p + "attn_q.bias"), get(p + "attn_k.bias"), get(p + "attn_v.bias")])
        layers.append(LayerWeights(
            attn_norm=get(p + "attn_norm.weight"),
            wqkv=matrices.finish(matrices.stack([wq, wk, matrix(p + "attn_v.weight")])),
            bqkv=bias,
            wo=matrices.finish(matrix(p + "attn_output.weight")),
            ffn_norm=get(p + "ffn_norm.weight"),
            w_gate_up=matrices.finish(matrices.stack([matrix(p + "ffn_gate.weight"), matrix(p + "ffn_up.weight")])),
            w_down=matrices.finish(matrix(p + "ffn_down.weight")),
        ))
    embed = matrices.finish(matrix("token_embd.weight"))
    lm_head = matrices.finish(matrix("output.weight")) if "output.weight" in tensors else embed
    freq_factors = get("rope_freqs.weight") if "rope_freqs.weight" in tensors else None
    weights = ModelWeights(embed, layers, get("output_norm.weight"), lm_head, freq_factors)
    return LoadedModel(config, weights, tokenizer, str(path))


def _gguf_config(fields: dict, arch: str, tensors: dict) -> ModelConfig:
    def key(name: str, default=None):
        return fields.get(f"{arch}.{name}", default)

    num_heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    vocab = key("vocab_size") or len(fields["tokenizer.ggml.tokens"])
    scaling = None
    kind = key("rope.scaling.type")
    if kind == "linear":
        scaling = RopeScaling("linear", float(key("rope.scaling.factor")))
    elif kind not in (None, "none"):
        raise ValueError(f"GGUF rope.scaling.type {kind!r} is not supported (linear; llama3 via rope_freqs)")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(key("attention.head_count_kv", num_heads)),
        head_dim=int(key("attention.key_length", hidden // num_heads)),
        max_position_embeddings=int(key("context_length", 2048)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
    )


def _unpermute_rows(weight: Rows, num_heads: int) -> Rows:
    """Undo llama.cpp's per-head interleave of rotary halves (convert_hf_to_gguf's `permute`).

    Per head, llama.cpp's rows are (pair 0 first half, pair 0 second half, pair 1 ...); HF's are
    (all first halves, all second halves): rows [heads, half, 2] -> [heads, 2, half]. Quantized
    rows move whole, blocks and scales with them.
    """
    out_dim = len(weight.qs) if isinstance(weight, BlockRows) else len(weight)
    half = out_dim // num_heads // 2
    order = np.arange(out_dim).reshape(num_heads, half, 2).swapaxes(1, 2).reshape(-1)
    return weight.take(order) if isinstance(weight, BlockRows) else weight[order]


# --- HF safetensors directories ---------------------------------------------------------------

def _load_hf_directory(path: Path, matrices: _Matrices) -> LoadedModel:
    from safetensors.numpy import load_file

    config_path = path / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{path} has no config.json; expected an HF model directory or a .gguf file")
    raw = json.loads(config_path.read_text())
    config = _hf_config(raw)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no *.safetensors files")
    state: dict[str, np.ndarray] = {}
    for file in progress(files, f"Loading {path.name}", unit="file"):
        state.update(load_file(str(file)))

    def get(name: str) -> np.ndarray:
        return np.ascontiguousarray(state[name], dtype=matrices.dtype)

    layers = [_hf_layer(get, f"model.layers.{i}.", config.attention_bias) for i in range(config.num_layers)]
    embed = get("model.embed_tokens.weight")
    lm_head = embed if config.tie_word_embeddings or "lm_head.weight" not in state else get("lm_head.weight")
    weights = matrices.convert(ModelWeights(embed, layers, get("model.norm.weight"), lm_head, None))
    tokenizer = HFTokenizer.from_directory(path)
    return LoadedModel(config, weights, tokenizer, str(path))


def _hf_layer(get: Callable[[str], np.ndarray], p: str, has_bias: bool) -> LayerWeights:
    a, m = p + "self_attn.", p + "mlp."
    bias = None
    if has_bias:
        bias = np.concatenate([get(a + "q_proj.bias"), get(a + "k_proj.bias"), get(a + "v_proj.bias")])
    return LayerWeights(
        attn_norm=get(p + "input_layernorm.weight"),
        wqkv=np.concatenate([get(a + "q_proj.weight"), get(a + "k_proj.weight"), get(a + "v_proj.weight")]),
        bqkv=bias,
        wo=get(a + "o_proj.weight"),
        ffn_norm=get(p + "post_attention_layernorm.weight"),
        w_gate_up=np.concatenate([get(m + "gate_proj.weight"), get(m + "up_proj.weight")]),
        w_down=get(m + "down_proj.weight"),
    )


def _hf_config(raw: dict) -> ModelConfig:
    names = raw.get("architectures") or []
    arch = next((HF_ARCHITECTURES[n] for n in names if n in HF_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(f"architectures {names} not supported; expected one of {list(HF_ARCHITECTURES)}")
    hidden, num_heads = raw["hidden_size"], raw["num_attention_heads"]
    max_len = raw.get("max_position_embeddings", 2048)
    window = raw.get("sliding_window")
    if window and raw.get("use_sliding_window", arch == "mistral"):
        # No sliding-window attention here: cap the context so every position stays exact.
        max_len = min(max_len, window)
    return ModelConfig(
        architecture=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads", num_heads),
        head_dim=raw.get("head_dim") or hidden // num_heads,
        max_position_embeddings=max_len,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=_hf_rope_theta(raw),
        rope_scaling=_hf_rope_scaling(raw.get("rope_scaling") or raw.get("rope_parameters")),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        attention_bias=arch == "qwen2" or raw.get("attention_bias", False),
    )


def _hf_rope_theta(raw: dict) -> float:
    params = raw.get("rope_parameters") or {}
    return float(raw.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _hf_rope_scaling(scaling: dict | None) -> RopeScaling | None:
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default"):
        return None
    if kind == "linear":
        return RopeScaling("linear", float(scaling["factor"]))
    if kind == "llama3":
        return RopeScaling("llama3", float(scaling["factor"]), float(scaling["low_freq_factor"]),
                           float(scaling["high_freq_factor"]),
                           int(scaling["original_max_position_embeddings"]))
    raise ValueError(f"rope_scaling type {kind!r} is not supported (linear, llama3)")


# --- seeded random model ------------------------------------------------------------------------

def random_model_config(vocab_size: int) -> ModelConfig:
    """The tiny test model: 2 layers, hidden 64, 4 heads / 2 KV heads over a byte vocabulary."""
    return ModelConfig(architecture="llama", vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                       max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=False)


def random_weights(config: ModelConfig, dtype: np.dtype, seed: int) -> ModelWeights:
    rng = np.random.default_rng(seed)
    h, d = config.hidden_size, config.head_dim
    qkv_rows = (config.num_heads + 2 * config.num_kv_heads) * d

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(dtype)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(h)).astype(dtype)

    layers = [LayerWeights(norm(), matrix(qkv_rows, h), None, matrix(h, config.num_heads * d), norm(),
                           matrix(2 * config.intermediate_size, h), matrix(h, config.intermediate_size))
              for _ in range(config.num_layers)]
    # Embeddings with unit-scale rows and an LM head scaled up so greedy choices are far from ties.
    embed = rng.standard_normal((config.vocab_size, h)).astype(dtype)
    lm_head = (4.0 * matrix(config.vocab_size, h)).astype(dtype)
    return ModelWeights(embed, layers, norm(), lm_head, None)


def _load_random(matrices: _Matrices, seed: int) -> LoadedModel:
    tokenizer = ByteTokenizer()
    config = random_model_config(tokenizer.vocab_size)
    weights = matrices.convert(random_weights(config, matrices.dtype, seed))
    return LoadedModel(config, weights, tokenizer, RANDOM_MODEL)
