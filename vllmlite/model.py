"""The Llama-family decoder in numpy: embedding, RMSNorm, RoPE, GQA attention, SwiGLU, LM head.

It runs one flattened batch of tokens from many sequences, each token with its own position.
Where K/V live and who attends to what comes in as AttentionMetadata; the model knows nothing of
blocks, requests or sampling.
"""

from __future__ import annotations

import numpy as np

from vllmlite.attention import AttentionMetadata, paged_attention, write_kv
from vllmlite.config import ModelConfig
from vllmlite.loader import ModelWeights

KVCache = list[tuple[np.ndarray, np.ndarray]]  # per layer (K, V), each [num_slots, kv_heads, head_dim]


def rope_inv_freq(config: ModelConfig, freq_factors: np.ndarray | None = None) -> np.ndarray:
    """Rotary inverse frequencies [head_dim / 2], with linear or llama3 scaling when configured."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    if freq_factors is not None:
        return inv_freq / freq_factors.astype(np.float64)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: long wavelengths are divided by `factor`, short ones kept, the middle interpolated.
    old_len = scaling.original_max_position_embeddings
    wavelen = 2 * np.pi / inv_freq
    scaled = np.where(wavelen > old_len / scaling.low_freq_factor, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= old_len / scaling.high_freq_factor) & (wavelen <= old_len / scaling.low_freq_factor)
    return np.where(is_medium, smoothed, scaled)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    variance = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(variance + eps) * weight


def linear(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """x [tokens, in] times weight [out, in] transposed -> [tokens, out].

    Computed as (weight @ x.T).T: OpenBLAS runs a few-row x @ weight.T about twice as slowly
    (measured on 2-16 rows), and decode batches are exactly that. The result is a transposed view.
    """
    return (weight @ x.T).T


def silu(x: np.ndarray) -> np.ndarray:
    # x * sigmoid(x), written with tanh so large negative inputs cannot overflow exp.
    return 0.5 * x * (1.0 + np.tanh(0.5 * x))


class LlamaModel:
    """A forward pass over a flattened batch. Weights are read-only; K/V are written in place."""

    def __init__(self, config: ModelConfig, weights: ModelWeights, max_positions: int) -> None:
        self.config = config
        self.weights = weights
        self.dtype = weights.embed.dtype
        inv_freq = rope_inv_freq(config, weights.rope_freq_factors)
        angles = np.outer(np.arange(max_positions, dtype=np.float64), inv_freq)  # [max_positions, head_dim/2]
        self.cos = np.cos(angles).astype(self.dtype)
        self.sin = np.sin(angles).astype(self.dtype)

    def forward(self, input_ids: np.ndarray, meta: AttentionMetadata, kv_cache: KVCache,
                logits_rows: np.ndarray) -> np.ndarray:
        """input_ids [num_tokens] at meta.positions; logits_rows [num_logits] rows whose logits are wanted.

        Returns logits [num_logits, vocab]: the LM head runs only on the rows that sample.
        """
        c, w = self.config, self.weights
        x = w.embed[input_ids]                                    # [num_tokens, hidden]
        cos, sin = self.cos[meta.positions], self.sin[meta.positions]  # [num_tokens, head_dim/2]
        for layer, layer_kv in zip(w.layers, kv_cache):
            h = rms_norm(x, layer.attn_norm, c.rms_norm_eps)
            x = x + self._attention(h, layer, cos, sin, layer_kv, meta)
            h = rms_norm(x, layer.ffn_norm, c.rms_norm_eps)
            gate_up = linear(h, layer.w_gate_up)                  # [num_tokens, 2 * intermediate]
            gate, up = np.split(gate_up, 2, axis=-1)
            x = x + linear(silu(gate) * up, layer.w_down)
        h = rms_norm(x[logits_rows], w.final_norm, c.rms_norm_eps)
        return np.ascontiguousarray(linear(h, w.lm_head))      # [num_logits, vocab]

    def _attention(self, h: np.ndarray, layer, cos: np.ndarray, sin: np.ndarray,
                   layer_kv: tuple[np.ndarray, np.ndarray], meta: AttentionMetadata) -> np.ndarray:
        c = self.config
        num_tokens = h.shape[0]
        qkv = linear(h, layer.wqkv)                               # [num_tokens, (heads + 2 kv) * head_dim]
        if layer.bqkv is not None:
            qkv += layer.bqkv
        q_end = c.num_heads * c.head_dim
        k_end = q_end + c.num_kv_heads * c.head_dim
        q = apply_rope(qkv[:, :q_end].reshape(num_tokens, c.num_heads, c.head_dim), cos, sin)
        k = apply_rope(qkv[:, q_end:k_end].reshape(num_tokens, c.num_kv_heads, c.head_dim), cos, sin)
        v = qkv[:, k_end:].reshape(num_tokens, c.num_kv_heads, c.head_dim)
        k_cache, v_cache = layer_kv
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        out = paged_attention(q, k_cache, v_cache, meta)          # [num_tokens, heads, head_dim]
        return linear(out.reshape(num_tokens, q_end), layer.wo)   # [num_tokens, hidden]


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """HF's rotate-half RoPE: x [tokens, heads, head_dim], cos/sin [tokens, head_dim/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
