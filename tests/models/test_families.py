"""Each model family against HF transformers: a tiny random checkpoint of the family's real
structure (tools/make_family_goldens.py), read from safetensors and from llama.cpp's GGUF
conversion of it, gives transformers' float32 logits and greedy tokens; the registry names every
supported architecture when one is not."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from loader_util import engine_logits
from paths import GOLDENS
from reference import dense_logits
from torch_facade import triton_interpreted_without_a_gpu

from vllmlite import LLM, SamplingParams
from vllmlite.kernels import get_kernels
from vllmlite.kernels.attention_metadata import build_metadata
from vllmlite.models import registry
from vllmlite.models.decoder import DecoderModel
from vllmlite.models.loader import load_model
from vllmlite.models.rope import rope_inv_freq

FAMILIES = GOLDENS / "families"
NAMES = sorted(p.name for p in FAMILIES.iterdir())
TOLERANCE = 1e-4  # float32 logits, max abs
# llama.cpp converts these without their sliding window (and runs them so; Mistral as a "llama"
# GGUF): those GGUFs are checked on their own terms below, not against transformers' windowed logits.
DROPS_WINDOW = {"mistral": "llama", "qwen2": "qwen2"}  # name -> the GGUF's architecture
KINDS = [(name, kind) for name in NAMES for kind in ("safetensors", "gguf")
         if not (kind == "gguf" and name in DROPS_WINDOW)]


def expected(name: str) -> dict:
    return json.loads((FAMILIES / name / "expected.json").read_text())


def source(name: str, kind: str) -> str:
    return str(FAMILIES / name / "model.gguf") if kind == "gguf" else str(FAMILIES / name)


def test_every_family_has_goldens_and_an_architecture():
    assert "qwen3" in NAMES
    for name in NAMES:
        config = json.loads((FAMILIES / name / "config.json").read_text())
        assert registry.from_hf(config["architectures"]).name == name


@pytest.mark.parametrize("name, kind", KINDS)
def test_logits_match_transformers(name, kind):
    """Every prompt position, in 16-token chunks over 4-token blocks (so attention reads the paged
    cache across chunks), within 1e-4 of transformers in float32."""
    ids, want = expected(name)["input_ids"], np.load(FAMILIES / name / "expected_logits.npy")
    run = engine_logits(source(name, kind), ids, block_size=4, budget=16, dtype="float32")
    assert run.logits.shape == want.shape
    np.testing.assert_allclose(run.logits, want, rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("name, kind", [(n, k) for n, k in KINDS if not expected(n).get("route_min_margin")])
def test_int8_weights_stay_close_to_transformers(name, kind):   # MoE experts refuse it (tests/models/test_moe_block.py)
    """Every family's matrices (fused or not, folded multipliers included) quantize: int8 logits
    within 6% of the largest logit (measured: 0.4-3.5% on these random tiny models)."""
    ids, want = expected(name)["input_ids"], np.load(FAMILIES / name / "expected_logits.npy")
    run = engine_logits(source(name, kind), ids, block_size=4, budget=16, quantization="int8")
    np.testing.assert_allclose(run.logits, want, rtol=0, atol=0.06 * np.abs(want).max())


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


BEYOND_THE_REFERENCE = {"granite", "olmo2", "olmoe", "phi3"}  # residual multiplier, post-norms, full-width q/k norms, partial RoPE and longrope


@pytest.mark.parametrize("name", NAMES)
def test_dense_reference_matches_transformers(name):
    """tests/reference.py, the invariance suite's oracle, computes each family as transformers does,
    or refuses it (so the invariance suite cannot run against a wrong oracle)."""
    ids, want = expected(name)["input_ids"], np.load(FAMILIES / name / "expected_logits.npy")
    loaded = load_model(source(name, "safetensors"))
    if name in BEYOND_THE_REFERENCE:
        with pytest.raises(NotImplementedError, match="the dense reference"):
            dense_logits(loaded, ids)
        return
    np.testing.assert_allclose(dense_logits(loaded, ids), want, rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("name, kind", KINDS)
def test_greedy_tokens_match_transformers(name, kind):
    golden = expected(name)
    llm = LLM(source(name, kind), dtype="float32", num_blocks=64, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=len(golden["greedy_ids"]), ignore_eos=True)
    [output] = llm.generate([{"prompt_token_ids": golden["input_ids"]}], params, use_tqdm=False)
    assert list(output.outputs[0].token_ids) == golden["greedy_ids"]


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
@pytest.mark.parametrize("name", [n for n in NAMES if "short_context" in expected(n)])
def test_a_context_within_the_original_one_uses_the_short_rope_factors(name, kind):
    """longrope: with max_model_len within original_max_position_embeddings the engine rotates by
    the short factors (above it, the tests above: the long ones), as transformers does for a
    sequence that short. Logits and greedy tokens, up to the last position of that context."""
    short = expected(name)["short_context"]
    want = np.load(FAMILIES / name / "expected_logits_short.npy")
    run = engine_logits(source(name, kind), short["input_ids"], block_size=4, budget=16, dtype="float32",
                        max_model_len=short["max_model_len"])
    np.testing.assert_allclose(run.logits, want, rtol=0, atol=TOLERANCE)
    llm = LLM(source(name, kind), dtype="float32", num_blocks=64, block_size=4, max_model_len=short["max_model_len"])
    params = SamplingParams(temperature=0.0, max_tokens=len(short["greedy_ids"]), ignore_eos=True)
    [output] = llm.generate([{"prompt_token_ids": short["input_ids"]}], params, use_tqdm=False)
    assert list(output.outputs[0].token_ids) == short["greedy_ids"]


def test_a_self_draft_of_a_family_with_per_layer_rope_keeps_the_tokens():
    """Speculation is exact: SmolLM3 drafting with its first 3 layers (RoPE on each; the target's
    4th has none) still gives transformers' greedy tokens."""
    golden = expected("smollm3")
    llm = LLM(source("smollm3", "safetensors"), dtype="float32", num_blocks=64, block_size=4,
              speculative_config={"method": "self_draft", "num_speculative_tokens": 3, "num_draft_layers": 3})
    params = SamplingParams(temperature=0.0, max_tokens=len(golden["greedy_ids"]), ignore_eos=True)
    [output] = llm.generate([{"prompt_token_ids": golden["input_ids"]}], params, use_tqdm=False)
    assert list(output.outputs[0].token_ids) == golden["greedy_ids"]


@pytest.mark.parametrize("name", NAMES)
def test_gguf_conversion_reads_as_the_checkpoint(name):
    """llama.cpp's converter keeps the structure (config fields, the tokenizer's ids) and the
    weights: every tensor equal after undoing its layout (Q/K permutation, name mapping)."""
    hf, gguf = load_model(source(name, "safetensors")), load_model(source(name, "gguf"))
    gguf_config = gguf.config
    if name in DROPS_WINDOW:   # llama.cpp converts Mistral as llama, and drops Mistral's and Qwen2's window
        assert gguf_config.architecture == DROPS_WINDOW[name]
        gguf_config = dataclasses.replace(gguf_config, architecture=hf.config.architecture,
                                          layer_types=hf.config.layer_types, sliding_window=hf.config.sliding_window)
    if gguf.weights.rope_freq_factors is not None:   # llama3 scaling: llama.cpp stores the divisors
        np.testing.assert_allclose(rope_inv_freq(gguf_config, gguf.weights.rope_freq_factors),
                                   rope_inv_freq(hf.config), rtol=1e-6)
        gguf_config = dataclasses.replace(gguf_config, rope_scaling=hf.config.rope_scaling)
    assert_same_fields(gguf_config, hf.config)
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


def assert_same_fields(got, want, path: str = "config") -> None:
    """Equal dataclasses, floats (and tuples of them) within float32 rounding: GGUF stores float32."""
    if dataclasses.is_dataclass(want):
        assert type(got) is type(want), path
        for field in dataclasses.fields(want):
            assert_same_fields(getattr(got, field.name), getattr(want, field.name), f"{path}.{field.name}")
    elif isinstance(want, float) or (isinstance(want, tuple) and want and isinstance(want[0], float)):
        assert got == pytest.approx(want, rel=1e-6), path
    else:
        assert got == want, path


@pytest.mark.parametrize("name", sorted(DROPS_WINDOW))
def test_gguf_without_the_window_matches_transformers_only_inside_it(name):
    """The converted model runs full attention: transformers' logits while the prompt fits in the
    window, different ones past it (so the window matters in the safetensors test above)."""
    ids, want = expected(name)["input_ids"], np.load(FAMILIES / name / "expected_logits.npy")
    window = load_model(source(name, "safetensors")).config.sliding_window
    assert window is not None and load_model(source(name, "gguf")).config.layer_types is None
    run = engine_logits(source(name, "gguf"), ids, block_size=4, budget=16, dtype="float32")
    np.testing.assert_allclose(run.logits[:window], want[:window], rtol=0, atol=TOLERANCE)
    assert np.abs(run.logits[window:] - want[window:]).max(axis=1).min() > 100 * TOLERANCE


def test_qwen2_config_without_layer_types_slides_from_max_window_layers():
    saved = json.loads((FAMILIES / "qwen2" / "config.json").read_text())
    hub = {k: v for k, v in saved.items() if k != "layer_types"}
    config = registry.from_hf(["Qwen2ForCausalLM"]).module().hf_config(hub, "qwen2")
    assert config == load_model(source("qwen2", "safetensors")).config
    assert config.layer_types == ("full", "sliding") and config.sliding_window == 8


def test_unknown_hf_architecture_lists_the_supported_ones(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"]}))
    with pytest.raises(ValueError, match="MambaForCausalLM.*not supported.*qwen3 \\(HF Qwen3ForCausalLM"):
        load_model(str(tmp_path))


def test_a_tensor_the_family_needs_is_missing_is_a_clear_error(tmp_path: Path):
    from safetensors.numpy import load_file, save_file
    shutil.copytree(FAMILIES / "qwen3", tmp_path / "qwen3")
    state = load_file(str(tmp_path / "qwen3" / "model.safetensors"))
    del state["model.layers.1.self_attn.k_norm.weight"]
    save_file(state, str(tmp_path / "qwen3" / "model.safetensors"))
    with pytest.raises(ValueError, match="tensor 'model.layers.1.self_attn.k_norm.weight' missing"):
        load_model(str(tmp_path / "qwen3"))


@pytest.mark.parametrize("field, value, message", [
    ("logits_scaling", 0, "logits_scaling must be > 0"),
    ("embedding_multiplier", -1.0, "embedding_multiplier must be finite and > 0"),
    ("no_rope_layers", [1], "rope_layers must have one entry per layer"),
    ("partial_rotary_factor", 0.0, "rotary dims must be even"),
    ("partial_rotary_factor", 1.5, "rotary dims must be even, >= 2 and <= head_dim 8, got 12"),
])
def test_bad_family_fields_are_clear_errors(tmp_path: Path, field, value, message):
    """config.json is input like any other: a bad value is refused by name, not a crash."""
    family = {"logits_scaling": "granite", "embedding_multiplier": "granite", "no_rope_layers": "smollm3",
              "partial_rotary_factor": "phi3"}[field]
    shutil.copytree(FAMILIES / family, tmp_path / family)
    config_path = tmp_path / family / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), field: value}))
    with pytest.raises(ValueError, match=message):
        load_model(str(tmp_path / family))


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


def test_the_models_page_lists_every_architecture():
    """docs/models.md's table of families, kept true to the registry."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "models.md").read_text()
    for arch in registry.ARCHITECTURES:
        assert f"| {arch.name} | " in page and arch.features in page, arch.name
