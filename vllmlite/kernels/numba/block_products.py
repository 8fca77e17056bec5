"""The numba decode kernel's products of one KV head's query heads with a block of keys: the
scores q . k of each key, and the sum of the values weighted by those scores. float32 contiguous
blocks go KEYS keys at a time through the explicit vectors of key_products.py; the rest (a
partial run, a head_dim no multiple of LANES, float64, a strided view) through plain loops.
Knows nothing of caches, block tables or softmax (attention.py).
Numba's disk cache keys a kernel on its own file only: after editing this one, delete the cached
attention kernels (vllmlite/kernels/numba/__pycache__/attention.*.nb*).
"""

from __future__ import annotations

from numba import types
from numba.extending import overload

from vllmlite.kernels.numba.jit import FASTMATH, serial
from vllmlite.kernels.numba.key_products import KEYS, LANES, add_weighted_values, dot_keys


@serial
def _block_scores(qs, keys, kv, group, scores, t0):  # pragma: no cover - compiled
    """scores[h, t0 + j] = qs[h] . keys[j, kv] for KV head kv's query heads h: four keys to a loop
    over head_dim, so each query element loaded serves four products (a third less time than one)."""
    num_keys, head_dim = keys.shape[0], qs.shape[1]
    j = 0
    while j < num_keys:
        if j + 4 <= num_keys:
            k0, k1, k2, k3 = keys[j, kv], keys[j + 1, kv], keys[j + 2, kv], keys[j + 3, kv]
            for h in range(kv * group, (kv + 1) * group):
                d0 = d1 = d2 = d3 = qs.dtype.type(0)
                for d in range(head_dim):   # from 0: a trip count of head_dim - 1 halved the speed
                    d0 += qs[h, d] * k0[d]
                    d1 += qs[h, d] * k1[d]
                    d2 += qs[h, d] * k2[d]
                    d3 += qs[h, d] * k3[d]
                scores[h, t0 + j], scores[h, t0 + j + 1], scores[h, t0 + j + 2], scores[h, t0 + j + 3] = d0, d1, d2, d3
            j += 4
        else:
            for h in range(kv * group, (kv + 1) * group):
                dot = qs.dtype.type(0)
                for d in range(head_dim):
                    dot += qs[h, d] * keys[j, kv, d]
                scores[h, t0 + j] = dot
            j += 1


@serial
def _block_values(scores, values, kv, group, acc, t0):  # pragma: no cover - compiled
    """acc[h] += scores[h, t0 + j] * values[j, kv] for KV head kv's query heads h, four values to a
    pass over acc[h] (a quarter of its loads and stores)."""
    num_keys, head_dim = values.shape[0], acc.shape[1]
    j = 0
    while j < num_keys:
        if j + 4 <= num_keys:
            v0, v1, v2, v3 = values[j, kv], values[j + 1, kv], values[j + 2, kv], values[j + 3, kv]
            for h in range(kv * group, (kv + 1) * group):
                p0, p1, p2, p3 = scores[h, t0 + j], scores[h, t0 + j + 1], scores[h, t0 + j + 2], scores[h, t0 + j + 3]
                for d in range(head_dim):
                    acc[h, d] += p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d]
            j += 4
        else:
            for h in range(kv * group, (kv + 1) * group):
                for d in range(head_dim):
                    acc[h, d] += scores[h, t0 + j] * values[j, kv, d]
            j += 1


def block_scores(qs, keys, kv, group, scores, t0):
    """scores[h, t0 + j] = qs[h] . keys[j, kv] for KV head kv's query heads h. Compiled only (the
    overload below): float32 KEYS keys at a time as explicit vectors (key_products.py), the rest
    (a partial run, a head_dim no multiple of LANES, float64) in `_block_scores`' loops."""
    raise NotImplementedError("compiled only")


def block_values(scores, values, kv, group, acc, t0):
    """acc[h] += scores[h, t0 + j] * values[j, kv] for KV head kv's query heads h; as `block_scores`."""
    raise NotImplementedError("compiled only")


@serial
def _contiguous(rows):  # pragma: no cover - compiled
    """Whether rows [num, num_kv_heads, head_dim] lie as one C-ordered run, as key_products reads
    them (a cache's slots, load_block's scratch), and head_dim fills whole vectors."""
    itemsize = rows.itemsize
    return (rows.shape[2] % LANES == 0 and rows.strides[2] == itemsize and rows.strides[1] == rows.shape[2] * itemsize
            and rows.strides[0] == rows.shape[1] * rows.strides[1])


def _vector_scores(qs, keys, kv, group, scores, t0):  # pragma: no cover - compiled
    num_keys, num_kv_heads, head_dim = keys.shape
    whole = num_keys - num_keys % KEYS if _contiguous(keys) else 0
    for j in range(0, whole, KEYS):
        for h in range(kv * group, (kv + 1) * group):
            dot_keys(qs, h * head_dim, keys, (j * num_kv_heads + kv) * head_dim, num_kv_heads * head_dim,
                     head_dim // LANES, scores, h * scores.shape[1] + t0 + j)
    if whole < num_keys:
        _block_scores(qs, keys[whole:], kv, group, scores, t0 + whole)


def _vector_values(scores, values, kv, group, acc, t0):  # pragma: no cover - compiled
    num_keys, num_kv_heads, head_dim = values.shape
    whole = num_keys - num_keys % KEYS if _contiguous(values) else 0
    for j in range(0, whole, KEYS):
        for h in range(kv * group, (kv + 1) * group):
            add_weighted_values(scores, h * scores.shape[1] + t0 + j, values, (j * num_kv_heads + kv) * head_dim,
                                num_kv_heads * head_dim, head_dim // LANES, acc, h * head_dim)
    if whole < num_keys:
        _block_values(scores, values[whole:], kv, group, acc, t0 + whole)


def _loop_scores(qs, keys, kv, group, scores, t0):  # pragma: no cover - compiled
    _block_scores(qs, keys, kv, group, scores, t0)


def _loop_values(scores, values, kv, group, acc, t0):  # pragma: no cover - compiled
    _block_values(scores, values, kv, group, acc, t0)


@overload(block_scores, jit_options={"fastmath": FASTMATH})
def _block_scores_overload(qs, keys, kv, group, scores, t0):
    return _vector_scores if qs.dtype == keys.dtype == types.float32 else _loop_scores


@overload(block_values, jit_options={"fastmath": FASTMATH})
def _block_values_overload(scores, values, kv, group, acc, t0):
    return _vector_values if scores.dtype == values.dtype == types.float32 else _loop_values
