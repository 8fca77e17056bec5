"""Qwen3: Llama with an RMSNorm over each head's head_dim on Q and K before RoPE (one weight
[head_dim] for all Q heads, one for all K heads), head_dim from the config, no biases by default."""

import dataclasses

from vllmlite.config import ModelConfig
from vllmlite.models.families import common
from vllmlite.models.families.common import GGUF_LLAMA, GGUF_QK_NORM, HF_LLAMA, HF_QK_NORM, unchanged

HF_NAMES = dataclasses.replace(HF_LLAMA, **HF_QK_NORM)
GGUF_NAMES = dataclasses.replace(GGUF_LLAMA, **GGUF_QK_NORM)
GGUF_PERMUTES_QK = False
finish = unchanged


def hf_config(raw: dict, name: str) -> ModelConfig:
    return common.hf_config(raw, name, qk_norm="head")


def gguf_config(fields: dict, name: str, tensors: dict) -> ModelConfig:
    return common.gguf_config(fields, name, tensors, qk_norm="head")
