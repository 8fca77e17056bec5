"""SmolLM3: Llama in which some layers apply no RoPE (NoPE): config.json's `no_rope_layers` (1 =
RoPE), by default every `no_rope_layer_interval`-th layer without. llama.cpp writes no per-layer
list: its smollm3 graph drops RoPE on every 4th layer, so the GGUF side does the same."""

from vllmlite.config import ModelConfig
from vllmlite.models.families import common
from vllmlite.models.families.common import GGUF_LLAMA, HF_LLAMA, unchanged

HF_NAMES, GGUF_NAMES = HF_LLAMA, GGUF_LLAMA
GGUF_PERMUTES_QK = True   # converted as Llama
GGUF_NO_ROPE_STEP = 4     # llama.cpp's src/models/smollm3.cpp: n_no_rope_layer_step
finish = unchanged


def every_nth_without_rope(num_layers: int, step: int) -> tuple[bool, ...]:
    """Layer i applies RoPE unless (i + 1) % step == 0: step 4 -> (True, True, True, False, ...)."""
    return tuple((i + 1) % step != 0 for i in range(num_layers))


def hf_config(raw: dict, name: str) -> ModelConfig:
    num_layers = raw["num_hidden_layers"]
    flags = raw.get("no_rope_layers")
    rope_layers = (tuple(bool(f) for f in flags[:num_layers]) if flags is not None
                   else every_nth_without_rope(num_layers, raw.get("no_rope_layer_interval", 4)))
    return common.hf_config(raw, name, rope_layers=rope_layers, **common.hf_sliding_layers(raw))


def gguf_config(fields: dict, name: str, tensors: dict) -> ModelConfig:
    num_layers = int(fields[f"{fields['general.architecture']}.block_count"])
    return common.gguf_config(fields, name, tensors, rope_layers=every_nth_without_rope(num_layers, GGUF_NO_ROPE_STEP))
