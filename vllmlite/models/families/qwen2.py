"""Qwen2: Llama with biases on Q, K and V (always, whatever config.json says). Its sliding window,
when a config turns it on, caps the context as Mistral's does."""

from vllmlite.config import ModelConfig
from vllmlite.models.families import common
from vllmlite.models.families.common import GGUF_LLAMA, HF_LLAMA, gguf_config, unchanged

HF_NAMES, GGUF_NAMES = HF_LLAMA, GGUF_LLAMA
GGUF_PERMUTES_QK = False
finish = unchanged
__all__ = ["GGUF_NAMES", "GGUF_PERMUTES_QK", "HF_NAMES", "finish", "gguf_config", "hf_config"]


def hf_config(raw: dict, name: str) -> ModelConfig:
    max_len = raw.get("max_position_embeddings", 2048)
    window = raw.get("sliding_window")
    if window and raw.get("use_sliding_window", False):
        max_len = min(max_len, window)
    return common.hf_config(raw, name, max_position_embeddings=max_len, attention_bias=True)
