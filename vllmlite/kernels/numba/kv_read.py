"""The numba backend's reading of K or V from a cache of any kv_cache_dtype (the format is
vllmlite/kernels/kv_dtype.py's), for the attention kernels to call a block (or the part of one they
need) at a time: packed values are widened into a block of scratch that stays in L1, never into a
copy of the cache, so a smaller cache is also fewer bytes read. Knows nothing of attention.

The kinds reach the kernels as arrays whose dtype says how to widen them (`cache_arrays`): a plain
float cache as itself, int8 with its scales, bf16 as uint16 bits, fp16 as int16 bits (numba has
no float16, and the two 16-bit kinds widen differently). Widening is exact, as kv_dtype.decode's.

Numba's disk cache keys a kernel on its own file only: after editing this one, delete the cached
attention kernels (vllmlite/kernels/numba/__pycache__/attention.*.nb*) or they keep the old code.
"""

from __future__ import annotations

import numpy as np
from numba import types
from numba.extending import overload

from vllmlite.kernels.kv_dtype import PackedKV
from vllmlite.kernels.numba.jit import serial

_FP16_RESCALE = np.float32(2.0 ** 112)   # fp16's exponent bias 15 -> float32's 127


def cache_arrays(cache) -> tuple[np.ndarray, np.ndarray | None]:
    """(data, scales or None) of a plain or packed cache, typed as `load_block` reads them."""
    if not isinstance(cache, PackedKV):
        return cache, None
    if cache.kind == "fp16":
        return cache.data.view(np.int16), None
    return cache.data, cache.scales


@serial
def block_scratch(like, num_slots, num_kv_heads):  # pragma: no cover - compiled
    """`load_block`'s scratch for up to num_slots slots of vectors as long and of the dtype of like's
    last axis: (values [num_slots, num_kv_heads, head_dim], bits [num_slots * num_kv_heads * head_dim] uint32)."""
    head_dim = like.shape[-1]
    values = np.empty((num_slots, num_kv_heads, head_dim), like.dtype)
    return values, np.empty(num_slots * num_kv_heads * head_dim, np.uint32)


def load_block(data, scales, first, num, scratch):
    """data[first:first + num] widened: [num, num_kv_heads, head_dim] in scratch[0]'s dtype; a plain
    cache's own slots, unwidened. The slots of one block are contiguous, so each widening is one
    long loop (per-vector loops of 32 or 64 values ran at a fraction of the vector units' speed).
    Compiled only (the overload below); scratch is `block_scratch`'s."""
    raise NotImplementedError("compiled only")


def _plain(data, scales, first, num, scratch):  # pragma: no cover - compiled
    return data[first:first + num]


def _int8(data, scales, first, num, scratch):  # pragma: no cover - compiled
    """Unsigned indices, so that numba adds no wraparound of negative ones, and a group length LLVM
    does not know: a constant 32 was unrolled into scalar code, about 3x slower than this loop's vectors."""
    out = scratch[0][:num]
    values, group_scales, flat = data[first:first + num].ravel(), scales[first:first + num].ravel(), out.ravel()
    group = np.uint64(values.shape[0] // group_scales.shape[0])
    for g in range(np.uint64(group_scales.shape[0])):
        scale = group_scales[g]
        for i in range(g * group, g * group + group):
            flat[i] = np.float32(values[i]) * scale   # in float32, as kv_dtype.decode
    return out


def _bf16(data, scales, first, num, scratch):  # pragma: no cover - compiled
    out = scratch[0][:num]
    values, flat = data[first:first + num].ravel(), out.ravel()
    bits = scratch[1][:values.shape[0]]
    for i in range(values.shape[0]):
        bits[i] = np.uint32(values[i]) << np.uint32(16)
    floats = bits.view(np.float32)
    for i in range(values.shape[0]):
        flat[i] = floats[i]
    return out


def _fp16(data, scales, first, num, scratch):  # pragma: no cover - compiled
    """Exponent and mantissa moved to float32's places, then scaled by 2^112 in float arithmetic,
    which rebiases normals and makes subnormals normal, exactly; then inf and NaN (exponent all
    ones) and the sign."""
    out = scratch[0][:num]
    values, flat = data[first:first + num].ravel(), out.ravel()
    bits = scratch[1][:values.shape[0]]
    for i in range(values.shape[0]):
        bits[i] = np.uint32(np.uint16(values[i]) & np.uint16(0x7FFF)) << np.uint32(13)
    floats = bits.view(np.float32)
    for i in range(values.shape[0]):
        half = np.uint16(values[i])
        x = floats[i] * _FP16_RESCALE
        if half & np.uint16(0x7C00) == np.uint16(0x7C00):
            x = np.float32(np.inf) if half & np.uint16(0x3FF) == 0 else np.float32(np.nan)
        flat[i] = -x if half & np.uint16(0x8000) else x
    return out


@overload(load_block, jit_options={"fastmath": {"contract", "arcp"}})   # no "nsz": fp16's -0 stays -0
def _load_block(data, scales, first, num, scratch):
    """The widening for data's dtype (module docstring)."""
    kind = data.dtype
    if isinstance(kind, types.Float):
        return _plain
    return {types.int8: _int8, types.uint16: _bf16, types.int16: _fp16}[kind]
