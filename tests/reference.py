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


def dense_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_positions: np.ndarray,
                    window: int | None = None, scale: float | None = None,
                    softcap: float | None = None) -> np.ndarray:
    """Causal attention of q [n, heads, d] at q_positions over k, v [ctx, kv_heads, d] at 0..ctx-1;
    with a window, each query sees only the `window` positions ending at its own. scale defaults to
    1/sqrt(d); softcap turns scores s into softcap * tanh(s / softcap) before the mask."""
    group = q.shape[1] // k.shape[1]
    k = np.repeat(k, group, axis=1)                                  # [ctx, heads, d]
    v = np.repeat(v, group, axis=1)
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    scores = np.einsum("nhd,lhd->hnl", q, k) * scale                 # [heads, n, ctx]
    if softcap is not None:
        scores = softcap * np.tanh(scores / softcap)
    allowed = np.arange(k.shape[0])[None, :] <= q_positions[:, None]  # [n, ctx]
    if window is not None:
        allowed &= np.arange(k.shape[0])[None, :] > q_positions[:, None] - window
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
    c, w = loaded.config, dequantized(loaded.weights)
    logits = (_final_hidden(c, w, token_ids) @ w.lm_head.T) * c.logit_multiplier
    return logits if c.final_logit_softcap is None else c.final_logit_softcap * np.tanh(logits / c.final_logit_softcap)


def dense_hidden(loaded: LoadedModel, token_ids: list[int]) -> np.ndarray:
    """The final-norm hidden states at every position of one sequence, from scratch. [len, hidden]"""
    return _final_hidden(loaded.config, dequantized(loaded.weights), token_ids)


def _rope_tables(c: ModelConfig, w: ModelWeights, n: int, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [n, head_dim / 2] of one layer: the global base with its scaling, or a sliding
    layer's own base (rope_local_theta) unscaled."""
    local = c.layer_type(layer) == "sliding" and c.rope_local_theta is not None
    inv_freq = rope_inv_freq(c, w.rope_freq_factors, local=local)
    angles = np.outer(np.arange(n), inv_freq)                        # [n, head_dim / 2]
    return np.cos(angles).astype(w.embed.dtype), np.sin(angles).astype(w.embed.dtype)


def _final_hidden(c: ModelConfig, w: ModelWeights, token_ids: list[int]) -> np.ndarray:
    longrope = c.rope_scaling is not None and c.rope_scaling.rope_type == "longrope"
    if (c.norm_placement not in ("pre", "sandwich") or c.qk_norm not in (None, "head") or c.partial_rotary_factor != 1
            or c.residual_multiplier != 1.0 or longrope):
        raise NotImplementedError("the dense reference has pre and sandwich norms, per-head q/k norms, full rotary "
                                  "dims, no residual multiplier and no longrope only; got "
                                  f"{c.norm_placement!r}, {c.qk_norm!r}, {c.partial_rotary_factor}, "
                                  f"{c.residual_multiplier}, {c.rope_scaling}")
    n = len(token_ids)
    positions = np.arange(n)
    x = w.embed[np.asarray(token_ids)] * w.embed.dtype.type(c.embedding_multiplier)
    act_and_mul = getattr(kernels, f"{c.hidden_act}_and_mul")
    for i, layer in enumerate(w.layers):
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
        if c.uses_rope(i):
            cos, sin = _rope_tables(c, w, n, i)
            kernels.rope(q, positions, cos, sin)
            kernels.rope(k, positions, cos, sin)
        v = qkv[:, k_end:].reshape(n, c.num_kv_heads, c.head_dim)
        window = c.sliding_window if c.layer_type(i) == "sliding" else None
        out = dense_attention(q, k, v, positions, window, c.attention_scale, c.attn_logit_softcap).reshape(n, q_end)
        x = x + _post_norm(out @ layer.wo.T, layer.post_attn_norm, c.rms_norm_eps)
        h = rms_norm(x, layer.ffn_norm, c.rms_norm_eps)
        if layer.router is not None:
            x = x + np.stack([routed_experts(c, layer, row) for row in h])
            continue
        act = np.empty((n, c.intermediate_size), x.dtype)
        act_and_mul(h @ layer.w_gate_up.T, act)
        x = x + _post_norm(act @ layer.w_down.T, layer.post_ffn_norm, c.rms_norm_eps)
    return rms_norm(x, w.final_norm, c.rms_norm_eps)


def _post_norm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    """A sublayer's output, normed where the family norms it (Gemma's sandwich)."""
    return x if weight is None else rms_norm(x, weight, eps)


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
