"""The routed experts in the decoder (routing and the moe kernel are tested in tests/kernels): a MoE
layer beside a dense one against a per-token loop, the config's MoE/dense layer rule, and
quantization refused."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from paths import GOLDENS
from reference import dense_logits

from vllmlite.kernels.attention_metadata import build_metadata
from vllmlite.models.decoder import DecoderModel
from vllmlite.models.families import qwen3_moe
from vllmlite.models.loader import LoadedModel, load_model

QWEN3_MOE = GOLDENS / "families" / "qwen3_moe"


def test_moe_and_dense_layers_side_by_side_match_a_per_token_loop():
    """Qwen3-MoE with layer 0 in mlp_only_layers (a dense MLP of intermediate_size beside experts
    of moe_intermediate_size): every position's logits equal the per-token reference."""
    loaded = load_model(str(QWEN3_MOE), dtype="float64")
    c, rng = loaded.config, np.random.default_rng(2)
    config = dataclasses.replace(c, moe_layers=(False, True))
    dense = dataclasses.replace(
        loaded.weights.layers[0], router=None, w_experts_gate_up=None, w_experts_down=None,
        w_gate_up=rng.standard_normal((2 * c.intermediate_size, c.hidden_size)) / np.sqrt(c.hidden_size),
        w_down=rng.standard_normal((c.hidden_size, c.intermediate_size)) / np.sqrt(c.intermediate_size))
    weights = dataclasses.replace(loaded.weights, layers=[dense, loaded.weights.layers[1]])
    mixed = LoadedModel(config, weights, loaded.tokenizer, loaded.source)
    ids = rng.integers(0, c.vocab_size, 21)
    model, block_size = DecoderModel(config, weights, c.max_position_embeddings), 4
    kv_cache = [tuple(np.zeros((24, c.num_kv_heads, c.head_dim)) for _ in range(2)) for _ in range(c.num_layers)]
    meta = build_metadata([len(ids)], [len(ids)], [list(range(6))], block_size)
    got = model.forward(ids, meta, kv_cache, np.arange(len(ids)))
    want = dense_logits(mixed, ids.tolist())
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-10)
    assert np.abs(want - dense_logits(loaded, ids.tolist())).max() > 1e-2   # layer 0 matters


def test_decoder_sparse_step_and_mlp_only_layers_choose_the_moe_layers():
    raw = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
           "num_hidden_layers": 6, "num_attention_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
           "moe_intermediate_size": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    config = qwen3_moe.hf_config(raw, "qwen3_moe")
    assert [config.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    every = qwen3_moe.hf_config(raw | {"decoder_sparse_step": 1, "mlp_only_layers": []}, "qwen3_moe")
    assert every.moe_layers is None and all(every.is_moe_layer(i) for i in range(6))


@pytest.mark.parametrize("file", ["", "model.gguf"])
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_experts_are_refused_naming_the_option(file, quantization):
    with pytest.raises(NotImplementedError, match=f"quantization '{quantization}' is not supported for "
                                                  "mixture-of-experts.*quantization 'none'"):
        load_model(str(QWEN3_MOE / file) if file else str(QWEN3_MOE), quantization=quantization)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_experts_as_transformers_5_holds_them_read_the_same(tmp_path, name):
    """A checkpoint saved with save_original_format=False: each layer's experts as one gate/up and
    one down tensor under `mlp.experts` (Mixtral's `block_sparse_moe` renamed), no per-expert names."""
    from safetensors.numpy import load_file, save_file
    source = GOLDENS / "families" / name
    state, fused = load_file(str(source / "model.safetensors")), {}
    per_expert = {"qwen3_moe": ("mlp.gate", "mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj",
                                "mlp.experts.{e}.down_proj"),
                  "mixtral": ("block_sparse_moe.gate", "block_sparse_moe.experts.{e}.w1",
                              "block_sparse_moe.experts.{e}.w3", "block_sparse_moe.experts.{e}.w2")}[name]
    loaded = load_model(str(source))
    for i in range(loaded.config.num_layers):
        def take(part: str) -> np.ndarray:
            return np.stack([state.pop(f"model.layers.{i}.{part.format(e=e)}.weight")
                             for e in range(loaded.config.num_experts)])
        fused[f"model.layers.{i}.mlp.gate.weight"] = state.pop(f"model.layers.{i}.{per_expert[0]}.weight")
        gate, up, down = (take(part) for part in per_expert[1:])
        fused[f"model.layers.{i}.mlp.experts.gate_up_proj"] = np.concatenate([gate, up], axis=1)
        fused[f"model.layers.{i}.mlp.experts.down_proj"] = down
    save_file(state | fused, str(tmp_path / "model.safetensors"))
    for file in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / file).write_bytes((source / file).read_bytes())
    again = load_model(str(tmp_path))
    for got, want in zip(again.weights.layers, loaded.weights.layers):
        for field in ("router", "w_experts_gate_up", "w_experts_down"):
            np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)
