"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm) with routed experts: softmax over the
experts, the top `num_experts_per_tok`, renormalized when `norm_topk_prob`. A layer is a MoE layer
unless listed in `mlp_only_layers` or off the `decoder_sparse_step` stride; the others keep a dense
MLP of `intermediate_size`. llama.cpp's qwen3moe graph always renormalizes."""

import dataclasses

from vllmlite.config import ModelConfig
from vllmlite.models.families import common
from vllmlite.models.families.common import GGUF_LLAMA, GGUF_QK_NORM, HF_EXPERTS, HF_LLAMA, HF_QK_NORM, unchanged

HF_NAMES = dataclasses.replace(HF_LLAMA, **HF_QK_NORM, **HF_EXPERTS)
GGUF_NAMES = dataclasses.replace(GGUF_LLAMA, **GGUF_QK_NORM)
GGUF_PERMUTES_QK = False
finish = unchanged


def hf_config(raw: dict, name: str) -> ModelConfig:
    step, dense = raw.get("decoder_sparse_step", 1), set(raw.get("mlp_only_layers") or ())
    layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(raw["num_hidden_layers"]))
    return common.hf_config(raw, name, qk_norm="head", moe_intermediate_size=raw["moe_intermediate_size"],
                            **common.moe_fields(common.hf_num_experts(raw), raw["num_experts_per_tok"],
                                                raw.get("norm_topk_prob", False), layers))


def gguf_config(fields: dict, name: str, tensors: dict) -> ModelConfig:
    return common.gguf_config(fields, name, tensors, qk_norm="head")
