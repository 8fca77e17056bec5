"""Llama: the shared decoder as it is (RMSNorm pre-norms, RoPE, GQA, SwiGLU). llama.cpp's converter
permutes Q and K rows for its rotary layout; the loader undoes it. A "llama" GGUF with expert_count
is Mixtral (llama.cpp converts it so), and reads as one."""

import dataclasses

from vllmlite.config import ModelConfig
from vllmlite.models.families import common
from vllmlite.models.families.common import GGUF_LLAMA, HF_LLAMA, hf_config, unchanged

HF_NAMES, GGUF_NAMES = HF_LLAMA, GGUF_LLAMA
GGUF_PERMUTES_QK = True
finish = unchanged
__all__ = ["GGUF_NAMES", "GGUF_PERMUTES_QK", "HF_NAMES", "finish", "gguf_config", "hf_config"]


def gguf_config(fields: dict, name: str, tensors: dict) -> ModelConfig:
    config = common.gguf_config(fields, name, tensors)
    return dataclasses.replace(config, architecture="mixtral") if config.num_experts else config
