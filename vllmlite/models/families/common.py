"""What the family modules share: tensor-name tables, and the config fields every Llama-like
family reads the same way (HF config.json and GGUF metadata). Knows nothing of files or kernels."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from vllmlite.config import ModelConfig, RopeScaling
from vllmlite.kernels.quant import scale_rows


@dataclass(frozen=True)
class LayerNames:
    """Where each LayerWeights field comes from, as tensor names with `{i}` for the layer index
    and without the ".weight"/".bias" suffix. Several names are stacked row-wise in order (Q, K,
    V; gate, up); one name is a tensor already fused. None: the family has no such tensor."""

    attn_norm: str | None
    qkv: tuple[str, ...]
    wo: str
    ffn_norm: str | None
    gate_up: tuple[str, ...]
    down: str
    q_norm: str | None = None
    k_norm: str | None = None
    post_attn_norm: str | None = None
    post_ffn_norm: str | None = None
    router: str | None = None            # a MoE layer's [experts, hidden]
    experts_gate_up: tuple[str, ...] = ()  # gate, up: one tensor per expert `{e}` (HF), or 3-D (GGUF)
    experts_down: str | None = None
    # Full tensor names of the experts fused (read instead when the gate/up one is there): router,
    # gate/up [experts, 2 * inter, hidden], down [experts, hidden, inter], as transformers 5 holds
    # them (a checkpoint saved with save_original_format=False).
    fused_experts: tuple[str, str, str] | None = None
    embed: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    lm_head: str = "lm_head"


HF_LLAMA = LayerNames(
    attn_norm="model.layers.{i}.input_layernorm",
    qkv=("model.layers.{i}.self_attn.q_proj", "model.layers.{i}.self_attn.k_proj",
         "model.layers.{i}.self_attn.v_proj"),
    wo="model.layers.{i}.self_attn.o_proj",
    ffn_norm="model.layers.{i}.post_attention_layernorm",
    gate_up=("model.layers.{i}.mlp.gate_proj", "model.layers.{i}.mlp.up_proj"),
    down="model.layers.{i}.mlp.down_proj",
)
GGUF_LLAMA = LayerNames(
    attn_norm="blk.{i}.attn_norm",
    qkv=("blk.{i}.attn_q", "blk.{i}.attn_k", "blk.{i}.attn_v"),
    wo="blk.{i}.attn_output",
    ffn_norm="blk.{i}.ffn_norm",
    gate_up=("blk.{i}.ffn_gate", "blk.{i}.ffn_up"),
    down="blk.{i}.ffn_down",
    # llama.cpp's converter stacks a MoE layer's experts: [experts, rows, cols] per name.
    router="blk.{i}.ffn_gate_inp",
    experts_gate_up=("blk.{i}.ffn_gate_exps", "blk.{i}.ffn_up_exps"),
    experts_down="blk.{i}.ffn_down_exps",
    embed="token_embd", final_norm="output_norm", lm_head="output",
)
HF_EXPERTS = {  # Qwen-MoE style (Qwen3-MoE, OLMoE); Mixtral names its own
    "router": "model.layers.{i}.mlp.gate",
    "experts_gate_up": ("model.layers.{i}.mlp.experts.{e}.gate_proj", "model.layers.{i}.mlp.experts.{e}.up_proj"),
    "experts_down": "model.layers.{i}.mlp.experts.{e}.down_proj",
    "fused_experts": ("model.layers.{i}.mlp.gate.weight", "model.layers.{i}.mlp.experts.gate_up_proj",
                      "model.layers.{i}.mlp.experts.down_proj"),
}
HF_QK_NORM = {"q_norm": "model.layers.{i}.self_attn.q_norm", "k_norm": "model.layers.{i}.self_attn.k_norm"}
GGUF_QK_NORM = {"q_norm": "blk.{i}.attn_q_norm", "k_norm": "blk.{i}.attn_k_norm"}


def hf_config(raw: dict, name: str, **features) -> ModelConfig:
    """The fields every family reads the same way from config.json; `features` set or override
    ModelConfig fields (the family's own)."""
    hidden, num_heads = raw["hidden_size"], raw["num_attention_heads"]
    fields = dict(
        architecture=name,
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=raw.get("head_dim") or hidden // num_heads,
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=hf_rope_theta(raw),
        rope_scaling=hf_rope_scaling(raw),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        attention_bias=raw.get("attention_bias", False),
    )
    return ModelConfig(**(fields | features))


def hf_sliding_layers(raw: dict) -> dict:
    """layer_types and sliding_window from a config whose `layer_types` names "sliding_attention"
    layers, when its `use_sliding_window` (default on) keeps them; else nothing (all full)."""
    types, window = raw.get("layer_types"), raw.get("sliding_window")
    if not types or not window or not raw.get("use_sliding_window", True) or "sliding_attention" not in types:
        return {}
    kinds = {"full_attention": "full", "sliding_attention": "sliding"}
    unknown = set(types) - set(kinds)
    if unknown:
        raise ValueError(f"layer_types {sorted(unknown)} are not supported ({sorted(kinds)})")
    return {"layer_types": tuple(kinds[t] for t in types[:raw["num_hidden_layers"]]), "sliding_window": int(window)}


def hf_num_experts(raw: dict) -> int:
    """`num_experts` (the hub's Qwen3-MoE and OLMoE configs), or `num_local_experts` (as Mixtral's,
    and as transformers 5 saves all three)."""
    return raw["num_experts"] if "num_experts" in raw else raw["num_local_experts"]


def moe_fields(num_experts: int, top_k: int, norm_topk_prob: bool, moe_layers: tuple[bool, ...]) -> dict:
    """ModelConfig's routed-experts fields; moe_layers None when every layer is a MoE layer, so a
    config reads the same whichever file it came from."""
    return dict(num_experts=int(num_experts), num_experts_per_tok=int(top_k), norm_topk_prob=bool(norm_topk_prob),
                moe_layers=None if all(moe_layers) else tuple(moe_layers))


def hf_rope_theta(raw: dict) -> float:
    params = raw.get("rope_parameters") or {}
    return float(raw.get("rope_theta") or params.get("rope_theta") or 10000.0)


def hf_rope_scaling(raw: dict) -> RopeScaling | None:
    """config.json's `rope_scaling` (or transformers 5's `rope_parameters`) as a RopeScaling."""
    scaling = raw.get("rope_scaling") or raw.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default"):
        return None
    if kind == "linear":
        return RopeScaling("linear", float(scaling["factor"]))
    if kind == "llama3":
        return RopeScaling("llama3", float(scaling["factor"]), float(scaling["low_freq_factor"]),
                           float(scaling["high_freq_factor"]),
                           int(scaling["original_max_position_embeddings"]))
    if kind == "longrope":
        return hf_longrope(raw, scaling)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (linear, llama3, longrope)")


def hf_longrope(raw: dict, scaling: dict) -> RopeScaling:
    """transformers' longrope: without an explicit `factor`, max_position_embeddings over the
    original; without an explicit `attention_factor`, sqrt(1 + ln(factor) / ln(original))."""
    original = int(scaling.get("original_max_position_embeddings") or raw["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or raw["max_position_embeddings"] / original)
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0
    return RopeScaling("longrope", factor, original_max_position_embeddings=original,
                       attention_factor=float(attention), short_factor=tuple(map(float, scaling["short_factor"])),
                       long_factor=tuple(map(float, scaling["long_factor"])))


def hf_partial_rotary_factor(raw: dict) -> float:
    for values in (raw, raw.get("rope_parameters") or {}):
        if values.get("partial_rotary_factor") is not None:
            return float(values["partial_rotary_factor"])
    return 1.0


def hf_capped_context(raw: dict, window_default_on: bool) -> int:
    """max_position_embeddings, capped at a sliding window when the config turns one on: no
    sliding-window attention is run for these families, and up to the window it is exact."""
    max_len = raw.get("max_position_embeddings", 2048)
    window = raw.get("sliding_window")
    if window and raw.get("use_sliding_window", window_default_on):
        max_len = min(max_len, window)
    return max_len


def gguf_config(fields: dict, name: str, tensors: dict, **features) -> ModelConfig:
    """The fields every family reads the same way from GGUF metadata (keys `<general.architecture>.*`)."""
    arch = fields["general.architecture"]

    def key(suffix: str, default=None):
        return fields.get(f"{arch}.{suffix}", default)

    num_heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    vocab = key("vocab_size") or len(fields["tokenizer.ggml.tokens"])
    scaling = None
    kind = key("rope.scaling.type")
    if kind == "linear":
        scaling = RopeScaling("linear", float(key("rope.scaling.factor")))
    elif kind not in (None, "none"):
        raise ValueError(f"GGUF rope.scaling.type {kind!r} is not supported (linear; llama3 via rope_freqs)")
    values = dict(
        architecture=name,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(key("attention.head_count_kv", num_heads)),
        head_dim=int(key("attention.key_length", hidden // num_heads)),
        max_position_embeddings=int(key("context_length", 2048)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
    )
    num_experts = int(key("expert_count", 0))
    if num_experts:   # a MoE layer is one with a router; llama.cpp's graphs renormalize unless a family says not
        layers = range(values["num_layers"])
        values |= moe_fields(num_experts, key("expert_used_count"), True,
                             tuple(f"blk.{i}.ffn_gate_inp.weight" in tensors for i in layers))
        if key("expert_feed_forward_length") is not None:
            values["moe_intermediate_size"] = int(key("expert_feed_forward_length"))
    return ModelConfig(**(values | features))


def unchanged(config: ModelConfig, weights):
    """`finish` for a family with nothing to fold at load."""
    return config, weights


def fold_attention_scale(config: ModelConfig, weights):
    """A softmax scale other than 1/sqrt(head_dim), folded into Q: Q's rows (and bias) times
    scale * sqrt(head_dim), or the q norm's weight where one follows the projection. Exact in real
    arithmetic (Q enters attention only through q.k, scaled before any soft-cap), and it leaves the
    kernels their default scale. Returns (config without the scale, weights)."""
    if config.attention_scale is None:
        return config, weights
    factor, q_rows = config.attention_scale * math.sqrt(config.head_dim), config.num_heads * config.head_dim

    def fold(layer):
        if layer.q_norm is not None:
            return dataclasses.replace(layer, q_norm=layer.q_norm * factor)
        bias = None if layer.bqkv is None else scale_rows(layer.bqkv, factor, q_rows)
        return dataclasses.replace(layer, wqkv=scale_rows(layer.wqkv, factor, q_rows), bqkv=bias)
    layers = [fold(layer) for layer in weights.layers]
    return dataclasses.replace(config, attention_scale=None), dataclasses.replace(weights, layers=layers)
