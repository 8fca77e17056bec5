"""Gemma configs as the hub writes them (transformers 4's keys) read as transformers 5's saved
ones do, and the fields the tiny goldens leave at llama.cpp's defaults read at all."""

from __future__ import annotations

import json

import pytest
from paths import GOLDENS

from vllmlite.models.families import gemma2

FAMILIES = GOLDENS / "families"


def saved(name: str) -> dict:
    return json.loads((FAMILIES / name / "config.json").read_text())


def test_gemma2_defaults_alternate_layers_and_read_the_query_scalar():
    raw = {k: v for k, v in saved("gemma2").items() if k != "layer_types"} | {"query_pre_attn_scalar": 144}
    config = gemma2.hf_config(raw, "gemma2")
    assert config.layer_types == ("sliding", "full", "sliding", "full")
    assert config.attention_scale == 144 ** -0.5
    assert config.embedding_multiplier == pytest.approx(32 ** 0.5, rel=1e-7)
    assert config.uniform_sliding_window is None


def test_unsupported_gemma_fields_are_clear_errors():
    with pytest.raises(ValueError, match="hidden_activation 'gelu' is not supported.*gelu_pytorch_tanh"):
        gemma2.hf_config(saved("gemma2") | {"hidden_activation": "gelu"}, "gemma2")
