"""Weights in: GGUF files, HF safetensors directories, or a seeded random model, as numpy arrays.

Owns the weight layout (undoing llama.cpp's Q/K permutation, fusing QKV and gate/up); which tensor
names and config fields a family has comes from its module (models/registry.py finds it, see
models/families). Knows nothing of the KV cache, batching or serving.
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

from vllmlite.config import ModelConfig, check_quantization
from vllmlite.kernels.quant import GGUF_TYPES, BlockRows, QuantizedMatrix, from_gguf, quantize_rows, tile
from vllmlite.models import registry
from vllmlite.models.families.common import LayerNames
from vllmlite.models.model_source import RANDOM_MODEL, resolve_model
from vllmlite.progress import progress
from vllmlite.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from vllmlite.utils.gguf_file import GGUFFile

logger = logging.getLogger(__name__)

Matrix = np.ndarray | QuantizedMatrix  # a float array, or blocks of int8/int4 (vllmlite/kernels/quant.py)


@dataclass
class LayerWeights:
    """One layer in the shared layout; the optional fields are None where a family has no such tensor."""

    attn_norm: np.ndarray | None  # [hidden]; None: no norm before attention (post-norm OLMo 2)
    wqkv: Matrix                 # [(num_heads + 2 * num_kv_heads) * head_dim, hidden]
    bqkv: np.ndarray | None   # [(num_heads + 2 * num_kv_heads) * head_dim] (Qwen2) or None
    wo: Matrix                   # [hidden, num_heads * head_dim]
    ffn_norm: np.ndarray | None  # [hidden]; None: no norm before the MLP (OLMo 2)
    w_gate_up: Matrix | None     # [2 * intermediate, hidden]; None in a MoE layer
    w_down: Matrix | None        # [hidden, intermediate]
    q_norm: np.ndarray | None = None  # [head_dim] (qk_norm "head") or [heads * head_dim] ("full")
    k_norm: np.ndarray | None = None  # [head_dim] or [kv_heads * head_dim]
    post_attn_norm: np.ndarray | None = None  # [hidden] on the attention's output (Gemma, OLMo 2)
    post_ffn_norm: np.ndarray | None = None   # [hidden] on the MLP's output
    router: np.ndarray | None = None             # [experts, hidden] in a MoE layer
    w_experts_gate_up: np.ndarray | None = None  # [experts, 2 * expert_intermediate, hidden]: gate rows, up rows
    w_experts_down: np.ndarray | None = None     # [experts, hidden, expert_intermediate]


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

        def convert(a: np.ndarray | None) -> Matrix | None:
            return None if a is None else self.finish(self.from_float(a))
        layers = [dataclasses.replace(layer, wqkv=convert(layer.wqkv), wo=convert(layer.wo),
                                      w_gate_up=convert(layer.w_gate_up), w_down=convert(layer.w_down))
                  for layer in progress(weights.layers, f"Quantizing to {self.quantization}", unit="layer")]
        embed = convert(weights.embed)
        lm_head = embed if weights.lm_head is weights.embed else convert(weights.lm_head)
        return ModelWeights(embed, layers, weights.final_norm, lm_head, weights.rope_freq_factors)


# --- reading a family's tensors -------------------------------------------------------------

@dataclass
class _TensorSource:
    """A file's tensors by name: `matrix` gives rows to stack (float or quantized blocks), `vector`
    a float array (norms, biases)."""

    names: set[str]
    matrix: Callable[[str], Rows]
    vector: Callable[[str], np.ndarray]


def _check_experts_quantization(config: ModelConfig, quantization: str) -> None:
    """The moe kernel reads float expert weights: a quantized MoE model is refused, not dequantized."""
    if config.num_experts and quantization != "none":
        raise NotImplementedError(f"quantization {quantization!r} is not supported for mixture-of-experts models "
                                  f"({config.architecture}: the moe kernel reads float expert weights); "
                                  "load it with quantization 'none'")


def _read_weights(source: _TensorSource, names: LayerNames, config: ModelConfig, matrices: _Matrices,
                  unpermute_qk: bool, label: str, freq_factors: np.ndarray | None = None) -> ModelWeights:
    """Every layer by the family's name table (see families/common.LayerNames), under progress `label`."""
    _check_experts_quantization(config, matrices.quantization)
    layers = []
    for i in progress(range(config.num_layers), label, unit="layer"):
        def vector(name: str | None, suffix: str = ".weight") -> np.ndarray | None:
            return None if name is None else source.vector(name.format(i=i) + suffix)

        def matrix(parts: tuple[str, ...] | str) -> Matrix:
            parts = (parts,) if isinstance(parts, str) else parts
            return matrices.finish(matrices.stack([source.matrix(p.format(i=i) + ".weight") for p in parts]))

        def experts(parts: tuple[str, ...] | str) -> np.ndarray:
            """[experts, rows, cols]: each part stacked over `{e}` (one tensor per expert) or already
            3-D (GGUF), the parts side by side in rows (gate, up)."""
            def stacked(name: str) -> np.ndarray:
                if "{e}" not in name:
                    return source.vector(name.format(i=i) + ".weight")
                return np.stack([source.vector(name.format(i=i, e=e) + ".weight") for e in range(config.num_experts)])
            parts = (parts,) if isinstance(parts, str) else parts
            return np.concatenate([stacked(p) for p in parts], axis=1)

        fused = names.fused_experts and [n.format(i=i) for n in names.fused_experts]
        if config.is_moe_layer(i) and fused and fused[1] in source.names:
            mlp = dict(w_gate_up=None, w_down=None, router=source.vector(fused[0]),
                       w_experts_gate_up=source.vector(fused[1]), w_experts_down=source.vector(fused[2]))
        elif config.is_moe_layer(i):
            mlp = dict(w_gate_up=None, w_down=None, router=vector(names.router),
                       w_experts_gate_up=experts(names.experts_gate_up), w_experts_down=experts(names.experts_down))
        else:
            mlp = dict(w_gate_up=matrix(names.gate_up), w_down=matrix(names.down))

        qkv = [source.matrix(p.format(i=i) + ".weight") for p in names.qkv]
        if unpermute_qk and len(qkv) == 3:
            qkv[0], qkv[1] = _unpermute_rows(qkv[0], config.num_heads), _unpermute_rows(qkv[1], config.num_kv_heads)
        bias = np.concatenate([vector(p, ".bias") for p in names.qkv]) if config.attention_bias else None
        layers.append(LayerWeights(
            attn_norm=vector(names.attn_norm), wqkv=matrices.finish(matrices.stack(qkv)), bqkv=bias,
            wo=matrix(names.wo), ffn_norm=vector(names.ffn_norm), q_norm=vector(names.q_norm),
            k_norm=vector(names.k_norm), post_attn_norm=vector(names.post_attn_norm),
            post_ffn_norm=vector(names.post_ffn_norm), **mlp))
    embed = matrices.finish(source.matrix(names.embed + ".weight"))
    has_head = not config.tie_word_embeddings and names.lm_head + ".weight" in source.names
    lm_head = matrices.finish(source.matrix(names.lm_head + ".weight")) if has_head else embed
    return ModelWeights(embed, layers, source.vector(names.final_norm + ".weight"), lm_head, freq_factors)


# --- GGUF -------------------------------------------------------------------------------------

def _load_gguf(path: Path, matrices: _Matrices) -> LoadedModel:
    from gguf import quants

    reader = GGUFFile(path)
    fields = reader.fields
    arch = registry.from_gguf(fields.get("general.architecture"))
    family = arch.module()
    tensors = reader.tensors
    dtype = matrices.dtype

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"{path.name}: tensor {name!r} missing (a {arch.name} GGUF has it)")
        tensor = tensors[name]
        array = quants.dequantize(tensor.data, tensor.tensor_type)  # float32, numpy shape = reversed GGUF dims
        return np.ascontiguousarray(array.reshape(tuple(int(d) for d in reversed(tensor.shape))), dtype=dtype)

    def matrix(name: str) -> Rows:
        tensor = tensors.get(name)
        kind = tensor.tensor_type.name if tensor is not None else None
        if matrices.quantization != "none" and kind in GGUF_TYPES:
            return matrices.from_blocks(from_gguf(tensor.data, kind, tuple(int(d) for d in reversed(tensor.shape))),
                                        kind)
        return matrices.from_float(get(name))

    config = family.gguf_config(fields, arch.name, tensors)
    tokenizer = HFTokenizer.from_gguf_fields(fields)
    freq_factors = get("rope_freqs.weight") if "rope_freqs.weight" in tensors else None
    # llama.cpp's converter permutes llama-arch Q and K rows for its rotary layout; others are stored as is.
    weights = _read_weights(_TensorSource(set(tensors), matrix, get), family.GGUF_NAMES, config, matrices,
                            family.GGUF_PERMUTES_QK, f"Loading {path.name}", freq_factors)
    config, weights = family.finish(config, weights)
    return LoadedModel(config, weights, tokenizer, str(path))


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
    arch = registry.from_hf(raw.get("architectures") or [])
    family = arch.module()
    config = family.hf_config(raw, arch.name)
    _check_experts_quantization(config, matrices.quantization)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no *.safetensors files")
    state: dict[str, np.ndarray] = {}
    for file in progress(files, f"Loading {path.name}", unit="file"):
        state.update(load_file(str(file)))

    def get(name: str) -> np.ndarray:
        if name not in state:
            raise ValueError(f"{path}: tensor {name!r} missing (a {arch.name} checkpoint has it)")
        return np.ascontiguousarray(state[name], dtype=matrices.dtype)

    offset = getattr(family, "HF_NORM_OFFSET", 0.0)

    def vector(name: str) -> np.ndarray:
        return get(name) + offset if offset and name.endswith("norm.weight") else get(name)

    float_matrices = _Matrices(matrices.dtype, "none")   # quantized after the family's folds
    weights = _read_weights(_TensorSource(set(state), get, vector), family.HF_NAMES, config, float_matrices, False,
                            "Reading layers")
    config, weights = family.finish(config, weights)
    weights = matrices.convert(weights)
    tokenizer = HFTokenizer.from_directory(path)
    return LoadedModel(config, weights, tokenizer, str(path))


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
