"""Mistral: Llama's structure. Its sliding window is not run here: the context is capped at the
window so every position stays exact. (llama.cpp converts it as a "llama" GGUF.)"""

from vllmlite.config import ModelConfig
from vllmlite.models.families import common
from vllmlite.models.families.common import GGUF_LLAMA, HF_LLAMA, gguf_config, unchanged

HF_NAMES, GGUF_NAMES = HF_LLAMA, GGUF_LLAMA
GGUF_PERMUTES_QK = True
finish = unchanged
__all__ = ["GGUF_NAMES", "GGUF_PERMUTES_QK", "HF_NAMES", "finish", "gguf_config", "hf_config"]


def hf_config(raw: dict, name: str) -> ModelConfig:
    max_len = raw.get("max_position_embeddings", 2048)
    window = raw.get("sliding_window")
    if window and raw.get("use_sliding_window", True):
        max_len = min(max_len, window)
    return common.hf_config(raw, name, max_position_embeddings=max_len)
