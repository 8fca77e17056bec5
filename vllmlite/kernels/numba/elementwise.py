"""The numba backend's elementwise kernels: RMS norm (with the residual add), RoPE, SiLU- and
GELU-and-multiply and the KV-cache write. Knows nothing of matrices or attention.
"""

from __future__ import annotations

import math

import numpy as np
from numba import prange

from vllmlite.kernels import kv_dtype
from vllmlite.kernels.numba.fast_exp import exp_shifted
from vllmlite.kernels.numba.hadamard import turn_heads
from vllmlite.kernels.numba.jit import exact, parallel, serial
from vllmlite.kernels.reference import GELU_TANH_SCALE

SERIAL_MAX_TOKENS = 128  # tokens up to which SiLU and GELU run on one thread (see _act_and_mul)
PARALLEL_ROWS = 64       # feature rows of a part when they run in parallel

# The model's activations are token-major views of C-contiguous feature-major arrays (see
# model.Workspace): the wrappers below hand the elementwise kernels those arrays (x.T, [features,
# tokens]), so their inner loops walk tokens with unit stride, known to the compiler.


@serial
def _rms_norm(xt, weight, eps, out_t):  # pragma: no cover - compiled
    hidden, num_tokens = xt.shape
    total = np.zeros(num_tokens, dtype=xt.dtype)
    for j in range(hidden):
        for i in range(num_tokens):
            total[i] += xt[j, i] * xt[j, i]
    for i in range(num_tokens):
        total[i] = 1 / math.sqrt(total[i] / hidden + eps)
    for j in range(hidden):
        for i in range(num_tokens):
            out_t[j, i] = xt[j, i] * total[i] * weight[j]


@serial
def _add_rms_norm(xt, residual_t, weight, eps, out_t):  # pragma: no cover - compiled
    hidden, num_tokens = xt.shape
    for j in range(hidden):
        for i in range(num_tokens):
            residual_t[j, i] += xt[j, i]
    _rms_norm(residual_t, weight, eps, out_t)


@serial
def _rope(x, positions, cos, sin):  # pragma: no cover - compiled
    num_tokens, num_heads, head_dim = x.shape
    half = head_dim // 2
    for h in range(num_heads):
        for j in range(half):
            for i in range(num_tokens):
                x1, x2 = x[i, h, j], x[i, h, j + half]
                c, s = cos[positions[i], j], sin[positions[i], j]
                x[i, h, j] = x1 * c - x2 * s
                x[i, h, j + half] = x2 * c + x1 * s


@serial
def _act_and_mul_rows(gate_up_t, out_t, first, last, gelu):  # pragma: no cover - compiled
    """g * sigmoid(z) * up, z = g (SiLU) or, with `gelu`, 2 sqrt(2 / pi) (g + 0.044715 g^3)
    (gelu_tanh(g) = 0.5 g (1 + tanh(z / 2)) = g * sigmoid(z)); the sigmoid from e = exp(-|z|) <= 1
    (no overflow): 1 / (1 + e) for z >= 0, e / (1 + e) below. e for all the rows first .. last - 1
    in one exp_shifted call, whose loops vectorize over that many values (over one row's few
    tokens they ran scalar, as math.tanh did for GELU). Rows are counted from 0 here: with e indexed
    by (j - first) * num_tokens + i, j from first, LLVM kept a check for negative indices and left
    these loops scalar (about 2.5x slower)."""
    inter, num_tokens = out_t.shape
    dtype = out_t.dtype.type   # constants in the arrays' dtype: float32 stays float32
    scale, cubic = dtype(2 * GELU_TANH_SCALE), dtype(0.044715)
    rows = last - first
    e = np.empty(rows * num_tokens, out_t.dtype)      # [rows * num_tokens] exp(-|z|), row by row
    for j in range(rows):
        for i in range(num_tokens):
            g = gate_up_t[first + j, i]
            e[j * num_tokens + i] = -abs(scale * (g + cubic * g * g * g) if gelu else g)
    # z has g's sign (GELU's z is g times a positive factor): the select below tests g.
    exp_shifted(e, dtype(0), rows * num_tokens, np.empty(rows * num_tokens, np.int32))
    for j in range(rows):
        for i in range(num_tokens):
            g, ei = gate_up_t[first + j, i], e[j * num_tokens + i]
            out_t[first + j, i] = g * ((dtype(1) if g >= 0 else ei) / (dtype(1) + ei)) * gate_up_t[first + j + inter, i]


@parallel
def _act_and_mul(gate_up_t, out_t, gelu):  # pragma: no cover - compiled
    """On one thread up to SERIAL_MAX_TOKENS tokens (the branch that never reaches the prange wakes
    no thread; one compiled function serves both, so the engine's warm-up compiles it): waking the
    other threads cost more than the work. SiLU at the default model's 1,536 features, 2-core
    EPYC: 21 us on one thread against 64 in parallel at 32 tokens, 93 against 117 at 128, 178
    against 158 at 256."""
    inter, num_tokens = out_t.shape
    if num_tokens <= SERIAL_MAX_TOKENS:
        _act_and_mul_rows(gate_up_t, out_t, 0, inter, gelu)
        return
    for part in prange((inter + PARALLEL_ROWS - 1) // PARALLEL_ROWS):
        _act_and_mul_rows(gate_up_t, out_t, part * PARALLEL_ROWS, min(inter, part * PARALLEL_ROWS + PARALLEL_ROWS),
                          gelu)


@serial
def _write_kv(k_cache, v_cache, k, v, slot_mapping):  # pragma: no cover - compiled
    num_tokens, num_kv_heads, head_dim = k.shape
    for i in range(num_tokens):
        slot = slot_mapping[i]
        for h in range(num_kv_heads):
            for d in range(head_dim):
                k_cache[slot, h, d] = k[i, h, d]
                v_cache[slot, h, d] = v[i, h, d]


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray) -> None:
    _rms_norm(x.T, weight, eps, out.T)


def add_rms_norm(x: np.ndarray, residual: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray) -> None:
    _add_rms_norm(x.T, residual.T, weight, eps, out.T)


def rope(x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> None:
    _rope(x, positions, cos, sin)


def silu_and_mul(gate_up: np.ndarray, out: np.ndarray) -> None:
    _act_and_mul(gate_up.T, out.T, False)


def gelu_tanh_and_mul(gate_up: np.ndarray, out: np.ndarray) -> None:
    """As silu_and_mul, with reference.gelu_tanh_and_mul's activation."""
    _act_and_mul(gate_up.T, out.T, True)


@exact
def _write_int8(data, scales, x, slot_mapping):  # pragma: no cover - compiled
    """kv_dtype.encode("int8", x) into data[slot_mapping], scales[slot_mapping], bit for bit: the same
    float32 divisions (no fast-math), rint's ties to even, the clip to +-INT8_MAX."""
    num_tokens, num_kv_heads, head_dim = x.shape
    num_groups = scales.shape[2]
    group = head_dim // num_groups
    for i in range(num_tokens):
        slot = slot_mapping[i]
        for h in range(num_kv_heads):
            for g in range(num_groups):
                top = np.float32(0)
                for d in range(g * group, (g + 1) * group):
                    top = max(top, abs(np.float32(x[i, h, d])))
                scale = top / np.float32(kv_dtype.INT8_MAX)
                scales[slot, h, g] = scale
                safe = scale if scale > 0 else np.float32(1)
                for d in range(g * group, (g + 1) * group):
                    level = np.rint(np.float32(x[i, h, d]) / safe)
                    data[slot, h, d] = np.int8(min(max(level, -kv_dtype.INT8_MAX), kv_dtype.INT8_MAX))


@exact
def _round_queries(q, ints, scales, rounded):  # pragma: no cover - compiled
    """kv_dtype.round_queries and rounded_queries bit for bit (no fast-math: the same float32 products)."""
    num_tokens, num_heads, head_dim = q.shape
    for i in range(num_tokens):
        for h in range(num_heads):
            top = np.float32(0)
            for d in range(head_dim):
                top = max(top, abs(np.float32(q[i, h, d])))
            scale = top / np.float32(kv_dtype.QUERY_MAX)
            scales[i, h] = scale
            inverse = np.float32(kv_dtype.QUERY_MAX) / (top if top > 0 else np.float32(kv_dtype.QUERY_MAX))
            for d in range(head_dim):
                level = np.rint(np.float32(q[i, h, d]) * inverse)
                ints[i, h, d] = np.int16(min(max(level, -kv_dtype.QUERY_MAX), kv_dtype.QUERY_MAX))
                rounded[i, h, d] = np.float32(ints[i, h, d]) * scale


def round_queries(q: np.ndarray) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """q [tokens, heads, head_dim] -> (kv_dtype.rounded_queries(q), kv_dtype.round_queries(q)), compiled."""
    ints, scales, rounded = np.empty(q.shape, np.int16), np.empty(q.shape[:2], np.float32), np.empty_like(q)
    _round_queries(q, ints, scales, rounded)
    return rounded, (ints, scales)


def write_kv(k_cache: np.ndarray, v_cache: np.ndarray, k: np.ndarray, v: np.ndarray,
             slot_mapping: np.ndarray, unturned: bool = False) -> None:
    """kv_dtype.storing's write, compiled for int8: K/V turned (hadamard.py), then encoded (numpy's
    encoding took ~5 ms a decode step); the halves in numpy. unturned=True as storing's."""
    if isinstance(k_cache, kv_dtype.PackedKV):
        if k_cache.kind == "int8":
            if kv_dtype.turned(k_cache) and not unturned:
                k, v = turn_heads(k), turn_heads(v)
            _write_int8(k_cache.data, k_cache.scales, k, slot_mapping)
            _write_int8(v_cache.data, v_cache.scales, v, slot_mapping)
        else:
            kv_dtype.write(k_cache, v_cache, k, v, slot_mapping)
        return
    _write_kv(k_cache, v_cache, k, v, slot_mapping)
