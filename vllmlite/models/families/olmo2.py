"""OLMo 2: norms after the sublayers, not before (x + norm(attn(x)), then x + norm(mlp(x))), and
RMSNorm of Q and K over the whole projection ([heads * head_dim] weights) before RoPE. llama.cpp
stores it unpermuted, the post norms as post_attention_norm and post_ffw_norm."""

import dataclasses

from vllmlite.config import ModelConfig
from vllmlite.models.families import common
from vllmlite.models.families.common import GGUF_LLAMA, GGUF_QK_NORM, HF_LLAMA, HF_QK_NORM, unchanged

HF_NAMES = dataclasses.replace(HF_LLAMA, attn_norm=None, ffn_norm=None, **HF_QK_NORM,
                               post_attn_norm="model.layers.{i}.post_attention_layernorm",
                               post_ffn_norm="model.layers.{i}.post_feedforward_layernorm")
GGUF_NAMES = dataclasses.replace(GGUF_LLAMA, attn_norm=None, ffn_norm=None, **GGUF_QK_NORM,
                                 post_attn_norm="blk.{i}.post_attention_norm", post_ffn_norm="blk.{i}.post_ffw_norm")
GGUF_PERMUTES_QK = False
finish = unchanged
FEATURES = {"qk_norm": "full", "norm_placement": "post"}


def hf_config(raw: dict, name: str) -> ModelConfig:
    return common.hf_config(raw, name, **FEATURES)


def gguf_config(fields: dict, name: str, tensors: dict) -> ModelConfig:
    return common.gguf_config(fields, name, tensors, **FEATURES)
