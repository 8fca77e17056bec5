"""Llama: the shared decoder as it is (RMSNorm pre-norms, RoPE, GQA, SwiGLU). llama.cpp's converter
permutes Q and K rows for its rotary layout; the loader undoes it."""

from vllmlite.models.families.common import GGUF_LLAMA, HF_LLAMA, gguf_config, hf_config, unchanged

HF_NAMES, GGUF_NAMES = HF_LLAMA, GGUF_LLAMA
GGUF_PERMUTES_QK = True
finish = unchanged
__all__ = ["GGUF_NAMES", "GGUF_PERMUTES_QK", "HF_NAMES", "finish", "gguf_config", "hf_config"]
