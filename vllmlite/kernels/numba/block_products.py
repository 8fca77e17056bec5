"""The numba decode kernel's products of one KV head's query heads with a block of keys: the
scores q . k of each key, and the sum of the values weighted by those scores. float32 contiguous
blocks go KEYS keys at a time through the explicit vectors of key_products.py; the rest (a
partial run, a head_dim no multiple of LANES, float64, a strided view) through plain loops.
An int8 cache's blocks are read in place, unwidened (`reads_packed`, `packed_scores`,
`packed_values`), when head_dim is whole groups of LANES.
Knows nothing of caches, block tables or softmax (attention.py).
Numba's disk cache keys a kernel on its own file only: after editing this one, delete the cached
attention kernels (vllmlite/kernels/numba/__pycache__/attention.*.nb*).
"""

from __future__ import annotations

import numpy as np
from numba import types
from numba.extending import overload

from vllmlite.kernels.numba import key_products as products
from vllmlite.kernels.numba.byte_dots import ISA
from vllmlite.kernels.numba.jit import FASTMATH, serial
from vllmlite.kernels.numba.key_products import (
    INT8_HEADS,
    INT8_SCORE_KEYS,
    KEYS,
    LANES,
    QUAD,
    VNNI_SCORE_KEYS,
    add_weighted_values,
    dot_keys,
)


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


def reads_packed(q, data):
    """Whether `packed_scores` and `packed_values` read this cache's data (kv_read.cache_arrays's)
    in place for queries like q: int8 whose head_dim is whole groups of LANES, each with its scale,
    and float32 queries. Others are widened a block at a time (kv_read.load_block) for block_scores
    and block_values."""
    raise NotImplementedError("compiled only")


def packed_scores(qs, words, q_scales, data, scales, slot, num, kv, group, scores, t0):
    """scores[h, t0 + j] = qs[h] . key slot + j of an int8 cache, for KV head kv's query heads h
    and j < num (the run of slots of one block): passes of up to INT8_HEADS heads, each widening
    INT8_SCORE_KEYS keys in registers for all its heads (key_products.py), or with `integer_queries`'
    (words, q_scales) not empty taking VNNI_SCORE_KEYS keys' products as integers, then the rest of
    the run in loops. Where `reads_packed` is false it is never called, and does nothing."""
    raise NotImplementedError("compiled only")


def packed_values(scores, data, scales, slot, num, kv, group, acc, t0):
    """acc[h] += scores[h, t0 + j] * value slot + j of an int8 cache, for KV head kv's query heads
    h and j < num; as `packed_scores`, KEYS values a call."""
    raise NotImplementedError("compiled only")


@serial
def _pass_heads(remaining):  # pragma: no cover - compiled
    """Heads the next pass takes of the `remaining` of a group: INT8_HEADS or fewer, 4 as 2 + 2."""
    return 2 if remaining == 2 or remaining == 4 else min(remaining, INT8_HEADS)


@serial
def _packed_offsets(data, slot, kv):  # pragma: no cover - compiled
    """(element offset of slot's KV head kv in data, of its first scale, elements from one slot to
    the next, scales from one slot to the next, groups a head)."""
    num_kv_heads, head_dim = data.shape[1], data.shape[2]
    chunks = head_dim // LANES
    return ((slot * num_kv_heads + kv) * head_dim, (slot * num_kv_heads + kv) * chunks, num_kv_heads * head_dim,
            num_kv_heads * chunks, chunks)


@serial
def _int8_at(data, scales, slot, kv, d):  # pragma: no cover - compiled
    """Element d of slot's KV head kv in an int8 cache, widened as kv_dtype.decode does."""
    return np.float32(data[slot, kv, d]) * scales[slot, kv, d // LANES]


def _int8_scores(qs, words, q_scales, data, scales, slot, num, kv, group, scores, t0):  # pragma: no cover
    head_dim, row = data.shape[2], scores.shape[1]
    integer = words.shape[0] > 0
    h, end = kv * group, (kv + 1) * group
    while h < end:
        heads = _pass_heads(end - h)
        keys = KEYS if heads == 1 else VNNI_SCORE_KEYS if integer else INT8_SCORE_KEYS
        j = 0
        while j + keys <= num:
            offset, scale_offset, stride, scale_stride, chunks = _packed_offsets(data, slot + j, kv)
            if integer:
                words_args = (words, h * head_dim // 2, q_scales, data, scales, offset, stride, scale_offset,
                              scale_stride, head_dim // QUAD, scores, h * row + t0 + j, row)
                if heads == 3:
                    products.vnni_dot_keys_3(*words_args)
                elif heads == 2:
                    products.vnni_dot_keys_2(*words_args)
                else:
                    products.vnni_dot_keys_1(*words_args)
            else:
                args = (qs, h * head_dim, data, scales, offset, stride, scale_offset, scale_stride, chunks, scores,
                        h * row + t0 + j, row)
                if heads == 3:
                    products.int8_dot_keys_3(*args)
                elif heads == 2:
                    products.int8_dot_keys_2(*args)
                else:
                    products.int8_dot_keys_1(*args)
            j += keys
        for k in range(j, num):
            for hh in range(h, h + heads):
                dot = qs.dtype.type(0)
                for d in range(head_dim):
                    dot += qs[hh, d] * _int8_at(data, scales, slot + k, kv, d)
                scores[hh, t0 + k] = dot
        h += heads


def _int8_values(scores, data, scales, slot, num, kv, group, acc, t0):  # pragma: no cover - compiled
    head_dim, row = data.shape[2], scores.shape[1]
    h, end = kv * group, (kv + 1) * group
    while h < end:
        heads = _pass_heads(end - h)
        j = 0
        while j + KEYS <= num:
            offset, scale_offset, stride, scale_stride, chunks = _packed_offsets(data, slot + j, kv)
            args = (scores, h * row + t0 + j, row, data, scales, offset, stride, scale_offset, scale_stride, chunks,
                    acc, h * head_dim)
            if heads == 3:
                products.int8_add_values_3(*args)
            elif heads == 2:
                products.int8_add_values_2(*args)
            else:
                products.int8_add_values_1(*args)
            j += KEYS
        for k in range(j, num):
            for hh in range(h, h + heads):
                p = scores[hh, t0 + k]
                for d in range(head_dim):
                    acc[hh, d] += p * _int8_at(data, scales, slot + k, kv, d)
        h += heads


def _no_scores(qs, words, q_scales, data, scales, slot, num, kv, group, scores, t0):  # pragma: no cover - compiled
    pass


def _no_values(scores, data, scales, slot, num, kv, group, acc, t0):  # pragma: no cover - compiled
    pass


def _packed(q, data):
    return q.dtype == types.float32 and data.dtype == types.int8


@overload(reads_packed)
def _reads_packed_overload(q, data):
    if _packed(q, data):
        return lambda q, data: data.shape[2] % LANES == 0
    return lambda q, data: False


@overload(packed_scores, jit_options={"fastmath": FASTMATH})
def _packed_scores_overload(qs, words, q_scales, data, scales, slot, num, kv, group, scores, t0):
    return _int8_scores if _packed(qs, data) else _no_scores


@overload(packed_values, jit_options={"fastmath": FASTMATH})
def _packed_values_overload(scores, data, scales, slot, num, kv, group, acc, t0):
    return _int8_values if _packed(scores, data) else _no_values


# Integer scores (key_products.py's VNNI products) where the CPU has AVX-512 VNNI.
INTEGER_SCORES = ISA == "vnni"


def integer_queries(rounding, row, scale):
    """For `packed_scores`, of query `row` of rounding (None, or the queries' kv_dtype.round_queries
    integers [tokens, heads, head_dim] int16 and scales [tokens, heads]): (its integers as key_products'
    integer products read them, each QUAD of a head as the int32 words of its even elements then of
    its odd ones, [heads * head_dim / 2]; its scales [heads] times scale), or two empty arrays where
    the scores are not taken as integers (rounding None, a CPU without VNNI, a head_dim no multiple
    of QUAD)."""
    raise NotImplementedError("compiled only")


def _integer_queries(rounding, row, scale):  # pragma: no cover - compiled
    q_ints, q_scales = rounding[0][row], rounding[1][row]
    num_heads, head_dim = q_ints.shape
    if not INTEGER_SCORES or head_dim % QUAD != 0:
        return np.empty(0, np.int32), np.empty(0, np.float32)
    halves = np.empty(num_heads * head_dim, np.int16)
    scales = np.empty(num_heads, np.float32)
    for h in range(num_heads):
        for quad in range(0, head_dim, QUAD):
            at = h * head_dim + quad
            for i in range(QUAD // 2):
                halves[at + i] = q_ints[h, quad + 2 * i]
                halves[at + QUAD // 2 + i] = q_ints[h, quad + 2 * i + 1]
        scales[h] = q_scales[h] * scale
    return halves.view(np.int32), scales


# What integer_queries gives a decode without rounding (any cache but int8): constants numba freezes
# into the kernel, so a float cache's decode allocates nothing for it.
_NO_WORDS, _NO_SCALES = np.empty(0, np.int32), np.empty(0, np.float32)


@overload(integer_queries)
def _integer_queries_overload(rounding, row, scale):
    if isinstance(rounding, types.NoneType):
        return lambda rounding, row, scale: (_NO_WORDS, _NO_SCALES)
    return _integer_queries
