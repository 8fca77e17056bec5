"""Gemma 3 (text): Gemma 2's layers with per-head q/k RMSNorms ((1 + weight) too), no attention
soft-cap by default, five sliding layers to one global (layer_types, or the older
`sliding_window_pattern`), and two RoPEs: the sliding layers' own base (rope_local_base_freq),
unscaled, and the global base with its scaling (linear) on the full layers."""

from __future__ import annotations

import dataclasses

from vllmlite.config import ModelConfig
from vllmlite.models.families import common, gemma2
from vllmlite.models.families.common import GGUF_QK_NORM, HF_QK_NORM, unchanged

HF_NAMES = dataclasses.replace(gemma2.HF_NAMES, **HF_QK_NORM)
GGUF_NAMES = dataclasses.replace(gemma2.GGUF_NAMES, **GGUF_QK_NORM)
GGUF_PERMUTES_QK = False
HF_NORM_OFFSET = 1.0
finish = unchanged
GGUF_SWA_PATTERN = 6       # llama.cpp's gemma3 default: layer i slides unless i % 6 == 5
GGUF_27B_LAYERS = 62


def hf_rope(raw: dict) -> dict:
    """The two RoPEs, from transformers 5's `rope_parameters` {"full_attention", "sliding_attention"}
    or the hub's rope_theta / rope_scaling / rope_local_base_freq."""
    params = raw.get("rope_parameters") or {}
    full = params.get("full_attention") or {"rope_theta": raw.get("rope_theta", 1_000_000.0),
                                            **(raw.get("rope_scaling") or {})}
    local = params.get("sliding_attention") or {"rope_theta": raw.get("rope_local_base_freq", 10_000.0)}
    if common.hf_rope_scaling({"rope_scaling": local}) is not None:
        raise ValueError(f"scaled RoPE on the sliding layers is not supported (got {local})")
    return dict(rope_theta=float(full["rope_theta"]), rope_scaling=common.hf_rope_scaling({"rope_scaling": full}),
                rope_local_theta=float(local["rope_theta"]))


def hf_config(raw: dict, name: str) -> ModelConfig:
    return common.hf_config(raw, name, qk_norm="head", **gemma2.hf_features(raw, default_pattern=6), **hf_rope(raw))


def gguf_config(fields: dict, name: str, tensors: dict) -> ModelConfig:
    arch = fields["general.architecture"]
    window = fields.get(f"{arch}.attention.sliding_window")
    local_theta = fields.get(f"{arch}.rope.freq_base_swa")
    features = gemma2.gguf_features(fields, bool(window), GGUF_SWA_PATTERN, GGUF_27B_LAYERS)
    if window:   # llama.cpp's local layers: their own base (default the global one), unscaled
        features["rope_local_theta"] = float(local_theta if local_theta is not None
                                             else fields.get(f"{arch}.rope.freq_base", 10_000.0))
    return common.gguf_config(fields, name, tensors, qk_norm="head", **features)
