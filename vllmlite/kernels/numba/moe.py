"""The numba backend's routed experts (`moe`, defined in reference.py): the step's (token, expert)
pairs sorted by expert, each expert's tokens gathered into one block of columns and multiplied by
its weights with the backend's own `linear` (the compiled skinny product for a few tokens, BLAS for
more), then the weighted outputs summed back per token. Knows nothing of routing or attention.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from vllmlite.kernels.numba.elementwise import gelu_tanh_and_mul, silu_and_mul
from vllmlite.kernels.numba.jit import parallel, serial
from vllmlite.kernels.numba.linear import linear
from vllmlite.kernels.reference import check_expert_ids, check_moe

ACTIVATIONS = {"silu": silu_and_mul, "gelu_tanh": gelu_tanh_and_mul}


@serial
def _group_by_expert(expert_ids, num_experts):  # pragma: no cover - compiled
    """A counting sort of the pairs: pair p = t * top_k + k (token t's k-th expert). Expert e's
    pairs are order[expert_start[e]:expert_start[e + 1]], tokens ascending; column[p] is where pair
    p landed. Example: expert_ids [[2, 0], [0, 1]] -> order [1, 2, 3, 0], expert_start [0, 2, 3,
    4], column [3, 0, 1, 2]."""
    num_tokens, top_k = expert_ids.shape
    expert_start = np.zeros(num_experts + 1, dtype=np.int64)
    for t in range(num_tokens):
        for k in range(top_k):
            expert_start[expert_ids[t, k] + 1] += 1
    for e in range(num_experts):
        expert_start[e + 1] += expert_start[e]
    filled = expert_start[:-1].copy()
    order = np.empty(num_tokens * top_k, dtype=np.int64)
    column = np.empty(num_tokens * top_k, dtype=np.int64)
    for t in range(num_tokens):
        for k in range(top_k):
            e = expert_ids[t, k]
            order[filled[e]] = t * top_k + k
            column[t * top_k + k] = filled[e]
            filled[e] += 1
    return order, expert_start, column


@parallel
def _gather(xt, order, top_k, xs_t):  # pragma: no cover - compiled
    """xs_t[:, c] = x[token of pair order[c]]: xt [hidden, tokens] and xs_t [hidden, pairs] feature-major."""
    for j in prange(xt.shape[0]):
        for c in range(order.shape[0]):
            xs_t[j, c] = xt[j, order[c] // top_k]


@parallel
def _combine(ys_t, column, expert_weights, out_t):  # pragma: no cover - compiled
    """out_t[:, t] = sum over k of expert_weights[t, k] * ys_t[:, column of pair (t, k)], k ascending."""
    num_tokens, top_k = expert_weights.shape
    for j in prange(out_t.shape[0]):
        for t in range(num_tokens):
            total = out_t.dtype.type(0)
            for k in range(top_k):
                total += out_t.dtype.type(expert_weights[t, k]) * ys_t[j, column[t * top_k + k]]
            out_t[j, t] = total


def moe(x: np.ndarray, expert_ids: np.ndarray, expert_weights: np.ndarray, w_gate_up: np.ndarray,
        w_down: np.ndarray, out: np.ndarray, activation: str = "silu") -> None:
    """reference.moe: x, out [tokens, hidden] in any layout (the workspace's feature-major views or
    token-major arrays), float32 or float64 weights [experts, ...] (quantized ones raise).

    Every expert with tokens runs two products over exactly its tokens (its columns of the
    gathered [features, pairs] buffers, the layout `linear` is fastest on), so a step reads the
    weights of the experts it uses and no others; the activation runs once over all pairs."""
    check_moe(x, expert_ids, expert_weights, w_gate_up, w_down, activation)
    num_experts, hidden, inter = w_down.shape
    check_expert_ids(expert_ids, num_experts)
    num_tokens, top_k = expert_ids.shape
    num_pairs = num_tokens * top_k
    order, expert_start, column = _group_by_expert(np.ascontiguousarray(expert_ids, dtype=np.int64), num_experts)
    xs_t = np.empty((hidden, num_pairs), dtype=x.dtype)          # each pair's token, grouped by expert
    gate_up_t = np.empty((2 * inter, num_pairs), dtype=x.dtype)
    act_t = np.empty((inter, num_pairs), dtype=x.dtype)
    ys_t = np.empty((hidden, num_pairs), dtype=x.dtype)          # each pair's expert output
    _gather(x.T, order, top_k, xs_t)
    used = [(e, int(expert_start[e]), int(expert_start[e + 1])) for e in np.flatnonzero(np.diff(expert_start))]
    for e, lo, hi in used:
        linear(xs_t[:, lo:hi].T, w_gate_up[e], gate_up_t[:, lo:hi].T)
    ACTIVATIONS[activation](gate_up_t.T, act_t.T)
    for e, lo, hi in used:
        linear(act_t[:, lo:hi].T, w_down[e], ys_t[:, lo:hi].T)
    _combine(ys_t, column, expert_weights, out.T)
