"""The numba backend's routed experts (`moe`, defined in reference.py): the step's (token, expert)
pairs sorted by expert, each expert's tokens gathered into one block and multiplied by its weights
(a compiled product for experts with a few tokens, all of them in one parallel region; BLAS for
more), then the weighted outputs summed back per token. Knows nothing of routing or attention.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
from numba import prange

from vllmlite.kernels import blas
from vllmlite.kernels.numba.jit import parallel, serial
from vllmlite.kernels.numba.linear import SKINNY_MAX_ROWS
from vllmlite.kernels.reference import GELU_TANH_SCALE, check_expert_ids, check_moe

SERIAL_MAX_PAIRS = 8   # (token, expert) pairs up to which gathering and summing run on one thread


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


@serial
def _gather_rows(xt, order, top_k, xs, first, last):  # pragma: no cover - compiled
    """xs[c] = x[token of pair order[c]] for columns first .. last - 1: xt [hidden, tokens] (the
    feature-major array of a workspace view, or any strides), xs [pairs, hidden] token-major."""
    for c in range(first, last):
        t = order[c] // top_k
        for j in range(xt.shape[0]):
            xs[c, j] = xt[j, t]


@parallel
def _gather(xt, order, top_k, xs):  # pragma: no cover - compiled
    num_pairs = order.shape[0]
    for part in prange((num_pairs + 15) // 16):
        _gather_rows(xt, order, top_k, xs, part * 16, min(num_pairs, part * 16 + 16))


@parallel
def _few_token_products(xs, weights, experts, expert_start, out):  # pragma: no cover - compiled
    """out[lo:hi] = xs[lo:hi] @ weights[e].T for every expert e of `experts` (its pairs lo:hi from
    expert_start), each with a few tokens: one parallel region over (expert, four weight rows),
    each weight row read once and dotted with the expert's tokens while in cache (as linear's
    skinny product). xs [pairs, in] and out [pairs, out] token-major: unit-stride dots."""
    num_out, num_in = weights.shape[1], weights.shape[2]
    num_tiles = (num_out + 3) // 4
    for item in prange(experts.shape[0] * num_tiles):
        e = experts[item // num_tiles]
        first_row = (item % num_tiles) * 4
        for c in range(expert_start[e], expert_start[e + 1]):
            for row in range(first_row, min(first_row + 4, num_out)):
                acc = weights.dtype.type(0)
                for i in range(num_in):
                    acc += weights[e, row, i] * xs[c, i]
                out[c, row] = acc


@parallel
def _activate(gate_up, act, gelu_tanh):  # pragma: no cover - compiled
    """act = silu(gate) * up, or gelu_tanh(gate) * up (reference's *_and_mul), on token-major
    [pairs, 2 * inter] -> [pairs, inter] rows: unit stride along the features."""
    inter = act.shape[1]
    dtype = act.dtype.type
    scale, cubic, half = dtype(GELU_TANH_SCALE), dtype(0.044715), dtype(0.5)
    for c in prange(act.shape[0]):
        if gelu_tanh:
            for j in range(inter):
                g = gate_up[c, j]
                act[c, j] = half * g * (1 + math.tanh(scale * (g + cubic * g * g * g))) * gate_up[c, inter + j]
        else:
            for j in range(inter):
                g = gate_up[c, j]
                act[c, j] = g / (1 + math.exp(-g)) * gate_up[c, inter + j]   # exp(-g) = inf gives -0


@serial
def _combine_features(ys, column, expert_weights, out, first, last):  # pragma: no cover - compiled
    """out[:, first:last] = sum over k of expert_weights[t, k] * ys[column of pair (t, k)], k
    ascending: ys [pairs, hidden] token-major, out any strides (a band of features at a time, so
    a feature-major out's lines stay in cache from one token to the next)."""
    num_tokens, top_k = expert_weights.shape
    dtype = out.dtype.type
    for t in range(num_tokens):
        for j in range(first, last):
            total = dtype(0)
            for k in range(top_k):
                total += dtype(expert_weights[t, k]) * ys[column[t * top_k + k], j]
            out[t, j] = total


@parallel
def _combine(ys, column, expert_weights, out):  # pragma: no cover - compiled
    hidden = out.shape[1]
    for part in prange((hidden + 63) // 64):
        _combine_features(ys, column, expert_weights, out, part * 64, min(hidden, part * 64 + 64))


# Threads that run the experts' BLAS products (`_many_token_products`); started on first use.
_expert_workers = ThreadPoolExecutor(max_workers=numba.config.NUMBA_NUM_THREADS, thread_name_prefix="vllmlite-moe")


def _many_token_products(xs: np.ndarray, weights: np.ndarray, experts: list[tuple[int, int, int]],
                         out: np.ndarray) -> None:
    """out[lo:hi] = xs[lo:hi] @ weights[e].T for each (e, lo, hi), dealt round robin to as many
    threads as numba uses, each product on a one-thread OpenBLAS: an expert's product is small
    (its tokens by inter), and OpenBLAS's own threads on each lost much more than they gave on a
    busy machine (256 tokens, 32 experts of 1024 x 512, load 8 on 2 cores: 94 ms on one thread
    against 240-520 on OpenBLAS's)."""
    num_workers = min(numba.get_num_threads(), len(experts))

    def multiply_share(worker: int) -> None:
        for e, lo, hi in experts[worker::num_workers]:
            np.matmul(xs[lo:hi], weights[e].T, out=out[lo:hi])

    if not experts:
        return
    with blas.one_thread():
        if num_workers == 1:
            multiply_share(0)
        else:
            list(_expert_workers.map(multiply_share, range(num_workers)))


def moe(x: np.ndarray, expert_ids: np.ndarray, expert_weights: np.ndarray, w_gate_up: np.ndarray,
        w_down: np.ndarray, out: np.ndarray, activation: str = "silu") -> None:
    """reference.moe: x, out [tokens, hidden] in any layout (the workspace's feature-major views or
    token-major arrays), float32 or float64 weights [experts, ...] (quantized ones raise).

    Every expert with tokens runs two products over exactly its tokens, so a step reads the
    weights of the experts it uses and no others: the experts with at most SKINNY_MAX_ROWS tokens
    (all of them in a decode step) together in one compiled parallel region, each other one with
    BLAS into its own contiguous block of rows of the token-major [pairs, features] buffers (a
    strided block of columns sent numpy's matmul off BLAS at times: 20 ms for 0.4). A few pairs
    run on one thread where numba's would cost more to wake."""
    check_moe(x, expert_ids, expert_weights, w_gate_up, w_down, activation)
    num_experts, hidden, inter = w_down.shape
    check_expert_ids(expert_ids, num_experts)
    num_tokens, top_k = expert_ids.shape
    num_pairs = num_tokens * top_k
    order, expert_start, column = _group_by_expert(np.ascontiguousarray(expert_ids, dtype=np.int64), num_experts)
    counts = np.diff(expert_start)                               # [experts] tokens routed to each
    few = np.flatnonzero((counts > 0) & (counts <= SKINNY_MAX_ROWS))
    many = [(e, int(expert_start[e]), int(expert_start[e + 1])) for e in np.flatnonzero(counts > SKINNY_MAX_ROWS)]
    xs = np.empty((num_pairs, hidden), dtype=x.dtype)            # each pair's token, grouped by expert
    gate_up = np.empty((num_pairs, 2 * inter), dtype=x.dtype)
    act = np.empty((num_pairs, inter), dtype=x.dtype)
    ys = np.empty((num_pairs, hidden), dtype=x.dtype)            # each pair's expert output
    serial = num_pairs <= SERIAL_MAX_PAIRS
    if serial:
        _gather_rows(x.T, order, top_k, xs, 0, num_pairs)
    else:
        _gather(x.T, order, top_k, xs)
    if len(few):
        _few_token_products(xs, w_gate_up, few, expert_start, gate_up)
    _many_token_products(xs, w_gate_up, many, gate_up)
    _activate(gate_up, act, activation == "gelu_tanh")
    if len(few):
        _few_token_products(act, w_down, few, expert_start, ys)
    _many_token_products(act, w_down, many, ys)
    if serial:
        _combine_features(ys, column, expert_weights, out, 0, hidden)
    else:
        _combine(ys, column, expert_weights, out)
