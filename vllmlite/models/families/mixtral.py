"""Mixtral: Llama's attention with routed experts in every layer (`block_sparse_moe`: w1 gate, w3
up, w2 down), the top `num_experts_per_tok` always renormalized. A sliding window caps the context
as Mistral's does. llama.cpp converts it as a "llama" GGUF with expert_count (the llama family
reads it back as Mixtral)."""

import dataclasses

from vllmlite.config import ModelConfig
from vllmlite.models.families import common
from vllmlite.models.families.common import GGUF_LLAMA, HF_LLAMA, gguf_config, hf_num_experts, moe_fields, unchanged

EXPERTS = "model.layers.{i}.block_sparse_moe.experts.{e}"
HF_NAMES = dataclasses.replace(HF_LLAMA, router="model.layers.{i}.block_sparse_moe.gate",
                               experts_gate_up=(f"{EXPERTS}.w1", f"{EXPERTS}.w3"), experts_down=f"{EXPERTS}.w2",
                               fused_experts=common.HF_EXPERTS["fused_experts"])   # transformers 5 renames to mlp
GGUF_NAMES = GGUF_LLAMA
GGUF_PERMUTES_QK = True
finish = unchanged
__all__ = ["GGUF_NAMES", "GGUF_PERMUTES_QK", "HF_NAMES", "finish", "gguf_config", "hf_config"]


def hf_config(raw: dict, name: str) -> ModelConfig:
    max_len = raw.get("max_position_embeddings", 2048)
    if raw.get("sliding_window"):
        max_len = min(max_len, raw["sliding_window"])
    return common.hf_config(raw, name, max_position_embeddings=max_len,
                            **moe_fields(hf_num_experts(raw), raw["num_experts_per_tok"], True,
                                         (True,) * raw["num_hidden_layers"]))
