"""Mistral: Llama with a sliding window on every layer (config.json's `sliding_window`: each token
attends to itself and the window - 1 tokens before it). llama.cpp converts it as a "llama" GGUF and
drops the window, so a Mistral GGUF loads (and runs, as in llama.cpp) as Llama."""

from vllmlite.config import ModelConfig
from vllmlite.models.families import common
from vllmlite.models.families.common import GGUF_LLAMA, HF_LLAMA, gguf_config, unchanged

HF_NAMES, GGUF_NAMES = HF_LLAMA, GGUF_LLAMA
GGUF_PERMUTES_QK = True
finish = unchanged
__all__ = ["GGUF_NAMES", "GGUF_PERMUTES_QK", "HF_NAMES", "finish", "gguf_config", "hf_config"]


def hf_config(raw: dict, name: str) -> ModelConfig:
    window = raw.get("sliding_window")
    if not window:
        return common.hf_config(raw, name)
    return common.hf_config(raw, name, layer_types=("sliding",) * raw["num_hidden_layers"], sliding_window=int(window))
