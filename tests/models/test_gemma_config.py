"""Gemma 2 and 3 configs as the hub writes them (transformers 4's keys) read as transformers 5's
saved ones do, and the fields the tiny goldens leave at llama.cpp's defaults read at all."""

from __future__ import annotations

import json

import pytest
from paths import GOLDENS

from vllmlite.config import RopeScaling
from vllmlite.models.families import gemma2, gemma3

FAMILIES = GOLDENS / "families"


def saved(name: str) -> dict:
    return json.loads((FAMILIES / name / "config.json").read_text())


def test_gemma3_hub_keys_read_as_rope_parameters_and_layer_types():
    new = saved("gemma3")
    old = {k: v for k, v in new.items() if k not in ("rope_parameters", "layer_types")}
    old |= {"rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "sliding_window_pattern": 6,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    config = gemma3.hf_config(old, "gemma3")
    assert config == gemma3.hf_config(new, "gemma3")
    assert config.layer_types == ("sliding",) * 5 + ("full",) and config.sliding_window == 6
    assert (config.rope_theta, config.rope_local_theta) == (1_000_000.0, 10_000.0)
    assert config.rope_scaling == RopeScaling("linear", 8.0)


def test_gemma2_defaults_alternate_layers_and_read_the_query_scalar():
    raw = {k: v for k, v in saved("gemma2").items() if k != "layer_types"} | {"query_pre_attn_scalar": 144}
    config = gemma2.hf_config(raw, "gemma2")
    assert config.layer_types == ("sliding", "full", "sliding", "full")
    assert config.attention_scale == 144 ** -0.5
    assert config.embedding_multiplier == pytest.approx(32 ** 0.5, rel=1e-7)
    assert config.uniform_sliding_window is None
    every_layer_full = gemma2.hf_config(raw | {"layer_types": ["full_attention"] * 4}, "gemma2")
    assert every_layer_full.layer_types is None and every_layer_full.sliding_window is None


def test_unsupported_gemma_fields_are_clear_errors():
    with pytest.raises(ValueError, match="hidden_activation 'gelu' is not supported.*gelu_pytorch_tanh"):
        gemma2.hf_config(saved("gemma2") | {"hidden_activation": "gelu"}, "gemma2")
    params = {"full_attention": {"rope_theta": 1e6}, "sliding_attention": {"rope_theta": 1e4, "rope_type": "linear",
                                                                           "factor": 2.0}}
    with pytest.raises(ValueError, match="scaled RoPE on the sliding layers is not supported"):
        gemma3.hf_config(saved("gemma3") | {"rope_parameters": params}, "gemma3")
