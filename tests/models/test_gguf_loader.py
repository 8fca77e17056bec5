"""Synthetic GGUF files in every quantization gguf can write: Q/K un-permuted, dequantized, tied or
not, through the dense reference and the engine; and clear errors for GGUF features not supported."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from gguf import quants
from loader_util import engine_logits
from reference import dense_logits, dequantized

from vllmlite.config import ModelConfig, RopeScaling
from vllmlite.kernels.quant import QuantizedMatrix, dequantize, dequantize_block_rows, quantize_rows
from vllmlite.models.loader import LayerWeights, LoadedModel, ModelWeights, _unpermute_rows, load_model, random_weights
from vllmlite.tokenizer import bytes_to_unicode

# --- GGUF -----------------------------------------------------------------------------------------

GGUF_TOKENS = ["<s>", "</s>", *(bytes_to_unicode()[b] for b in range(256)), "he", "hel", "lo", "hello"]
GGUF_MERGES = ["h e", "he l", "l o", "hel lo"]
RMS_EPS = 2.0 ** -16  # exactly representable in GGUF's float32 field

# (weights, logits): max |loaded - original| as a fraction of the tensor's (or the logits') max |value|.
# Weight bounds follow each format's step: F16 2^-11, BF16 2^-8, Q8_0 half of max/127 (scale in F16),
# Q5_1/Q4_1 half of (max - min)/31 or /15, Q5_0/Q4_0 up to a whole max/16 or max/8 step (their
# largest magnitude maps to -16 or -8, so the opposite sign clips). Logit bounds are about twice
# what this seeded model measures; F32 logits agree to 1e-5 absolute.
QUANT_TOLERANCES = {
    QType.F32: (0.0, 0.0),
    QType.F16: (1e-3, 1e-3),
    QType.BF16: (5e-3, 1e-2),
    QType.Q8_0: (5e-3, 3e-2),
    QType.Q5_1: (4e-2, 1e-1),
    QType.Q5_0: (7e-2, 1.2e-1),
    QType.Q4_1: (8e-2, 2.5e-1),
    QType.Q4_0: (1.3e-1, 2.5e-1),
}


@dataclasses.dataclass(frozen=True)
class GGUFSpec:
    arch: str = "llama"
    tied: bool = True
    qtype: QType = QType.F32
    rope_scaling: tuple[str, float] | None = None  # rope.scaling.type and .factor
    freq_factors: bool = False  # a llama3-style rope_freqs.weight tensor


def gguf_config(spec: GGUFSpec) -> ModelConfig:
    return ModelConfig(architecture=spec.arch, vocab_size=len(GGUF_TOKENS), hidden_size=64, intermediate_size=128,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=128,
                       rms_norm_eps=RMS_EPS, rope_theta=10000.0,
                       rope_scaling=RopeScaling(*spec.rope_scaling) if spec.rope_scaling else None,
                       tie_word_embeddings=spec.tied, attention_bias=spec.arch == "qwen2")


def original_weights(spec: GGUFSpec, seed: int = 3) -> ModelWeights:
    """A seeded random model in HF layout (float32), with biases for qwen2 and freq factors if asked."""
    config = gguf_config(spec)
    weights = random_weights(config, np.dtype(np.float32), seed)
    rng = np.random.default_rng(seed + 1)
    if spec.arch == "qwen2":
        for layer in weights.layers:
            layer.bqkv = (0.5 * rng.standard_normal(layer.wqkv.shape[0])).astype(np.float32)
    lm_head = weights.embed if spec.tied else weights.lm_head
    factors = np.geomspace(1.0, 8.0, config.head_dim // 2).astype(np.float32) if spec.freq_factors else None
    return dataclasses.replace(weights, lm_head=lm_head, rope_freq_factors=factors)


def split_qkv(config: ModelConfig, fused: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    q_end = config.num_heads * config.head_dim
    k_end = q_end + config.num_kv_heads * config.head_dim
    return fused[:q_end], fused[q_end:k_end], fused[k_end:]


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (applied to Q and K rows)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def roundtrip(w: np.ndarray, qtype: QType) -> np.ndarray:
    """What a reader gets back after storing the float32 matrix `w` as `qtype`."""
    if qtype == QType.F32:
        return w
    if qtype == QType.F16:
        return w.astype(np.float16).astype(np.float32)
    return quants.dequantize(quants.quantize(w, qtype), qtype)


def quantized_weights(spec: GGUFSpec, w: ModelWeights) -> ModelWeights:
    """The weights a perfect loader returns: matrices through the quantization, 1-D tensors as is.
    Quantization blocks run along rows, so quantizing before or after the Q/K permutation is the same."""
    layers = [dataclasses.replace(layer, wqkv=roundtrip(layer.wqkv, spec.qtype), wo=roundtrip(layer.wo, spec.qtype),
                                  w_gate_up=roundtrip(layer.w_gate_up, spec.qtype),
                                  w_down=roundtrip(layer.w_down, spec.qtype)) for layer in w.layers]
    embed = roundtrip(w.embed, spec.qtype)
    return dataclasses.replace(w, embed=embed, layers=layers,
                               lm_head=embed if spec.tied else roundtrip(w.lm_head, spec.qtype))


def write_gguf(path: Path, spec: GGUFSpec, w: ModelWeights) -> None:
    config = gguf_config(dataclasses.replace(spec, rope_scaling=None))  # the shape; scaling written below
    writer = gguf.GGUFWriter(str(path), spec.arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_layers)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_theta)
    if spec.rope_scaling:
        writer.add_rope_scaling_type(gguf.RopeScalingType(spec.rope_scaling[0]))
        writer.add_rope_scaling_factor(spec.rope_scaling[1])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(GGUF_TOKENS)
    writer.add_token_types([3, 3] + [1] * (len(GGUF_TOKENS) - 2))
    writer.add_token_merges(GGUF_MERGES)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(True)

    def add(name: str, array: np.ndarray) -> None:
        if array.ndim == 1 or spec.qtype == QType.F32:  # llama.cpp keeps norms and biases in F32
            writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
        elif spec.qtype == QType.F16:
            writer.add_tensor(name, array.astype(np.float16))
        else:
            writer.add_tensor(name, quants.quantize(array, spec.qtype), raw_dtype=spec.qtype)

    add("token_embd.weight", w.embed)
    add("output_norm.weight", w.final_norm)
    if not spec.tied:
        add("output.weight", w.lm_head)
    if w.rope_freq_factors is not None:
        add("rope_freqs.weight", w.rope_freq_factors)
    for i, layer in enumerate(w.layers):
        p = f"blk.{i}."
        wq, wk, wv = split_qkv(config, layer.wqkv)
        if spec.arch == "llama":
            wq, wk = llama_cpp_permute(wq, config.num_heads), llama_cpp_permute(wk, config.num_kv_heads)
        add(p + "attn_norm.weight", layer.attn_norm)
        add(p + "attn_q.weight", wq)
        add(p + "attn_k.weight", wk)
        add(p + "attn_v.weight", wv)
        if layer.bqkv is not None:
            for name, bias in zip(("attn_q", "attn_k", "attn_v"), split_qkv(config, layer.bqkv)):
                add(p + name + ".bias", bias)
        add(p + "attn_output.weight", layer.wo)
        add(p + "ffn_norm.weight", layer.ffn_norm)
        gate, up = np.split(layer.w_gate_up, 2)
        add(p + "ffn_gate.weight", gate)
        add(p + "ffn_up.weight", up)
        add(p + "ffn_down.weight", layer.w_down)
    finish(writer)


def finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def as_float64(config: ModelConfig, w: ModelWeights) -> LoadedModel:
    def cast(a):
        return None if a is None else a.astype(np.float64)
    layers = [LayerWeights(*(cast(a) for a in vars(layer).values())) for layer in w.layers]
    embed = cast(w.embed)
    lm_head = embed if w.lm_head is w.embed else cast(w.lm_head)
    return LoadedModel(config, ModelWeights(embed, layers, cast(w.final_norm), lm_head, cast(w.rope_freq_factors)),
                       None, "reference")


def weight_arrays(w: ModelWeights) -> dict[str, np.ndarray]:
    arrays = {"embed": w.embed, "final_norm": w.final_norm, "lm_head": w.lm_head}
    for i, layer in enumerate(w.layers):
        arrays.update({f"{i}.{k}": a for k, a in vars(layer).items() if a is not None})
    if w.rope_freq_factors is not None:
        arrays["rope_freq_factors"] = w.rope_freq_factors
    return arrays


BYTE = 2  # GGUF_TOKENS id of byte 0; "he" 258, "hel" 259, "lo" 260, "hello" 261
TOKEN_IDS = [0, 261, BYTE + ord(" "), 259, 258, 260, BYTE + ord("!"), 1, 5, BYTE + ord("x"), 261, 260, 258,
             BYTE + ord("a")]

GGUF_SPECS = [GGUFSpec(qtype=q) for q in QUANT_TOLERANCES] + [
    GGUFSpec(tied=False, rope_scaling=("linear", 2.0)),
    GGUFSpec(tied=False, qtype=QType.Q8_0),
    GGUFSpec(freq_factors=True),
    GGUFSpec(arch="qwen2", tied=False),
    GGUFSpec(arch="qwen2", tied=True, qtype=QType.Q4_1),
]


def spec_id(spec: GGUFSpec) -> str:
    extras = [name for name, on in (("untied", not spec.tied), ("linear", spec.rope_scaling),
                                    ("freqs", spec.freq_factors)) if on]
    return "-".join([spec.arch, spec.qtype.name, *extras])


@pytest.mark.parametrize("spec", GGUF_SPECS, ids=spec_id)
def test_gguf_weights_and_logits_match_originals(tmp_path, spec):
    original = original_weights(spec)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, spec, original)
    loaded = load_model(str(path))
    config = gguf_config(spec)
    assert loaded.config == config
    assert loaded.source == str(path)
    assert (loaded.weights.lm_head is loaded.weights.embed) == spec.tied

    # The loader's weights are exactly what the quantization gives back, in HF's row order ...
    expected = quantized_weights(spec, original)
    got, want, orig = weight_arrays(loaded.weights), weight_arrays(expected), weight_arrays(original)
    assert got.keys() == want.keys()
    weight_tol, logit_tol = QUANT_TOLERANCES[spec.qtype]
    for name in want:
        assert got[name].dtype == np.float32 and got[name].shape == want[name].shape, name
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
        # ... and within the quantization's error of the originals.
        scale = np.abs(orig[name]).max()
        assert np.abs(got[name] - orig[name]).max() <= weight_tol * scale, name

    logits = dense_logits(loaded, TOKEN_IDS)  # float32, like the loader's default
    np.testing.assert_allclose(logits, dense_logits(as_float64(config, expected), TOKEN_IDS), rtol=0, atol=1e-4)
    reference = dense_logits(as_float64(config, original), TOKEN_IDS)
    atol = max(1e-5, logit_tol * np.abs(reference).max())
    np.testing.assert_allclose(logits, reference, rtol=0, atol=atol)
    if logit_tol <= 3e-2:
        np.testing.assert_array_equal(logits.argmax(axis=-1), reference.argmax(axis=-1))


def test_gguf_engine_logits_and_tokenizer(tmp_path):
    spec = GGUFSpec(tied=False)
    original = original_weights(spec)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, spec, original)
    loaded = load_model(str(path))
    tok = loaded.tokenizer
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_id) == (len(GGUF_TOKENS), 0, 1)
    assert tok.encode("hello hel!") == [0, 261, BYTE + ord(" "), 259, BYTE + ord("!")]
    assert tok.decode(tok.encode("hello, wörld"), skip_special_tokens=True) == "hello, wörld"

    reference = dense_logits(as_float64(gguf_config(spec), original), TOKEN_IDS)
    run = engine_logits(str(path), TOKEN_IDS, block_size=4, budget=6)
    np.testing.assert_allclose(run.logits, reference, rtol=0, atol=1e-5)
    assert run.greedy_token == int(np.argmax(reference[-1]))


@pytest.mark.parametrize("qtype", [QType.F32, QType.F16, QType.Q8_0])
def test_gguf_shape_convention_round_trips(tmp_path, qtype):
    """add_tensor stores numpy [out, in] as GGUF dims (in, out); the loader's reversed reshape
    gives [out, in] back, row for row."""
    rng = np.random.default_rng(0)
    matrix = rng.standard_normal((3, 64)).astype(np.float32)  # [out, in]
    vector = rng.standard_normal(5).astype(np.float32)
    path = tmp_path / "shapes.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    if qtype == QType.F32:
        writer.add_tensor("m", matrix)
    elif qtype == QType.F16:
        writer.add_tensor("m", matrix.astype(np.float16))
    else:
        writer.add_tensor("m", quants.quantize(matrix, qtype), raw_dtype=qtype)
    writer.add_tensor("v", vector)
    finish(writer)
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    assert list(tensors["m"].shape) == [64, 3] and list(tensors["v"].shape) == [5]
    assert tensors["m"].tensor_type == qtype
    back = {name: quants.dequantize(t.data, t.tensor_type).reshape(tuple(int(d) for d in reversed(t.shape)))
            for name, t in tensors.items()}
    np.testing.assert_array_equal(back["m"], roundtrip(matrix, qtype))
    np.testing.assert_array_equal(back["v"], vector)


QUANTIZED_SPECS = [GGUFSpec(qtype=QType.Q4_1), GGUFSpec(qtype=QType.Q4_0, tied=False), GGUFSpec(qtype=QType.Q8_0),
                   GGUFSpec(arch="qwen2", tied=True, qtype=QType.Q4_1), GGUFSpec(qtype=QType.F32),
                   GGUFSpec(qtype=QType.F16, tied=False)]
STORED_FORMAT = {QType.Q8_0: "int8", QType.Q4_0: "int4", QType.Q4_1: "int4"}


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("spec", QUANTIZED_SPECS, ids=spec_id)
def test_quantized_loading_keeps_stored_blocks_and_rounds_float_ones(tmp_path, spec, quantization):
    """quantization int8/int4: a Q8_0/Q4_0/Q4_1 tensor is kept in its own format, bit for bit what
    the float loader dequantizes (Q/K rows un-permuted, QKV and gate/up fused, with their scales);
    an F32/F16 one is rounded to the chosen format at load. Norms and biases stay float32."""
    path = tmp_path / "tiny.gguf"
    write_gguf(path, spec, original_weights(spec))
    plain, loaded = load_model(str(path)), load_model(str(path), quantization=quantization)
    assert loaded.config == plain.config
    assert (loaded.weights.lm_head is loaded.weights.embed) == spec.tied
    got, want = weight_arrays(loaded.weights), weight_arrays(plain.weights)
    for name, array in got.items():
        if want[name].ndim == 1:                                   # norms, biases
            assert isinstance(array, np.ndarray) and array.dtype == np.float32, name
            np.testing.assert_array_equal(array, want[name], err_msg=name)
            continue
        assert isinstance(array, QuantizedMatrix) and array.shape == want[name].shape, name
        if spec.qtype in STORED_FORMAT:
            assert array.format == STORED_FORMAT[spec.qtype], name
            np.testing.assert_array_equal(dequantize(array), want[name], err_msg=name)
        else:
            assert array.format == quantization, name
            expected = dequantize_block_rows(quantize_rows(want[name], quantization))
            np.testing.assert_array_equal(dequantize(array), expected, err_msg=name)
    # Float32 is 128 bytes a block of 32 weights; rounded int8 keeps a scale and a min (40 bytes, 31%,
    # plus the float32 norms).
    rounded_int8 = spec.qtype not in STORED_FORMAT and quantization == "int8"
    assert loaded.weights.num_bytes < plain.weights.num_bytes * (0.35 if rounded_int8 else 1 / 3)
    # The engine on the quantized weights computes what the dense reference does on their floats.
    reference = dense_logits(LoadedModel(loaded.config, dequantized(loaded.weights), None, "ref"), TOKEN_IDS)
    run = engine_logits(str(path), TOKEN_IDS, block_size=4, budget=6, quantization=quantization)
    np.testing.assert_allclose(run.logits, reference, rtol=0, atol=1e-4 * np.abs(reference).max())


def test_quantization_is_validated_before_loading():
    with pytest.raises(ValueError, match="quantization must be one of"):
        load_model("random", quantization="int3")
    with pytest.raises(ValueError, match="computes in float32"):
        load_model("random", dtype="float64", quantization="int8")
    odd = np.random.default_rng(0).standard_normal((3, 40)).astype(np.float32)
    with pytest.raises(ValueError, match="multiple of 32"):   # blocks of 32 along the input dimension
        quantize_rows(odd, "int4")


def test_unsupported_gguf_architecture_is_a_clear_error(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    finish(writer)
    with pytest.raises(ValueError, match="GGUF architecture 'gpt2' is not supported"):
        load_model(str(path))


def test_unsupported_gguf_rope_scaling_is_a_clear_error(tmp_path):
    spec = GGUFSpec(rope_scaling=("yarn", 4.0))
    path = tmp_path / "yarn.gguf"
    write_gguf(path, spec, original_weights(GGUFSpec()))
    with pytest.raises(ValueError, match="rope.scaling.type 'yarn' is not supported"):
        load_model(str(path))


# --- llama.cpp's Q/K permutation ---------------------------------------------------------------

@pytest.mark.parametrize("num_heads, head_dim, cols", [(1, 2, 3), (1, 4, 1), (4, 16, 8), (3, 8, 5), (9, 64, 2),
                                                       (2, 6, None)])
def test_unpermute_rows_inverts_llama_cpp_permute(num_heads, head_dim, cols):
    rng = np.random.default_rng(num_heads * head_dim)
    shape = (num_heads * head_dim,) if cols is None else (num_heads * head_dim, cols)
    w = rng.standard_normal(shape)
    permuted = llama_cpp_permute(w, num_heads)
    np.testing.assert_array_equal(_unpermute_rows(permuted, num_heads), w)
    np.testing.assert_array_equal(llama_cpp_permute(_unpermute_rows(w, num_heads), num_heads), w)
    if head_dim > 2:
        assert not np.array_equal(permuted, w)  # the test can fail: the permutation moves rows


def test_unpermute_rows_worked_example():
    # One head of dim 4: HF rows (x0, x1 | y0, y1) are stored by llama.cpp interleaved as (x0, y0, x1, y1).
    rows = np.arange(8).reshape(8, 1)  # two heads of dim 4
    np.testing.assert_array_equal(llama_cpp_permute(rows, 2).ravel(), [0, 2, 1, 3, 4, 6, 5, 7])
    np.testing.assert_array_equal(_unpermute_rows(np.array([[0], [2], [1], [3], [4], [6], [5], [7]]), 2).ravel(),
                                  np.arange(8))
