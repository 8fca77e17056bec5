"""Independent dense references for tests: no KV cache, no paging, KV heads repeated explicitly."""

from __future__ import annotations

import numpy as np

from vllmlite.config import ModelConfig
from vllmlite.kernels import reference as kernels
from vllmlite.kernels.quant import QuantizedMatrix, dequantize
from vllmlite.models.loader import LoadedModel, ModelWeights
from vllmlite.models.rope import rope_inv_freq


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    out = np.empty_like(x)
    kernels.rms_norm(x, weight, eps, out)
    return out


def dense_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_positions: np.ndarray) -> np.ndarray:
    """Causal attention of q [n, heads, d] at q_positions over k, v [ctx, kv_heads, d] at 0..ctx-1."""
    group = q.shape[1] // k.shape[1]
    k = np.repeat(k, group, axis=1)                                  # [ctx, heads, d]
    v = np.repeat(v, group, axis=1)
    scores = np.einsum("nhd,lhd->hnl", q, k) / np.sqrt(q.shape[-1])  # [heads, n, ctx]
    allowed = np.arange(k.shape[0])[None, :] <= q_positions[:, None]  # [n, ctx]
    scores = np.where(allowed[None], scores, -np.inf)
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = scores / scores.sum(axis=-1, keepdims=True)
    return np.einsum("hnl,lhd->nhd", probs, v)                       # [n, heads, d]


def dequantized(w: ModelWeights) -> ModelWeights:
    """The same weights with every quantized matrix as the float32 array it stands for."""
    def plain(a):
        return dequantize(a) if isinstance(a, QuantizedMatrix) else a
    layers = [type(layer)(**{k: plain(a) for k, a in vars(layer).items()}) for layer in w.layers]
    embed = plain(w.embed)
    lm_head = embed if w.lm_head is w.embed else plain(w.lm_head)
    return ModelWeights(embed, layers, w.final_norm, lm_head, w.rope_freq_factors)


def dense_logits(loaded: LoadedModel, token_ids: list[int]) -> np.ndarray:
    """Logits at every position of one sequence, recomputed from scratch. [len, vocab]
    Quantized weights count as their dequantized float32 matrices."""
    w = dequantized(loaded.weights)
    return _final_hidden(loaded.config, w, token_ids) @ w.lm_head.T


def dense_hidden(loaded: LoadedModel, token_ids: list[int]) -> np.ndarray:
    """The final-norm hidden states at every position of one sequence, from scratch. [len, hidden]"""
    return _final_hidden(loaded.config, dequantized(loaded.weights), token_ids)


def _final_hidden(c: ModelConfig, w: ModelWeights, token_ids: list[int]) -> np.ndarray:
    llama_like = dict(norm_placement="pre", hidden_act="silu", embedding_multiplier=1.0, attention_scale=None,
                      attn_logit_softcap=None, final_logit_softcap=None, logit_multiplier=1.0, layer_types=None,
                      rope_layers=None, partial_rotary_factor=1.0)
    unsupported = [name for name, value in llama_like.items() if getattr(c, name) != value]
    if unsupported or c.qk_norm not in (None, "head"):
        raise NotImplementedError(f"the dense reference has no {unsupported or ['qk_norm']} "
                                  "(Llama, Qwen3 and their routed experts only)")
    n = len(token_ids)
    positions = np.arange(n)
    angles = np.outer(positions, rope_inv_freq(c, w.rope_freq_factors))    # [n, head_dim / 2]
    cos, sin = np.cos(angles).astype(w.embed.dtype), np.sin(angles).astype(w.embed.dtype)
    x = w.embed[np.asarray(token_ids)]
    for layer in w.layers:
        h = rms_norm(x, layer.attn_norm, c.rms_norm_eps)
        qkv = h @ layer.wqkv.T
        if layer.bqkv is not None:
            qkv = qkv + layer.bqkv
        q_end = c.num_heads * c.head_dim
        k_end = q_end + c.num_kv_heads * c.head_dim
        q = qkv[:, :q_end].reshape(n, c.num_heads, c.head_dim).copy()
        k = qkv[:, q_end:k_end].reshape(n, c.num_kv_heads, c.head_dim).copy()
        if c.qk_norm == "head":                                          # over each head's head_dim
            q, k = rms_norm(q, layer.q_norm, c.rms_norm_eps), rms_norm(k, layer.k_norm, c.rms_norm_eps)
        kernels.rope(q, positions, cos, sin)
        kernels.rope(k, positions, cos, sin)
        v = qkv[:, k_end:].reshape(n, c.num_kv_heads, c.head_dim)
        x = x + dense_attention(q, k, v, positions).reshape(n, q_end) @ layer.wo.T
        h = rms_norm(x, layer.ffn_norm, c.rms_norm_eps)
        if layer.router is not None:
            x = x + np.stack([routed_experts(c, layer, row) for row in h])
            continue
        act = np.empty((n, c.intermediate_size), x.dtype)
        kernels.silu_and_mul(h @ layer.w_gate_up.T, act)
        x = x + act @ layer.w_down.T
    return rms_norm(x, w.final_norm, c.rms_norm_eps)


def routed_experts(c: ModelConfig, layer, h: np.ndarray) -> np.ndarray:
    """One token's MoE block, as transformers defines it: softmax of the router logits in float32,
    the top_k experts (ties to the lower id), renormalized if the config says so, and the weighted
    sum of those experts' SwiGLU outputs. h [hidden] -> [hidden]"""
    logits = (layer.router @ h).astype(np.float32)                               # [experts]
    probs = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    chosen = sorted(range(c.num_experts), key=lambda e: (-probs[e], e))[:c.num_experts_per_tok]
    weights = probs[chosen] / probs[chosen].sum() if c.norm_topk_prob else probs[chosen]
    out = np.zeros_like(h)
    for e, weight in zip(chosen, weights.astype(h.dtype)):
        gate, up = np.split(layer.w_experts_gate_up[e] @ h, 2)
        out += weight * (layer.w_experts_down[e] @ (gate / (1 + np.exp(-gate)) * up))
    return out


def dense_greedy(loaded: LoadedModel, prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(int(np.argmax(dense_logits(loaded, tokens)[-1])))
    return tokens[len(prompt):]


def next_token_logprobs(loaded: LoadedModel, token_ids: list[int]) -> np.ndarray:
    """log_softmax of the logits after `token_ids`, recomputed from scratch, in float64. [vocab]"""
    logits = dense_logits(loaded, token_ids)[-1].astype(np.float64)
    return logits - (logits.max() + np.log(np.exp(logits - logits.max()).sum()))


def beam_search(loaded: LoadedModel, prompt: list[int], beam_width: int, max_tokens: int, eos_token_id: int,
                ignore_eos: bool = False, length_penalty: float = 1.0) -> list[tuple[list[int], float, str]]:
    """Textbook beam search (vLLM's and Hugging Face's rule) with every beam's next-token logprobs
    recomputed over its whole sequence, no cache: (tokens, cumulative logprob, finish reason) of the
    best `beam_width` sequences, best first. Tokens are prompt + output, a final EOS kept."""
    def score(beam: tuple[list[int], float]) -> float:
        tokens, cum = beam
        return cum / (len(tokens) - (tokens[-1] == eos_token_id)) ** length_penalty

    live: list[tuple[list[int], float]] = [(list(prompt), 0.0)]
    stopped: list[tuple[list[int], float]] = []
    for _ in range(max_tokens):
        candidates = []
        for tokens, cum in live:
            logprobs = next_token_logprobs(loaded, tokens)
            for token_id in np.argsort(-logprobs, kind="stable")[:2 * beam_width]:
                child = (tokens + [int(token_id)], cum + float(logprobs[token_id]))
                (stopped if token_id == eos_token_id and not ignore_eos else candidates).append(child)
        live = sorted(candidates, key=score, reverse=True)[:beam_width]
        if not live:
            break
    ranked = sorted([(t, c, "stop") for t, c in stopped] + [(t, c, "length") for t, c in live],
                    key=lambda beam: score(beam[:2]), reverse=True)
    return ranked[:beam_width]
