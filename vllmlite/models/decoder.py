"""The decoder every family runs: embedding, RMSNorm, RoPE, GQA attention, gated MLP, LM head.

What differs between families (q/k norms, norm placement, activation, multipliers, soft-caps,
per-layer attention type and RoPE) is read from ModelConfig, a few lines each in this one forward
pass; the family modules (vllmlite/models/families) only map configs and tensor names onto it.
It runs one flattened batch of tokens from many sequences, each token with its own position.
Where K/V live and who attends to what comes in as AttentionMetadata; the model knows nothing of
blocks, requests or sampling.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import time
from dataclasses import dataclass, fields
from typing import NamedTuple

import numpy as np

from vllmlite.config import ModelConfig, ceil_div
from vllmlite.kernels import Kernels, get_kernels
from vllmlite.kernels.attention_metadata import AttentionMetadata, build_metadata
from vllmlite.kernels.quant import QuantizedMatrix, dequantize
from vllmlite.kernels.reference import route
from vllmlite.models.loader import LayerWeights, Matrix, ModelWeights
from vllmlite.models.rope import rope_inv_freq, rope_tables
from vllmlite.progress import progress

KVCache = list[tuple[np.ndarray, np.ndarray]]  # per layer (K, V), each [num_slots, kv_heads, head_dim]
WARM_UP_TOKENS = 20  # warm_up's longest prompt: past the few-token/BLAS switch of the linear layers
WARM_UP_CONTEXT = 272  # warm_up's longest context: the torch kernels split a lone decode's attention there


def on_backend(weights: ModelWeights, k: Kernels) -> ModelWeights:
    """The weights where `k` computes (the numpy backends: the same arrays, no copy)."""
    def move(array):
        return None if array is None else k.to_device(array)
    layers = [LayerWeights(**{f.name: move(getattr(layer, f.name)) for f in fields(layer)}) for layer in weights.layers]
    embed = move(weights.embed)
    lm_head = embed if weights.lm_head is weights.embed else move(weights.lm_head)
    return dataclasses.replace(weights, embed=embed, layers=layers, final_norm=move(weights.final_norm),
                               lm_head=lm_head)


def embed_rows(embed: Matrix, token_ids: np.ndarray) -> np.ndarray:
    """The embedding rows of `token_ids` [num_tokens, hidden] (a quantized table dequantizes just those)."""
    return dequantize(embed, token_ids) if isinstance(embed, QuantizedMatrix) else embed[token_ids]


@dataclass
class Workspace:
    """Activation buffers of one forward pass, reused by every layer and every step.

    Stored feature-major ([features, tokens], one column per token) and handed out as
    token-major views ([num_tokens, features], transposed), so every shape below reads as tokens
    first while the linear layers and kernels get BLAS-friendly operands. A step of n tokens uses
    the first features * n values of each buffer as one C-contiguous [features, n] block, so a
    kernel's inner loop over tokens has unit stride, known at compile time. The buffers grow (to
    twice the need) only when a step is larger than any before: a step allocates nothing but the
    logits it returns. A backend that prefers token-major rows (`kernels.feature_major` False: the
    torch one, for cuBLAS and coalesced GPU loads) gets plain [capacity, features] buffers instead.
    """

    capacity: int
    residual: np.ndarray  # [tokens, hidden]   the residual stream
    hidden: np.ndarray    # [tokens, hidden]   normed input of the next linear layer
    out: np.ndarray       # [tokens, hidden]   a sublayer's output before the residual add
    qkv: np.ndarray       # [tokens, (heads + 2 * kv_heads) * head_dim]
    attn: np.ndarray      # [tokens, heads * head_dim]
    gate_up: np.ndarray   # [tokens, 2 * intermediate]
    act: np.ndarray       # [tokens, intermediate]
    router_logits: np.ndarray  # [tokens, num_experts] (zero wide in a dense model)
    feature_major: bool = True

    @classmethod
    def allocate(cls, config: ModelConfig, capacity: int, dtype, kernels: Kernels) -> Workspace:
        c = config
        widths = (c.hidden_size, c.hidden_size, c.hidden_size, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim,
                  c.num_heads * c.head_dim, 2 * c.intermediate_size, c.intermediate_size, c.num_experts)
        if not kernels.feature_major:
            return cls(capacity, *(kernels.zeros((capacity, width), dtype) for width in widths), feature_major=False)
        return cls(capacity, *(kernels.zeros((width, capacity), dtype).T for width in widths))

    def views(self, num_tokens: int) -> Workspace:
        """The buffers for a step of `num_tokens` tokens (called on the allocated workspace)."""
        def first(buffer: np.ndarray) -> np.ndarray:   # buffer: [capacity, width]
            if not self.feature_major:
                return buffer[:num_tokens]
            width = buffer.shape[1]                    # a transposed C array
            return buffer.T.reshape(-1)[:width * num_tokens].reshape(width, num_tokens).T
        buffers = (first(getattr(self, f.name)) for f in fields(self)[1:-1])
        return Workspace(num_tokens, *buffers, feature_major=self.feature_major)


class LayerPlan(NamedTuple):
    """What one layer does beyond the shared path: its RoPE tables, or None (a no-RoPE layer), and
    the keyword arguments its paged_attention call needs (only those that differ from default)."""

    rope: tuple[np.ndarray, np.ndarray] | None   # (cos, sin), each [positions, rotary_dim / 2]
    attention_kwargs: dict


def layer_plans(config: ModelConfig, weights: ModelWeights, max_positions: int, k: Kernels,
                dtype) -> list[LayerPlan]:
    """Each layer's plan for a context of `max_positions`. The global layers share one pair of
    RoPE tables; with rope_local_theta the sliding layers share another (unscaled, see rope_inv_freq)."""
    c, tables = config, {}

    def rope(local: bool) -> tuple[np.ndarray, np.ndarray]:
        if local not in tables:
            inv_freq = rope_inv_freq(c, weights.rope_freq_factors, context_len=max_positions, local=local)
            factor = c.rope_scaling.attention_factor if c.rope_scaling is not None and not local else 1.0
            # warm_up's passes reach position WARM_UP_TOKENS - 1, whatever the context
            cos, sin = rope_tables(inv_freq, max(max_positions, WARM_UP_TOKENS), factor)
            tables[local] = (k.to_device(cos, dtype), k.to_device(sin, dtype))
        return tables[local]

    plans = []
    for i in range(c.num_layers):
        sliding = c.layer_type(i) == "sliding"
        kwargs = {"sliding_window": c.sliding_window} if sliding else {}
        if c.attn_logit_softcap is not None:
            kwargs["softcap"] = c.attn_logit_softcap
        if c.attention_scale is not None and c.attention_scale != 1.0 / math.sqrt(c.head_dim):
            kwargs["scale"] = c.attention_scale
        local = sliding and c.rope_local_theta is not None
        plans.append(LayerPlan(rope(local) if c.uses_rope(i) else None, kwargs))
    return plans


PLACEMENT_NORMS = {"pre": ("attn_norm", "ffn_norm"), "post": ("post_attn_norm", "post_ffn_norm"),
                   "sandwich": ("attn_norm", "ffn_norm", "post_attn_norm", "post_ffn_norm")}


def check_norms(config: ModelConfig, weights: ModelWeights) -> None:
    """Each layer holds exactly the norms its placement and q/k norm use: one missing would be
    skipped silently by the forward pass, one extra ignored."""
    wanted = set(PLACEMENT_NORMS[config.norm_placement]) | ({"q_norm", "k_norm"} if config.qk_norm else set())
    for i, layer in enumerate(weights.layers):
        present = {name for name in ("attn_norm", "ffn_norm", "post_attn_norm", "post_ffn_norm", "q_norm", "k_norm")
                   if getattr(layer, name) is not None}
        if present != wanted:
            raise ValueError(f"layer {i} has norms {sorted(present)}; {config.architecture} with norm_placement "
                             f"{config.norm_placement!r} and qk_norm {config.qk_norm!r} uses {sorted(wanted)}")


def require_kernels(k: Kernels, config: ModelConfig, plans: list[LayerPlan]) -> None:
    """A clear error when this model needs an operation the backend does not have (yet)."""
    act = f"{config.hidden_act}_and_mul"
    if not hasattr(k, act):
        raise NotImplementedError(f"the {k.name} kernels have no {act}: hidden_act {config.hidden_act!r} "
                                  "is not supported on them yet")
    if config.num_experts and not hasattr(k, "moe"):
        raise NotImplementedError(f"the {k.name} kernels have no moe: {config.architecture}'s routed experts "
                                  "are not supported on them yet")
    accepted = inspect.signature(k.paged_attention).parameters
    missing = sorted({name for plan in plans for name in plan.attention_kwargs if name not in accepted})
    if missing:
        raise NotImplementedError(f"the {k.name} kernels' paged_attention has no {missing} yet "
                                  f"(needed by {config.architecture})")


class DecoderModel:
    """A forward pass over a flattened batch. Weights are read-only; K/V are written in place.

    Every hot operation, the linear layers included, goes through `self.kernels` (see
    vllmlite/kernels), writing into the workspace.
    """

    def __init__(self, config: ModelConfig, weights: ModelWeights, max_positions: int,
                 kernels: Kernels | None = None) -> None:
        self.config = config
        self.kernels = k = kernels if kernels is not None else get_kernels()
        check_norms(config, weights)
        self.weights = on_backend(weights, k)
        self.dtype = self.weights.dtype                       # numpy's, or the backend's (torch.bfloat16)
        self.max_positions = max_positions
        self.plans = layer_plans(config, weights, max_positions, k, self.dtype)
        require_kernels(k, config, self.plans)
        self.act_and_mul = getattr(k, f"{config.hidden_act}_and_mul")
        self._workspace = Workspace.allocate(config, 1, self.dtype, k)

    def forward(self, input_ids: np.ndarray, meta: AttentionMetadata, kv_cache: KVCache,
                logits_rows: np.ndarray) -> np.ndarray:
        """input_ids [num_tokens] at meta.positions; logits_rows [num_logits] rows whose logits are wanted.

        Returns logits [num_logits, vocab], a host array: the LM head runs only on the rows that sample.
        """
        return self.kernels.to_numpy(self.forward_logits(input_ids, meta, kv_cache, logits_rows))

    def forward_logits(self, input_ids: np.ndarray, meta: AttentionMetadata, kv_cache: KVCache,
                       logits_rows: np.ndarray, workspace: Workspace | None = None):
        """`forward`, the logits left where the backend computed them (a device tensor on the GPU), so
        a caller that needs only their argmax copies one integer per row. workspace: buffers of the
        caller's (a CUDA graph's, which must not move), instead of the model's own."""
        return self._logits(self._final_hidden(input_ids, meta, kv_cache, workspace), logits_rows)

    def forward_with_hidden(self, input_ids: np.ndarray, meta: AttentionMetadata, kv_cache: KVCache,
                            logits_rows: np.ndarray, hidden_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`forward_logits`, plus the final-norm hidden states of `hidden_rows` [num_hidden] (what
        embeddings pool): (logits [num_logits, vocab] where the backend computed them, hidden
        [num_hidden, hidden_size], a host copy)."""
        k, hidden = self.kernels, self._final_hidden(input_ids, meta, kv_cache)
        return self._logits(hidden, logits_rows), k.to_numpy(hidden[k.to_device(hidden_rows)])

    def _final_hidden(self, input_ids: np.ndarray, meta: AttentionMetadata, kv_cache: KVCache,
                      workspace: Workspace | None = None) -> np.ndarray:
        """Every layer, then the final norm: [num_tokens, hidden], a view into the workspace."""
        c, w, k = self.config, self.weights, self.kernels
        buf = workspace.views(len(input_ids)) if workspace is not None else self.workspace(len(input_ids))
        buf.residual[...] = embed_rows(w.embed, k.to_device(input_ids))
        if c.embedding_multiplier != 1.0:
            buf.residual *= c.embedding_multiplier
        self._norm(buf.residual, w.layers[0].attn_norm, buf.hidden)
        # The step's index arrays where the kernels read them, once for every layer.
        positions, slots = k.to_device(meta.positions), k.to_device(meta.slot_mapping)
        for i, (layer, layer_kv, plan) in enumerate(zip(w.layers, kv_cache, self.plans)):
            self._attention(buf, layer, layer_kv, plan, meta, positions, slots)     # -> buf.out
            self._add_to_residual(buf, layer.post_attn_norm, layer.ffn_norm)
            if layer.router is None:
                k.linear(buf.hidden, layer.w_gate_up, buf.gate_up)
                self.act_and_mul(buf.gate_up, buf.act)
                k.linear(buf.act, layer.w_down, buf.out)
            else:
                self._experts(buf, layer)                                        # -> buf.out
            # The residual add, then the next layer's input norm (the final norm after the last).
            next_norm = w.layers[i + 1].attn_norm if i + 1 < len(w.layers) else w.final_norm
            self._add_to_residual(buf, layer.post_ffn_norm, next_norm)
        return buf.hidden

    def _experts(self, buf: Workspace, layer: LayerWeights) -> None:
        """buf.hidden (normed) -> buf.out through the routed experts. The router's logits go to the
        host for routing (softmax and top-k over [tokens, experts], small next to the experts'
        products). Unlike the dense MLP this allocates per layer: routing's [tokens, experts]
        temporaries and [tokens, top_k] ids and weights, and the moe kernel's buffers of
        [tokens * top_k, width] (its signature takes no scratch; their size follows the routing)."""
        c, k = self.config, self.kernels
        k.linear(buf.hidden, layer.router, buf.router_logits)
        routing = route(k.to_numpy(buf.router_logits), c.num_experts_per_tok, c.norm_topk_prob)
        k.moe(buf.hidden, k.to_device(routing.expert_ids), k.to_device(routing.expert_weights),
              layer.w_experts_gate_up, layer.w_experts_down, buf.out, activation=c.hidden_act)

    def _norm(self, x: np.ndarray, weight: np.ndarray | None, out: np.ndarray) -> None:
        """out = rms_norm(x), or a copy of x where the family has no norm there (post-norm OLMo 2)."""
        if weight is None:
            out[...] = x
        else:
            self.kernels.rms_norm(x, weight, self.config.rms_norm_eps, out)

    def _add_to_residual(self, buf: Workspace, post_norm: np.ndarray | None, next_norm: np.ndarray | None) -> None:
        """A sublayer's end: buf.out, normed first where the family has post-norms (Gemma, OLMo 2),
        joins the residual stream; buf.hidden becomes the next sublayer's (normed) input."""
        k, eps = self.kernels, self.config.rms_norm_eps
        if post_norm is not None:
            k.rms_norm(buf.out, post_norm, eps, buf.out)
        if self.config.residual_multiplier != 1.0:
            buf.out *= self.config.residual_multiplier
        if next_norm is None:
            buf.residual += buf.out
            buf.hidden[...] = buf.residual
        else:
            k.add_rms_norm(buf.out, buf.residual, next_norm, eps, buf.hidden)

    def _logits(self, hidden: np.ndarray, logits_rows: np.ndarray) -> np.ndarray:
        """The LM head on rows `logits_rows` of `hidden`: [num_logits, vocab]."""
        k, lm_head = self.kernels, self.weights.lm_head
        # Row-major on every backend: what the sampler reads, so the host copy (to_numpy) copies
        # nothing, and BLAS writes it in place (reference.linear).
        logits = k.empty((len(logits_rows), lm_head.shape[0]), self.dtype)
        k.linear(hidden[k.to_device(logits_rows)], lm_head, logits)
        c = self.config
        if c.logit_multiplier != 1.0:
            logits *= c.logit_multiplier
        if c.final_logit_softcap is not None:
            k.softcap(logits, c.final_logit_softcap)
        return logits

    def _attention(self, buf: Workspace, layer: LayerWeights, layer_kv: tuple[np.ndarray, np.ndarray],
                   plan: LayerPlan, meta: AttentionMetadata, positions: np.ndarray, slots: np.ndarray) -> None:
        """buf.hidden (normed) -> buf.out, the attention sublayer's output; K/V written to the cache."""
        c, k = self.config, self.kernels
        num_tokens = buf.capacity
        qkv = buf.qkv                                          # [num_tokens, (heads + 2 kv) * head_dim]
        k.linear(buf.hidden, layer.wqkv, qkv)
        if layer.bqkv is not None:
            qkv += layer.bqkv
        q_end, k_end = c.num_heads * c.head_dim, (c.num_heads + c.num_kv_heads) * c.head_dim
        # Views into qkv. Q and K heads sit side by side, so one RoPE call rotates both.
        qk = qkv[:, :k_end].reshape(num_tokens, c.num_heads + c.num_kv_heads, c.head_dim)
        q, key = qk[:, :c.num_heads], qk[:, c.num_heads:]
        value = qkv[:, k_end:].reshape(num_tokens, c.num_kv_heads, c.head_dim)
        if c.qk_norm == "full":                         # over the whole projection (OLMo 2)
            k.rms_norm(qkv[:, :q_end], layer.q_norm, c.rms_norm_eps, qkv[:, :q_end])
            k.rms_norm(qkv[:, q_end:k_end], layer.k_norm, c.rms_norm_eps, qkv[:, q_end:k_end])
        elif c.qk_norm == "head":                       # per head over head_dim (Qwen3, Gemma 3)
            for head in range(c.num_heads + c.num_kv_heads):
                weight = layer.q_norm if head < c.num_heads else layer.k_norm
                k.rms_norm(qk[:, head], weight, c.rms_norm_eps, qk[:, head])
        k_cache, v_cache = layer_kv
        if plan.rope is not None and c.rotary_dim == c.head_dim:    # one kernel where the backend fuses them
            k.rope_and_write_kv(qk, value, positions, *plan.rope, k_cache, v_cache, slots)
        else:
            if plan.rope is not None:
                k.rope(qk[:, :, :c.rotary_dim], positions, *plan.rope)
            k.write_kv(k_cache, v_cache, key, value, slots)
        attn = buf.attn.reshape(num_tokens, c.num_heads, c.head_dim)           # a view
        k.paged_attention(q, k_cache, v_cache, meta, attn, **plan.attention_kwargs)
        k.linear(buf.attn, layer.wo, buf.out)

    def workspace(self, num_tokens: int) -> Workspace:
        """Token-major views for a step of `num_tokens` tokens (the buffers grow when needed)."""
        if num_tokens > self._workspace.capacity:
            self._workspace = Workspace.allocate(self.config, 2 * num_tokens, self.dtype, self.kernels)
        return self._workspace.views(num_tokens)

    def profile_run(self, num_tokens: int, num_logits: int) -> None:
        """One forward pass as large as a step may be (`num_tokens` tokens, logits for `num_logits`
        rows), so the workspace and the backend's temporaries reach their peak before the KV cache
        takes the memory that is left. Each token is a one-token sequence on a one-block scratch
        cache: attention reads no memory the steps would not."""
        block_size, c = 1, self.config
        kv_cache = [(self.kernels.zeros((1, c.num_kv_heads, c.head_dim), self.dtype),
                     self.kernels.zeros((1, c.num_kv_heads, c.head_dim), self.dtype)) for _ in range(c.num_layers)]
        meta = build_metadata([1] * num_tokens, [1] * num_tokens, [[0]] * num_tokens, block_size)
        self.forward_logits(np.zeros(num_tokens, dtype=np.int64), meta, kv_cache,
                            np.arange(min(num_logits, num_tokens)))

    def warm_up(self) -> float:
        """Tiny forward passes on a scratch KV cache, so every kernel is compiled, or loaded from
        the disk cache, for this model's dtype and array layouts before the first request: a
        3-token prompt with a decode, a 20-token prompt (the other side of the linear layers'
        few-token/BLAS switch), and a lone decode (one token: its views of the QKV buffer are
        contiguous, which numba compiles separately; without it a single user's first request
        paid ~8 s of compiling), then a decode at a longer context (the torch kernels split its
        attention over the context and combine the splits) beside a prompt chunk after cached
        tokens. Returns the seconds it took."""
        start = time.perf_counter()
        c, block_size = self.config, 4
        context = min(WARM_UP_CONTEXT, max(self.max_positions, WARM_UP_TOKENS))   # the RoPE tables' length
        num_blocks = ceil_div(context, block_size) + ceil_div(WARM_UP_TOKENS, block_size)
        shape = (num_blocks * block_size, c.num_kv_heads, c.head_dim)
        kv_cache = [(self.kernels.zeros(shape, self.dtype), self.kernels.zeros(shape, self.dtype))
                    for _ in range(c.num_layers)]
        # (query lens, sequence lens, block tables, rows whose logits are wanted: one row and
        # several give the LM head differently laid out inputs)
        steps = [([3, 1], [3, 2], [[0], [1]], [2, 3]),
                 ([WARM_UP_TOKENS], [WARM_UP_TOKENS], [[2, 3, 4, 5, 6]], [WARM_UP_TOKENS - 1]),
                 ([1], [4], [[0]], [0]),
                 ([1, 12], [context, WARM_UP_TOKENS], [list(range(ceil_div(context, block_size))),
                                                       list(range(ceil_div(context, block_size), num_blocks))], [0, 12])]
        for query_lens, seq_lens, block_tables, logits_rows in progress(steps, "Warming up kernels", unit="pass"):
            meta = build_metadata(query_lens, seq_lens, block_tables, block_size)
            self.forward(np.zeros(sum(query_lens), dtype=np.int64), meta, kv_cache, np.array(logits_rows))
        return time.perf_counter() - start
