"""Phi-3 and Phi-4-mini: Llama with Q, K, V in one fused qkv_proj and gate, up in one
gate_up_proj (already the shared layout), RoPE on the first partial_rotary_factor of each head
(Phi-4-mini: 0.75), and "longrope" scaling (see RopeScaling). A sliding window, where a config
has one (Phi-3-mini), caps the context as Mistral's does. llama.cpp stores the factors as
rope_factors_{short,long} tensors, the rotary dims, original context and attention factor as
metadata, the matrices fused and unpermuted."""

import dataclasses

from vllmlite.config import ModelConfig, RopeScaling
from vllmlite.models.families import common
from vllmlite.models.families.common import GGUF_LLAMA, HF_LLAMA, unchanged

HF_NAMES = dataclasses.replace(HF_LLAMA, qkv=("model.layers.{i}.self_attn.qkv_proj",),
                               gate_up=("model.layers.{i}.mlp.gate_up_proj",))
GGUF_NAMES = dataclasses.replace(GGUF_LLAMA, qkv=("blk.{i}.attn_qkv",), gate_up=("blk.{i}.ffn_up",))
GGUF_PERMUTES_QK = False
finish = unchanged


def hf_config(raw: dict, name: str) -> ModelConfig:
    return common.hf_config(raw, name, max_position_embeddings=common.hf_capped_context(raw, True),
                            partial_rotary_factor=common.hf_partial_rotary_factor(raw))


def gguf_config(fields: dict, name: str, tensors: dict) -> ModelConfig:
    arch = fields["general.architecture"]
    config = common.gguf_config(fields, name, tensors)
    rotary_dim = int(fields.get(f"{arch}.rope.dimension_count", config.head_dim))
    scaling = None
    if "rope_factors_long.weight" in tensors:
        original = int(fields[f"{arch}.rope.scaling.original_context_length"])
        scaling = RopeScaling("longrope", config.max_position_embeddings / original,
                              original_max_position_embeddings=original,
                              attention_factor=float(fields.get(f"{arch}.rope.scaling.attn_factor", 1.0)),
                              short_factor=tuple(map(float, tensors["rope_factors_short.weight"].data)),
                              long_factor=tuple(map(float, tensors["rope_factors_long.weight"].data)))
    window = int(fields.get(f"{arch}.attention.sliding_window", 0))
    max_len = min(config.max_position_embeddings, window) if window else config.max_position_embeddings
    return dataclasses.replace(config, partial_rotary_factor=rotary_dim / config.head_dim, rope_scaling=scaling,
                               max_position_embeddings=max_len)
