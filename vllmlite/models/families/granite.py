"""Granite (3.x dense): Llama with four multipliers. The embedding rows are scaled by
`embedding_multiplier`, each sublayer's output by `residual_multiplier` before the residual add,
the logits divided by `logits_scaling` (these three at run time: the embedding is tied to the LM
head), and `attention_multiplier` replaces 1/sqrt(head_dim) as the softmax scale, folded into Q
at load. llama.cpp writes them as granite.{embedding,residual,logit}_scale and attention.scale."""

from vllmlite.config import ModelConfig
from vllmlite.models.families import common
from vllmlite.models.families.common import GGUF_LLAMA, HF_LLAMA, fold_attention_scale

HF_NAMES, GGUF_NAMES = HF_LLAMA, GGUF_LLAMA
GGUF_PERMUTES_QK = True   # converted as Llama
finish = fold_attention_scale


def hf_config(raw: dict, name: str) -> ModelConfig:
    return common.hf_config(raw, name, embedding_multiplier=float(raw.get("embedding_multiplier", 1.0)),
                            residual_multiplier=float(raw.get("residual_multiplier", 1.0)),
                            attention_scale=raw.get("attention_multiplier"),
                            logit_multiplier=inverse("logits_scaling", float(raw.get("logits_scaling", 1.0))))


def inverse(name: str, value: float) -> float:
    """1 / value, for a divisor read from a file (where 0 is a bad value, not a crash)."""
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return 1.0 / value


def gguf_config(fields: dict, name: str, tensors: dict) -> ModelConfig:
    arch = fields["general.architecture"]

    def scale(key: str, default: float | None = 1.0) -> float | None:
        value = fields.get(f"{arch}.{key}")
        return default if value is None else float(value)
    return common.gguf_config(fields, name, tensors, embedding_multiplier=scale("embedding_scale"),
                              residual_multiplier=scale("residual_scale"),
                              attention_scale=scale("attention.scale", None),
                              logit_multiplier=inverse("logit_scale", scale("logit_scale")))
