"""Loading weights: tiny HF checkpoints against HF transformers' logits (dense and through the
engine's paged path), llama.cpp's row permutation, and clear errors for what is not supported.
GGUF files are covered in test_gguf_loader.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import tokenizers
from loader_util import engine_logits
from paths import GOLDENS
from reference import dense_logits

from vllmlite.config import RopeScaling
from vllmlite.kernels.quant import QuantizedMatrix, dequantize, dequantize_block_rows, quantize_rows
from vllmlite.models.loader import LoadedModel, load_model
from vllmlite.models.model_source import ModelNotFoundError
from vllmlite.models.rope import rope_inv_freq

TINY_HF = GOLDENS / "tiny_hf"
HF_VARIANTS = ("llama", "llama3_rope", "qwen2", "mistral")
HF_TOLERANCE = 1e-4


# --- HF directories vs transformers -------------------------------------------------------------

class HFCase(NamedTuple):
    path: Path
    loaded: LoadedModel            # float64
    expected: dict                 # expected.json: text, input_ids, inv_freq
    expected_logits: np.ndarray    # [len(input_ids), vocab] from transformers, float32


@pytest.fixture(scope="module", params=HF_VARIANTS)
def hf_variant(request) -> HFCase:
    path = TINY_HF / request.param
    expected = json.loads((path / "expected.json").read_text())
    return HFCase(path, load_model(str(path), dtype="float64"), expected, np.load(path / "expected_logits.npy"))


def test_hf_dense_logits_match_transformers(hf_variant):
    _, loaded, expected, expected_logits = hf_variant
    logits = dense_logits(loaded, expected["input_ids"])
    assert logits.shape == expected_logits.shape == (len(expected["input_ids"]), loaded.config.vocab_size)
    np.testing.assert_allclose(logits, expected_logits, rtol=0, atol=HF_TOLERANCE)


@pytest.mark.parametrize("block_size, budget", [(4, 256), (3, 5)], ids=["one-pass", "chunked"])
def test_hf_engine_logits_match_transformers(hf_variant, block_size, budget):
    """One prefill (46 tokens takes the per-sequence path, 11 the batched one), or 5-token chunks
    over 3-token blocks; every position's logits agree with transformers."""
    path, _, expected, expected_logits = hf_variant
    ids = expected["input_ids"]
    run = engine_logits(str(path), ids, block_size, budget)
    np.testing.assert_allclose(run.logits, expected_logits, rtol=0, atol=HF_TOLERANCE)
    assert run.greedy_token == int(np.argmax(expected_logits[-1]))
    assert run.num_forward_passes == -(-len(ids) // budget)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_hf_weights_are_rounded_at_load_when_quantized(quantization):
    """An HF directory holds float weights: with quantization, every matrix (the tied embedding
    and LM head as one) is rounded to the format at load; norms stay float32. The engine then
    computes what the dense reference does on the rounded matrices."""
    path = TINY_HF / "llama"
    plain, loaded = load_model(str(path)), load_model(str(path), quantization=quantization)
    w, f = loaded.weights, plain.weights
    assert isinstance(w.embed, QuantizedMatrix) and w.lm_head is w.embed and w.embed.format == quantization
    for got, want in ((w.embed, f.embed), (w.layers[1].wqkv, f.layers[1].wqkv), (w.layers[0].w_down, f.layers[0].w_down)):
        np.testing.assert_array_equal(dequantize(got), dequantize_block_rows(quantize_rows(want, quantization)))
    assert isinstance(w.layers[0].attn_norm, np.ndarray) and w.layers[0].attn_norm.dtype == np.float32
    ids = json.loads((path / "expected.json").read_text())["input_ids"]
    reference = dense_logits(loaded, ids)
    run = engine_logits(str(path), ids, block_size=4, budget=7, quantization=quantization)
    np.testing.assert_allclose(run.logits, reference, rtol=0, atol=1e-4 * np.abs(reference).max())


def test_hf_tokenizer_encodes_like_tokenizers_library(hf_variant):
    path, loaded, expected, _ = hf_variant
    library = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    assert loaded.tokenizer.encode(expected["text"]) == expected["input_ids"]
    for text in (expected["text"], "Hi there!  Tabs\tand\nnewlines, 1234 numbers", "<|im_start|>user\nHi"):
        assert loaded.tokenizer.encode(text) == library.encode(text).ids
        ids = library.encode(text).ids
        assert loaded.tokenizer.decode(ids, skip_special_tokens=True) == library.decode(ids)  # the library skips
    assert (loaded.tokenizer.bos_token_id, loaded.tokenizer.eos_token_id) == (0, 2)


def test_hf_rope_frequencies_match_transformers(hf_variant):
    _, loaded, expected, _ = hf_variant
    np.testing.assert_allclose(rope_inv_freq(loaded.config), expected["inv_freq"], rtol=1e-6)


def test_hf_config_fields_read():
    configs = {name: load_model(str(TINY_HF / name), dtype="float64") for name in HF_VARIANTS}
    llama, llama3, qwen2, mistral = (configs[n] for n in HF_VARIANTS)
    assert llama.config.tie_word_embeddings and llama.weights.lm_head is llama.weights.embed
    assert llama.config.rope_scaling is None and not llama.config.attention_bias
    assert llama3.config.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 16)
    assert llama3.config.rope_theta == 500000.0
    assert qwen2.config.attention_bias and qwen2.config.rms_norm_eps == 1e-6
    assert all(layer.bqkv.shape == ((4 + 2 * 2) * 8,) for layer in qwen2.weights.layers)
    for loaded in (llama3, qwen2, mistral):
        assert not loaded.config.tie_word_embeddings
        assert loaded.weights.lm_head is not loaded.weights.embed
    for loaded in (llama, llama3, mistral):
        assert all(layer.bqkv is None for layer in loaded.weights.layers)
    assert [c.config.architecture for c in configs.values()] == ["llama", "llama", "qwen2", "mistral"]
    assert all(c.config.max_position_embeddings == 128 for c in configs.values())
    assert all(c.weights.embed.dtype == np.float64 for c in configs.values())


# --- errors -----------------------------------------------------------------------------------------

def test_directory_without_config_json_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load_model(str(tmp_path))


def copy_llama_with_config(tmp_path: Path, **changes) -> Path:
    directory = tmp_path / "model"
    shutil.copytree(TINY_HF / "llama", directory)
    raw = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**raw, **changes}))
    return directory


def test_unsupported_hf_architecture_is_a_clear_error(tmp_path):
    directory = copy_llama_with_config(tmp_path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*not supported.*LlamaForCausalLM"):
        load_model(str(directory))


@pytest.mark.parametrize("scaling", [{"rope_type": "yarn", "factor": 4.0}, {"type": "dynamic", "factor": 2.0}])
def test_unsupported_rope_scaling_is_a_clear_error(tmp_path, scaling):
    directory = copy_llama_with_config(tmp_path, rope_scaling=scaling)
    kind = scaling.get("rope_type") or scaling["type"]
    with pytest.raises(ValueError, match=f"rope_scaling type '{kind}' is not supported"):
        load_model(str(directory))


def test_directory_without_safetensors_is_a_clear_error(tmp_path):
    directory = copy_llama_with_config(tmp_path)
    (directory / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="safetensors"):
        load_model(str(directory))


def test_missing_path_is_model_not_found(tmp_path):
    with pytest.raises(ModelNotFoundError, match="neither an existing path"):
        load_model(str(tmp_path / "nope.gguf"))
