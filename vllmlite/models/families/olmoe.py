"""OLMoE: Llama with an RMSNorm over the whole Q and K projections (as OLMo 2, before RoPE) and
routed experts in every layer, the top `num_experts_per_tok` renormalized only when
`norm_topk_prob` (off in OLMoE-1B-7B; llama.cpp's olmoe graph never renormalizes, so its GGUFs
read as off). `clip_qkv` is not supported."""

import dataclasses

from vllmlite.config import ModelConfig
from vllmlite.models.families import common
from vllmlite.models.families.common import GGUF_LLAMA, GGUF_QK_NORM, HF_EXPERTS, HF_LLAMA, HF_QK_NORM, unchanged

HF_NAMES = dataclasses.replace(HF_LLAMA, **HF_QK_NORM, **HF_EXPERTS)
GGUF_NAMES = dataclasses.replace(GGUF_LLAMA, **GGUF_QK_NORM)
GGUF_PERMUTES_QK = False
finish = unchanged


def hf_config(raw: dict, name: str) -> ModelConfig:
    if raw.get("clip_qkv") is not None:
        raise ValueError(f"OLMoE clip_qkv {raw['clip_qkv']} is not supported (only clip_qkv null)")
    return common.hf_config(raw, name, qk_norm="full",
                            **common.moe_fields(common.hf_num_experts(raw), raw["num_experts_per_tok"],
                                                raw.get("norm_topk_prob", False), (True,) * raw["num_hidden_layers"]))


def gguf_config(fields: dict, name: str, tensors: dict) -> ModelConfig:
    return common.gguf_config(fields, name, tensors, qk_norm="full", norm_topk_prob=False)
