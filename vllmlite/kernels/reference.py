"""The numpy reference kernels: the readable definition of every hot operation, and the test oracle.

Each function writes into `out` (or in place) like its compiled twin in `numba/`, so the
model calls both the same way. Plain numpy, no tricks: read these first.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from vllmlite.kernels import kv_dtype
from vllmlite.kernels.attention_metadata import AttentionGroup, AttentionMetadata, check_attention_options
from vllmlite.kernels.int_dot import int_dot_linear
from vllmlite.kernels.quant import QuantizedMatrix, dequantize

# Where arrays live: numpy's memory, so these are numpy itself (see Kernels in __init__.py).
zeros, empty, host_zeros = np.zeros, np.empty, np.zeros
name = "numpy"
GELU_TANH_SCALE = math.sqrt(2 / math.pi)   # a Python float keeps float32 float32 (NEP 50)
feature_major = True  # activations as transposed [features, tokens] arrays (BLAS-friendly, see DecoderModel)


def to_device(array: np.ndarray | QuantizedMatrix, dtype=None) -> np.ndarray | QuantizedMatrix:
    """The array itself (numpy memory is this backend's), in `dtype` when one is given."""
    return array if dtype is None else np.asarray(array, dtype=dtype)


def to_numpy(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x)


def argmax(logits: np.ndarray) -> np.ndarray:
    """Each row's first maximum: [rows] int64 (what the sampler's greedy rows take)."""
    return logits.argmax(axis=1).astype(np.int64)


def copy_slots(src: np.ndarray, dst: np.ndarray, src_slots: np.ndarray, dst_slots: np.ndarray) -> None:
    """dst[dst_slots] = src[src_slots]; a packed KV cache (kv_dtype.py) copies its scales too."""
    if isinstance(src, kv_dtype.PackedKV):
        kv_dtype.copy_slots(src, dst, src_slots, dst_slots)
    else:
        dst[dst_slots] = src[src_slots]


def linear(x: np.ndarray, weight: np.ndarray | QuantizedMatrix, out: np.ndarray, int_dot: bool = False) -> None:
    """out = x @ weight.T: x [tokens, in], weight [out, in], out [tokens, out]. A quantized weight
    means its dequantized float32 matrix (vllmlite/kernels/quant.py); with `int_dot`, times x
    rounded to 8 bits per block, in integers (vllmlite/kernels/int_dot.py's definition).

    One BLAS GEMM that writes `out` where it lies. The model's activations are transposed views of
    row-major [features, tokens] arrays (model.Workspace), so x.T and out.T are plain row-major
    matrices and weight @ x.T goes into out.T; OpenBLAS runs this about 30% faster than x @ weight.T
    for the few-row products of decode (measured at 32 rows, AVX2). A row-major out of several rows
    (the logits, [tokens, vocab]) takes x @ weight.T: for the default model's LM head at 32 rows
    that took 14.6 ms where weight @ x.T and the copy to row-major logits took 20.3 (2-core EPYC).
    """
    if isinstance(weight, QuantizedMatrix) and int_dot:
        out[...] = int_dot_linear(x, weight)
        return
    if isinstance(weight, QuantizedMatrix):
        weight = dequantize(weight)
    if out.shape[0] > 1 and out.flags.c_contiguous:
        np.matmul(x, weight.T, out=out)
    else:
        np.matmul(weight, x.T, out=out.T)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray) -> None:
    """out = x / sqrt(mean(x^2) + eps) * weight, row by row. x, out [tokens, hidden]."""
    variance = np.mean(x * x, axis=-1, keepdims=True)
    out[...] = x / np.sqrt(variance + eps) * weight


def add_rms_norm(x: np.ndarray, residual: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray) -> None:
    """The residual connection and the next norm: residual += x, then out = rms_norm(residual)."""
    residual += x
    rms_norm(residual, weight, eps, out)


def rope(x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> None:
    """HF's rotate-half RoPE, in place: x [tokens, heads, head_dim] at `positions` [tokens];
    cos/sin [max_positions, head_dim / 2] tables."""
    half = x.shape[-1] // 2
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]   # [tokens, 1, head_dim / 2]
    x1, x2 = x[..., :half].copy(), x[..., half:].copy()
    x[..., :half] = x1 * c - x2 * s
    x[..., half:] = x2 * c + x1 * s


def silu_and_mul(gate_up: np.ndarray, out: np.ndarray) -> None:
    """SwiGLU's activation: gate_up [tokens, 2 * inter] -> out [tokens, inter] = silu(gate) * up."""
    gate, up = np.split(gate_up, 2, axis=-1)
    with np.errstate(over="ignore"):  # exp(-gate) = inf for very negative gates: gate / inf = -0
        out[...] = gate / (1 + np.exp(-gate)) * up


def gelu_tanh_and_mul(gate_up: np.ndarray, out: np.ndarray) -> None:
    """GeGLU's activation (Gemma's gelu_pytorch_tanh): gate_up [tokens, 2 * inter] -> out [tokens,
    inter] = gelu_tanh(gate) * up, gelu_tanh(x) = 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3)))."""
    gate, up = np.split(gate_up, 2, axis=-1)
    with np.errstate(over="ignore"):  # x^3 = inf for huge gates: tanh(inf) = 1, gelu(x) = x
        out[...] = 0.5 * gate * (1 + np.tanh(GELU_TANH_SCALE * (gate + 0.044715 * gate ** 3))) * up


def softcap(x: np.ndarray, cap: float) -> None:
    """In place: x = cap * tanh(x / cap) (Gemma 2's final-logit soft-cap)."""
    np.tanh(x / cap, out=x)
    x *= cap


@kv_dtype.storing
def write_kv(k_cache: np.ndarray, v_cache: np.ndarray, k: np.ndarray, v: np.ndarray,
             slot_mapping: np.ndarray) -> None:
    """Store this step's keys and values: caches [num_slots, kv_heads, head_dim], k/v [tokens, ...];
    a packed cache (kv_cache_dtype fp16, bf16, int8: kv_dtype.py) rounds them to its dtype."""
    if isinstance(k_cache, kv_dtype.PackedKV):
        kv_dtype.write(k_cache, v_cache, k, v, slot_mapping)
        return
    k_cache[slot_mapping] = k
    v_cache[slot_mapping] = v


def rope_then_write_kv(rope_op, write_kv_op):
    """A backend's rope_and_write_kv (kernels.Kernels) made of its own rope and write_kv, one after the other."""
    def rope_and_write_kv(qk: np.ndarray, value: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                          k_cache: np.ndarray, v_cache: np.ndarray, slot_mapping: np.ndarray) -> None:
        rope_op(qk, positions, cos, sin)
        write_kv_op(k_cache, v_cache, qk[:, qk.shape[1] - value.shape[1]:], value, slot_mapping)
    return rope_and_write_kv


rope_and_write_kv = rope_then_write_kv(rope, write_kv)


@kv_dtype.attending
def paged_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, meta: AttentionMetadata,
                    out: np.ndarray, *, scale: float | None = None, sliding_window: int | None = None,
                    softcap: float | None = None) -> None:
    """Attend each query token to its own sequence's cached context (which includes this step's K/V).

    q, out [num_tokens, num_heads, head_dim]; caches [num_slots, num_kv_heads, head_dim].
    Sequence i's queries are rows query_start[i]:query_start[i+1], the last tokens of its
    seq_lens[i] tokens; query j sees keys at positions <= its own. GQA: query head h reads KV head
    h // (num_heads // num_kv_heads). This reference gathers each sequence's context into a padded
    copy (`meta.groups`) and runs dense softmax attention over it with BLAS.

    Options (the defaults are Llama's): scores are q.k * scale (None: 1/sqrt(head_dim)), then
    softcap * tanh(scores / softcap) when softcap is given (Gemma 2), then masked and softmaxed;
    sliding_window w: a query at position p sees only keys p - w + 1 .. p (Mistral, Gemma), and
    blocks wholly before its window are never read (the block manager may have freed them).
    """
    check_attention_options(scale, sliding_window, softcap)
    for group in meta.window_groups(sliding_window):
        attend_group(q, k_cache, v_cache, group, meta.block_size, out, scale=scale, softcap=softcap)


def attend_group(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, g: AttentionGroup, block_size: int,
                 out: np.ndarray, *, scale: float | None = None, softcap: float | None = None) -> None:
    """paged_attention for the sequences of one padded group (its mask holds any window)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group_size = num_heads // num_kv_heads
    bs = block_size
    # A Python float keeps float32 scores float32 (NEP 50).
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    num_seqs, max_q = g.query_rows.shape
    ctx_len = g.block_ids.shape[1] * bs
    # [B, max_q, kv, group, d] -> [B, kv, group * max_q, d]: each KV head serves its query heads.
    qg = q[g.query_rows].reshape(num_seqs, max_q, num_kv_heads, group_size, head_dim)
    qg = qg.transpose(0, 2, 3, 1, 4).reshape(num_seqs, num_kv_heads, group_size * max_q, head_dim)
    # The group's blocks [B, blocks, bs, kv_heads, head_dim], widened to q's dtype if packed (kv_dtype.py).
    context = (num_seqs, ctx_len, num_kv_heads, head_dim)
    keys = kv_dtype.gather_blocks(k_cache, g.block_ids, bs, q.dtype).reshape(context)
    values = kv_dtype.gather_blocks(v_cache, g.block_ids, bs, q.dtype).reshape(context)
    scores = qg @ keys.transpose(0, 2, 3, 1)                    # [B, kv, group * max_q, ctx]
    scores = scores.reshape(num_seqs, num_kv_heads, group_size, max_q, ctx_len) * scale
    if softcap is not None:
        scores = float(softcap) * np.tanh(scores / float(softcap))
    scores += g.bias[:, :, None]                                # bias [B, 1, 1, max_q, ctx]
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    probs = probs.reshape(num_seqs, num_kv_heads, group_size * max_q, ctx_len)
    ctx = probs @ values.transpose(0, 2, 1, 3)                  # [B, kv, group * max_q, d]
    ctx = ctx.reshape(num_seqs, num_kv_heads, group_size, max_q, head_dim).transpose(0, 3, 1, 2, 4)
    ctx = ctx.reshape(num_seqs, max_q, num_heads, head_dim)     # [B, max_q, heads, d]
    out[g.query_rows[g.query_valid]] = ctx[g.query_valid]


class Routing(NamedTuple):
    """Each token's experts and their weights, as `route` chooses them."""

    expert_ids: np.ndarray       # [tokens, top_k] int64, the most probable expert first
    expert_weights: np.ndarray   # [tokens, top_k] in the router logits' dtype


def route(router_logits: np.ndarray, top_k: int, normalize: bool) -> Routing:
    """transformers' MoE routing (Mixtral, Qwen3-MoE, OLMoE): softmax over the experts in float32
    (whatever the model's dtype, as `F.softmax(..., dtype=torch.float)`), the top_k most probable,
    renormalized to sum to 1 when `normalize` (Mixtral always; Qwen3-MoE and OLMoE per
    norm_topk_prob), then cast to the logits' dtype. router_logits [tokens, experts].

    Among equal probabilities the lower expert id comes first. torch.topk leaves the order of ties
    to its implementation (its CPU kernel's nth_element/partial_sort reorders them), so exactly
    equal logits are the one case where this may pick other experts than transformers.
    Example: logits [[0, 2, 1]], top_k 2 -> experts [[1, 2]], weights [[0.731, 0.269]] normalized."""
    logits = np.asarray(router_logits, dtype=np.float32)
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)                                  # [tokens, experts]
    expert_ids = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]          # [tokens, top_k]
    weights = np.take_along_axis(probs, expert_ids, axis=-1)
    if normalize:
        weights /= weights.sum(axis=-1, keepdims=True)
    return Routing(expert_ids.astype(np.int64), weights.astype(router_logits.dtype))


MOE_ACTIVATIONS = {"silu": silu_and_mul, "gelu_tanh": gelu_tanh_and_mul}   # activation -> its *_and_mul


def check_moe(x, expert_ids, expert_weights, w_gate_up, w_down, activation: str) -> None:
    """moe's operands, or an error saying what is accepted. (Shapes only: the experts' range is
    the numpy backends' to check, where a bad id would read outside the weights.)"""
    if isinstance(w_gate_up, QuantizedMatrix) or isinstance(w_down, QuantizedMatrix):
        raise NotImplementedError("moe: quantized expert weights are not supported; pass float32 or float64 "
                                  "arrays w_gate_up [experts, 2 * inter, hidden] and w_down [experts, hidden, inter]")
    if activation not in MOE_ACTIVATIONS:
        raise ValueError(f"moe: activation must be one of {sorted(MOE_ACTIVATIONS)}, got {activation!r}")
    num_experts, two_inter, hidden = w_gate_up.shape
    if tuple(w_down.shape) != (num_experts, hidden, two_inter // 2) or two_inter % 2:
        raise ValueError(f"moe: w_gate_up [experts, 2 * inter, hidden] and w_down [experts, hidden, inter] disagree: "
                         f"{tuple(w_gate_up.shape)} and {tuple(w_down.shape)}")
    if expert_ids.ndim != 2 or tuple(expert_ids.shape) != tuple(expert_weights.shape) \
            or expert_ids.shape[0] != x.shape[0] or x.shape[1] != hidden:
        raise ValueError(f"moe: x [tokens, {hidden}], expert_ids and expert_weights [tokens, top_k] expected, got "
                         f"{tuple(x.shape)}, {tuple(expert_ids.shape)}, {tuple(expert_weights.shape)}")


def check_expert_ids(expert_ids: np.ndarray, num_experts: int) -> None:
    if expert_ids.size and (expert_ids.min() < 0 or expert_ids.max() >= num_experts):
        raise ValueError(f"moe: expert ids must lie in 0 .. {num_experts - 1}, got {expert_ids.min()} .. {expert_ids.max()}")


def moe(x: np.ndarray, expert_ids: np.ndarray, expert_weights: np.ndarray, w_gate_up: np.ndarray,
        w_down: np.ndarray, out: np.ndarray, activation: str = "silu") -> None:
    """Routed experts (a sparse MoE block without its router): out[t] = sum over k of
    expert_weights[t, k] * down_e(act(gate_e(x[t])) * up_e(x[t])), e = expert_ids[t, k].

    x, out [tokens, hidden], any strides (token- or feature-major views); expert_ids,
    expert_weights [tokens, top_k] (`route` makes them); w_gate_up [experts, 2 * inter, hidden]
    (gate rows, then up rows, as the dense layers fuse them); w_down [experts, hidden, inter];
    activation "silu" (SwiGLU experts) or "gelu_tanh". Each expert runs once, on the tokens
    routed to it, so the work is what the active parameters cost."""
    check_moe(x, expert_ids, expert_weights, w_gate_up, w_down, activation)
    check_expert_ids(expert_ids, w_gate_up.shape[0])
    inter = w_down.shape[2]
    out[...] = 0
    for e in np.unique(expert_ids):
        tokens, slots = np.nonzero(expert_ids == e)                   # [n] each: the (token, k) pairs routed to e
        act = np.empty((len(tokens), inter), dtype=x.dtype)           # [n, inter]
        MOE_ACTIVATIONS[activation](x[tokens] @ w_gate_up[e].T, act)
        y = act @ w_down[e].T                                         # [n, hidden]
        np.add.at(out, tokens, expert_weights[tokens, slots, None].astype(x.dtype) * y)
