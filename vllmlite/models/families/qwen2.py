"""Qwen2: Llama with biases on Q, K and V (always, whatever config.json says). With
`use_sliding_window` (off in the released models) the layers from `max_window_layers` on slide
(transformers' rule; `layer_types` when the config lists them). llama.cpp's GGUF drops the window."""

from vllmlite.config import ModelConfig
from vllmlite.models.families import common
from vllmlite.models.families.common import GGUF_LLAMA, HF_LLAMA, gguf_config, unchanged

HF_NAMES, GGUF_NAMES = HF_LLAMA, GGUF_LLAMA
GGUF_PERMUTES_QK = False
finish = unchanged
__all__ = ["GGUF_NAMES", "GGUF_PERMUTES_QK", "HF_NAMES", "finish", "gguf_config", "hf_config"]


def hf_config(raw: dict, name: str) -> ModelConfig:
    layers = {}
    if raw.get("use_sliding_window", False) and raw.get("sliding_window"):
        first = raw.get("max_window_layers", 28)
        types = raw.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                           for i in range(raw["num_hidden_layers"])]
        layers = common.hf_sliding_layers(raw | {"layer_types": types})
    return common.hf_config(raw, name, attention_bias=True, **layers)
