"""Each model family against HF transformers: a tiny random checkpoint of the family's real
structure (tools/make_family_goldens.py), read from safetensors and from llama.cpp's GGUF
conversion of it, gives transformers' float32 logits and greedy tokens; the registry names every
supported architecture when one is not."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from loader_util import engine_logits
from paths import GOLDENS
from torch_facade import triton_interpreted_without_a_gpu

from vllmlite import LLM, SamplingParams
from vllmlite.kernels import get_kernels
from vllmlite.kernels.attention_metadata import build_metadata
from vllmlite.models import registry
from vllmlite.models.decoder import DecoderModel
from vllmlite.models.loader import load_model

FAMILIES = GOLDENS / "families"
NAMES = sorted(p.name for p in FAMILIES.iterdir())
TOLERANCE = 1e-4  # float32 logits, max abs


def expected(name: str) -> dict:
    return json.loads((FAMILIES / name / "expected.json").read_text())


def source(name: str, kind: str) -> str:
    return str(FAMILIES / name / "model.gguf") if kind == "gguf" else str(FAMILIES / name)


def test_every_family_has_goldens_and_an_architecture():
    assert "qwen3" in NAMES
    for name in NAMES:
        config = json.loads((FAMILIES / name / "config.json").read_text())
        assert registry.from_hf(config["architectures"]).name == name


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(name, kind):
    """Every prompt position, in 16-token chunks over 4-token blocks (so attention reads the paged
    cache across chunks), within 1e-4 of transformers in float32."""
    ids, want = expected(name)["input_ids"], np.load(FAMILIES / name / "expected_logits.npy")
    run = engine_logits(source(name, kind), ids, block_size=4, budget=16, dtype="float32")
    assert run.logits.shape == want.shape
    np.testing.assert_allclose(run.logits, want, rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("backend", ["numpy", "numba", "torch", "torch-triton"])
@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers_on_every_backend(name, backend):
    """One prefill of the prompt through the decoder on each kernel backend (torch's on the CPU,
    its Triton kernels in Triton's interpreter)."""
    if backend == "torch-triton" and not triton_interpreted_without_a_gpu():
        pytest.skip("triton is not installed")
    kernels = get_kernels(backend.removesuffix("-triton"))
    if backend.startswith("torch"):
        kernels.triton = backend == "torch-triton"   # the backend's choice, forced either way
    ids, want = expected(name)["input_ids"], np.load(FAMILIES / name / "expected_logits.npy")
    loaded = load_model(source(name, "safetensors"))
    c, block_size, n = loaded.config, 4, len(ids)
    model = DecoderModel(c, loaded.weights, c.max_position_embeddings, kernels)
    num_blocks = -(-n // block_size)
    kv_cache = [tuple(kernels.zeros((num_blocks * block_size, c.num_kv_heads, c.head_dim), model.dtype)
                      for _ in range(2)) for _ in range(c.num_layers)]
    meta = build_metadata([n], [n], [list(range(num_blocks))], block_size)
    logits = model.forward(np.array(ids), meta, kv_cache, np.arange(n))
    np.testing.assert_allclose(logits, want, rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_match_transformers(name, kind):
    golden = expected(name)
    llm = LLM(source(name, kind), dtype="float32", num_blocks=64, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=len(golden["greedy_ids"]), ignore_eos=True)
    [output] = llm.generate([{"prompt_token_ids": golden["input_ids"]}], params, use_tqdm=False)
    assert list(output.outputs[0].token_ids) == golden["greedy_ids"]


@pytest.mark.parametrize("name", NAMES)
def test_gguf_conversion_reads_as_the_checkpoint(name):
    """llama.cpp's converter keeps the structure (config fields, the tokenizer's ids) and the
    weights: every tensor equal after undoing its layout (Q/K permutation, name mapping)."""
    hf, gguf = load_model(source(name, "safetensors")), load_model(source(name, "gguf"))
    assert dataclasses.replace(gguf.config, rms_norm_eps=hf.config.rms_norm_eps) == hf.config
    assert gguf.config.rms_norm_eps == pytest.approx(hf.config.rms_norm_eps, rel=1e-6)
    golden = expected(name)
    assert gguf.tokenizer.encode(golden["prompt"]) == hf.tokenizer.encode(golden["prompt"]) == golden["input_ids"]
    for got, want in zip(gguf.weights.layers, hf.weights.layers):
        for field in dataclasses.fields(want):
            a, b = getattr(got, field.name), getattr(want, field.name)
            assert (a is None) == (b is None), field.name
            if b is not None:
                np.testing.assert_array_equal(a, b, err_msg=field.name)
    np.testing.assert_array_equal(gguf.weights.embed, hf.weights.embed)
    assert (gguf.weights.lm_head is gguf.weights.embed) == (hf.weights.lm_head is hf.weights.embed)


def test_unknown_hf_architecture_lists_the_supported_ones(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"]}))
    with pytest.raises(ValueError, match="MambaForCausalLM.*not supported.*qwen3 \\(HF Qwen3ForCausalLM"):
        load_model(str(tmp_path))


def test_unknown_gguf_architecture_lists_the_supported_ones(tmp_path: Path):
    import gguf
    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'mamba' is not supported.*llama \\(HF LlamaForCausalLM; GGUF llama\\)"):
        load_model(str(path))


def test_the_features_page_lists_every_architecture():
    """docs/features.md's table of families, kept true to the registry."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "features.md").read_text()
    for arch in registry.ARCHITECTURES:
        assert f"| {arch.name} | " in page and arch.features in page, arch.name
