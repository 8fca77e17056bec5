"""Every architecture vllmlite runs: its names in HF configs and GGUF files, the family module that
maps its config and tensors onto the shared decoder (vllmlite/models/families), and its features.

An architecture not listed here is a clear error naming the supported ones. Knows nothing of
tensors or files.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class Architecture:
    name: str                   # ours: ModelConfig.architecture
    hf_names: tuple[str, ...]   # config.json "architectures"
    gguf_names: tuple[str, ...]  # GGUF general.architecture
    family: str                 # the module in vllmlite/models/families
    features: str               # what it adds to the Llama decoder (README table, errors)

    def module(self) -> ModuleType:
        return importlib.import_module(f"vllmlite.models.families.{self.family}")


ARCHITECTURES = (
    Architecture("llama", ("LlamaForCausalLM",), ("llama",), "llama",
                 "RMSNorm, RoPE (linear and llama3 scaling), GQA, SwiGLU"),
    Architecture("mistral", ("MistralForCausalLM",), (), "mistral",
                 "Llama with a sliding window on every layer (GGUF: llama, window dropped)"),
    Architecture("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), "qwen2",
                 "Llama with q/k/v biases; an optional sliding window on the upper layers (GGUF: dropped)"),
    Architecture("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), "qwen3",
                 "Llama with per-head q/k RMSNorm, head_dim from the config"),
    Architecture("gemma2", ("Gemma2ForCausalLM",), ("gemma2",), "gemma2",
                 "(1 + w) sandwich RMSNorms, GeGLU, sqrt(hidden) embeddings, soft-caps, sliding window "
                 "on alternate layers"),
    Architecture("gemma3", ("Gemma3ForCausalLM",), ("gemma3",), "gemma3",
                 "Gemma 2 with per-head q/k norms, no attention soft-cap, 5 sliding : 1 global layers, "
                 "local and global RoPE"),
    Architecture("smollm3", ("SmolLM3ForCausalLM",), ("smollm3",), "smollm3",
                 "Llama with no RoPE on some layers (every 4th by default)"),
    Architecture("granite", ("GraniteForCausalLM",), ("granite",), "granite",
                 "Llama with embedding, attention, residual and logit multipliers"),
    Architecture("olmo2", ("Olmo2ForCausalLM",), ("olmo2",), "olmo2",
                 "post-sublayer norms; q/k RMSNorm over the whole projection"),
    Architecture("phi3", ("Phi3ForCausalLM",), ("phi3",), "phi3",
                 "Phi-3, Phi-4-mini: fused QKV and gate/up, partial RoPE, longrope scaling"),
    Architecture("qwen3_moe", ("Qwen3MoeForCausalLM",), ("qwen3moe",), "qwen3_moe",
                 "Qwen3 with routed experts (softmax top-k, norm_topk_prob; dense layers per "
                 "decoder_sparse_step and mlp_only_layers)"),
    Architecture("mixtral", ("MixtralForCausalLM",), (), "mixtral",
                 "Llama with routed experts in every layer (top-k renormalized; GGUF: llama with expert_count)"),
    Architecture("olmoe", ("OlmoeForCausalLM",), ("olmoe",), "olmoe",
                 "full-width q/k RMSNorm and routed experts (top-k, norm_topk_prob)"),
)


def supported() -> str:
    return "; ".join(f"{a.name} (HF {', '.join(a.hf_names)}; GGUF {', '.join(a.gguf_names) or '-'})"
                     for a in ARCHITECTURES)


def from_hf(names: list[str]) -> Architecture:
    """The first of a config's `architectures` that is supported."""
    for name in names:
        for arch in ARCHITECTURES:
            if name in arch.hf_names:
                return arch
    raise ValueError(f"HF architectures {names} are not supported; supported: {supported()}")


def from_gguf(name: str | None) -> Architecture:
    for arch in ARCHITECTURES:
        if name in arch.gguf_names:
            return arch
    raise ValueError(f"GGUF architecture {name!r} is not supported; supported: {supported()}")
