"""Gemma 2: RMSNorms that scale by (1 + weight) (the 1 added at load; llama.cpp's GGUF has it
already), a norm before and after both attention and MLP ("sandwich"), GeGLU (gelu tanh),
embeddings times sqrt(hidden), softmax scale query_pre_attn_scalar**-0.5, tanh soft-caps on the
attention scores and the logits, and a sliding window on alternate layers (layer_types). Tied
embeddings. Gemma 3 (gemma3.py) builds on these helpers."""

from __future__ import annotations

import math

import numpy as np

from vllmlite.config import ModelConfig
from vllmlite.models.families import common
from vllmlite.models.families.common import LayerNames, unchanged

HF_NAMES = LayerNames(
    attn_norm="model.layers.{i}.input_layernorm",
    qkv=common.HF_LLAMA.qkv, wo=common.HF_LLAMA.wo,
    ffn_norm="model.layers.{i}.pre_feedforward_layernorm",
    gate_up=common.HF_LLAMA.gate_up, down=common.HF_LLAMA.down,
    post_attn_norm="model.layers.{i}.post_attention_layernorm",
    post_ffn_norm="model.layers.{i}.post_feedforward_layernorm",
)
GGUF_NAMES = LayerNames(
    attn_norm="blk.{i}.attn_norm",
    qkv=common.GGUF_LLAMA.qkv, wo=common.GGUF_LLAMA.wo,
    ffn_norm="blk.{i}.ffn_norm",
    gate_up=common.GGUF_LLAMA.gate_up, down=common.GGUF_LLAMA.down,
    post_attn_norm="blk.{i}.post_attention_norm",
    post_ffn_norm="blk.{i}.post_ffw_norm",
    embed="token_embd", final_norm="output_norm", lm_head="output",
)
GGUF_PERMUTES_QK = False
HF_NORM_OFFSET = 1.0
finish = unchanged
ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh"}
GGUF_SWA_PATTERN = 2       # llama.cpp's gemma2 default: layer i slides unless i % 2 == 1
GGUF_27B_LAYERS = 46       # llama.cpp's gemma2 27B rule for the softmax scale


def embedding_normalizer(hidden: int) -> float:
    """sqrt(hidden) rounded to float32, as transformers holds it (a float32 buffer, cast to the
    activations' dtype), so float64 runs match too: sqrt(3584) = 59.866518188... -> 59.86651992797852."""
    return float(np.float32(math.sqrt(hidden)))


def sliding_pattern(num_layers: int, pattern: int) -> tuple[str, ...]:
    """Every `pattern`-th layer full, the others sliding: 2 -> (sliding, full, sliding, full, ...)."""
    return tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(num_layers))


def hf_features(raw: dict, default_pattern: int) -> dict:
    """What Gemma 2 and 3 read alike from config.json (beyond common.hf_config's fields)."""
    act = raw.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in ACTIVATIONS:
        raise ValueError(f"hidden_activation {act!r} is not supported ({sorted(ACTIVATIONS)})")
    layers = common.hf_sliding_layers(raw) if raw.get("layer_types") else {   # the hub's older configs
        "layer_types": sliding_pattern(raw["num_hidden_layers"], raw.get("sliding_window_pattern", default_pattern)),
        "sliding_window": int(raw.get("sliding_window") or 4096)}
    return dict(norm_placement="sandwich", hidden_act=ACTIVATIONS[act],
                embedding_multiplier=embedding_normalizer(raw["hidden_size"]),
                attention_scale=float(raw.get("query_pre_attn_scalar", 256)) ** -0.5,
                attn_logit_softcap=raw.get("attn_logit_softcapping"),
                final_logit_softcap=raw.get("final_logit_softcapping"), **layers)


def gguf_features(fields: dict, swa: bool, default_pattern: int, large_layers: int) -> dict:
    """llama.cpp's reading of a gemma GGUF: the window (with its per-layer pattern, when `swa`),
    and the softmax scale it derives, 1/sqrt(head_dim) except for the 27B's 1/sqrt(hidden / heads)."""
    arch = fields["general.architecture"]

    def key(suffix: str, default=None):
        return fields.get(f"{arch}.{suffix}", default)
    num_layers, hidden, heads = int(key("block_count")), int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    scale = (hidden // heads if num_layers == large_layers else head_dim) ** -0.5
    features = dict(norm_placement="sandwich", hidden_act="gelu_tanh", embedding_multiplier=embedding_normalizer(hidden),
                    attention_scale=scale, final_logit_softcap=key("final_logit_softcapping"))
    if swa:
        pattern = key("attention.sliding_window_pattern", default_pattern)
        types = (tuple("sliding" if s else "full" for s in pattern) if isinstance(pattern, list)
                 else tuple("sliding" if i % pattern < pattern - 1 else "full" for i in range(num_layers)))
        features |= dict(layer_types=types, sliding_window=int(key("attention.sliding_window", 4096)))
    return features


def hf_config(raw: dict, name: str) -> ModelConfig:
    return common.hf_config(raw, name, **hf_features(raw, default_pattern=2))


def gguf_config(fields: dict, name: str, tensors: dict) -> ModelConfig:
    softcap = fields.get(f"{fields['general.architecture']}.attn_logit_softcapping")
    return common.gguf_config(fields, name, tensors, attn_logit_softcap=softcap,
                              **gguf_features(fields, True, GGUF_SWA_PATTERN, GGUF_27B_LAYERS))
