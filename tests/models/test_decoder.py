"""The shared decoder's per-family switches that no family golden covers yet: the logit multiplier
and soft-cap, the norm check, and the clear refusal of a feature the kernels do not have."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from vllmlite.config import RopeScaling
from vllmlite.kernels import reference
from vllmlite.kernels.attention_metadata import build_metadata
from vllmlite.models.decoder import DecoderModel, layer_plans
from vllmlite.models.loader import random_model_config, random_weights


def logits_of(config, weights, kernels=reference) -> np.ndarray:
    """One 7-token prefill: logits at every position [7, vocab]."""
    model = DecoderModel(config, weights, 64, kernels)
    kv_cache = [tuple(np.zeros((8, config.num_kv_heads, config.head_dim)) for _ in range(2))
                for _ in range(config.num_layers)]
    ids = np.arange(7) * 11
    return model.forward(ids, build_metadata([7], [7], [[0, 1]], 4), kv_cache, np.arange(7))


@pytest.fixture(scope="module")
def llama():
    config = random_model_config(256)
    return config, random_weights(config, np.dtype(np.float64), seed=4)


def test_logit_multiplier_then_softcap_apply_to_the_lm_head_output(llama):
    config, weights = llama
    plain = logits_of(config, weights)
    capped = logits_of(dataclasses.replace(config, logit_multiplier=0.5, final_logit_softcap=3.0), weights)
    np.testing.assert_allclose(capped, 3.0 * np.tanh(0.5 * plain / 3.0), rtol=1e-12, atol=1e-12)
    assert np.abs(plain).max() > 6 and np.abs(capped).max() < 3.0


def test_norms_that_do_not_match_the_placement_are_refused(llama):
    config, weights = llama
    with pytest.raises(ValueError, match=r"layer 0 has norms \['attn_norm', 'ffn_norm'\].*'sandwich'.*post_attn_norm"):
        DecoderModel(dataclasses.replace(config, norm_placement="sandwich"), weights, 64, reference)
    with pytest.raises(ValueError, match="q_norm"):
        DecoderModel(dataclasses.replace(config, qk_norm="head"), weights, 64, reference)


def test_a_feature_the_kernels_lack_is_a_clear_error(llama):
    """Stand-in kernels whose attention takes no window, soft-cap or scale and that have no GELU."""
    config, weights = llama
    bare = SimpleNamespace(**{name: getattr(reference, name) for name in dir(reference)
                              if not name.startswith("_") and name != "gelu_tanh_and_mul"})
    bare.paged_attention = lambda q, k_cache, v_cache, meta, out: None
    sliding = dataclasses.replace(config, layer_types=("sliding", "full"), sliding_window=8, attn_logit_softcap=50.0)
    with pytest.raises(NotImplementedError, match=r"paged_attention has no \['sliding_window', 'softcap'\]"):
        DecoderModel(sliding, weights, 64, bare)
    with pytest.raises(NotImplementedError, match="no gelu_tanh_and_mul"):
        DecoderModel(dataclasses.replace(config, hidden_act="gelu_tanh"), weights, 64, bare)


def test_sliding_layers_rotate_at_their_local_base_unscaled_and_global_ones_scaled(llama):
    """Gemma 3's RoPE: local layers at rope_local_theta without the scaling, global layers at
    rope_theta with it; a no-RoPE layer gets no tables. Tables are shared, not rebuilt per layer."""
    config, weights = llama
    config = dataclasses.replace(config, num_layers=4, layer_types=("sliding", "full", "sliding", "full"),
                                 sliding_window=8, rope_local_theta=100.0, rope_scaling=RopeScaling("linear", 4.0),
                                 rope_layers=(True, True, True, False))
    plans = layer_plans(config, weights, 32, reference, np.float64)
    half = np.arange(0, config.head_dim, 2) / config.head_dim
    for plan, theta, factor in ((plans[0], 100.0, 1.0), (plans[1], config.rope_theta, 4.0)):
        cos, _ = plan.rope
        np.testing.assert_allclose(cos[5], np.cos(5 / (theta ** half) / factor), rtol=1e-12)
    assert plans[2].rope[0] is plans[0].rope[0] and plans[3].rope is None
    assert [p.attention_kwargs for p in plans] == [{"sliding_window": 8}, {}, {"sliding_window": 8}, {}]
