"""The numba backend's reading of K or V from a cache of any kv_cache_dtype (the format is
vllmlite/kernels/kv_dtype.py's), for the attention kernels to call a block (or the part of one they
need) at a time: packed values are widened into a block of scratch that stays in L1, never into a
copy of the cache, so a smaller cache is also fewer bytes read. (The decode kernel's int8 products
widen in registers instead, block_products.py; prefill tiles and the 16-bit kinds come here.)
Knows nothing of attention.

The kinds reach the kernels as arrays whose dtype says how to widen them (`cache_arrays`): a plain
float cache as itself, int8 with its scales, bf16 as uint16 bits, fp16 as int16 bits (numba has
no float16, and the two 16-bit kinds widen differently). Widening is exact, as kv_dtype.decode's.

Numba's disk cache keys a kernel on its own file only: after editing this one, delete the cached
attention kernels (vllmlite/kernels/numba/__pycache__/attention.*.nb*) or they keep the old code.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

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
    last axis: [num_slots, num_kv_heads, head_dim]."""
    return np.empty((num_slots, num_kv_heads, like.shape[-1]), like.dtype)


@intrinsic
def _prefetch(typingctx, array, index):
    """Asks the CPU to bring the cache line holding array's element `index` (counted over the
    whole array, C order) into its caches, and goes on: LLVM's llvm.prefetch (x86 prefetcht0)."""
    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fn = builder.module.declare_intrinsic("llvm.prefetch.p0", fnty=ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]))
        address = builder.bitcast(builder.gep(data, [args[1]]), i8p)
        builder.call(fn, [address, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])   # read, keep, data
        return context.get_dummy_value()
    return types.void(array, index), codegen


@serial
def prefetch_block(data, scales, first, num):  # pragma: no cover - compiled
    """Starts bringing data[first:first + num] (and its scales) into the caches, for `load_block`
    to read a block later. A paged cache's blocks lie anywhere, so the CPU's own prefetcher, which
    follows a stream, stops at each block's end: attention over 32 x 513 keys in shuffled blocks
    took 1.19 ms a layer with int8 K/V against 0.86 in contiguous ones."""
    slot = data.shape[1] * data.shape[2]
    for i in range(first * slot, (first + num) * slot, 64 // data.itemsize):
        _prefetch(data, i)
    if scales is not None:
        slot = scales.shape[1] * scales.shape[2]
        for i in range(first * slot, (first + num) * slot, 64 // scales.itemsize):
            _prefetch(scales, i)


def load_block(data, scales, first, num, scratch):
    """data[first:first + num] widened: [num, num_kv_heads, head_dim] in scratch's dtype; a plain
    cache's own slots, unwidened. The slots of one block are contiguous, so they widen as one run
    of vectors (`_widen_lanes`). Compiled only (the overload below); scratch is `block_scratch`'s."""
    raise NotImplementedError("compiled only")


def _plain(data, scales, first, num, scratch):  # pragma: no cover - compiled
    return data[first:first + num]


LANES = 16   # values a widening handles at once: an int8 group (kv_dtype.INT8_GROUP), an AVX-512 register of float32


@intrinsic
def _widen_lanes(typingctx, values, index, scale, out):
    """out[index:index + LANES] = values[index:index + LANES] widened as vectors: a load, the
    widening of values' storage dtype (int8: sign extension and conversion, then a float32 product
    with the scale in every lane, as kv_dtype.decode; bf16's bits (uint16) put on top of 16 zero
    bits; fp16's bits (int16) converted by the CPU's half-to-float instruction, exact for every
    half, subnormals and infinities included), then out's dtype, one store. The scalar loops these
    replace compiled to scalar code, or to vectors whose setup outweighed a group of 16."""
    def codegen(context, builder, signature, args):
        source = context.make_array(signature.args[0])(context, builder, args[0]).data
        target = context.make_array(signature.args[3])(context, builder, args[3]).data
        storage, lane_type = signature.args[0].dtype, context.get_value_type(signature.args[3].dtype)
        ints = ir.VectorType(ir.IntType(32), LANES)
        floats = ir.VectorType(ir.FloatType(), LANES)
        stored = ir.VectorType(ir.IntType(storage.bitwidth), LANES)
        packed = builder.load(builder.bitcast(builder.gep(source, [args[1]]), stored.as_pointer()), align=1)
        if storage == types.int8:
            lane = builder.insert_element(ir.Constant(floats, ir.Undefined), args[2], ir.Constant(ir.IntType(32), 0))
            splat = builder.shuffle_vector(lane, lane, ir.Constant(ints, [0] * LANES))
            widened = builder.fmul(builder.sitofp(builder.sext(packed, ints), floats), splat)
        elif storage == types.uint16:
            widened = builder.bitcast(builder.shl(builder.zext(packed, ints), ir.Constant(ints, [16] * LANES)), floats)
        else:
            widened = builder.fpext(builder.bitcast(packed, ir.VectorType(ir.HalfType(), LANES)), floats)
        if lane_type != ir.FloatType():
            widened = builder.fpext(widened, ir.VectorType(lane_type, LANES))
        builder.store(widened, builder.bitcast(builder.gep(target, [args[1]]), widened.type.as_pointer()), align=4)
        return context.get_dummy_value()
    return types.void(values, index, types.float32, out), codegen


def _int8(data, scales, first, num, scratch):  # pragma: no cover - compiled
    """A group of INT8_GROUP values as one vector (`_widen_lanes`); a whole head's group (a
    head_dim no multiple of it) in a loop. In float32, as kv_dtype.decode."""
    out = scratch[:num]
    values, group_scales, flat = data[first:first + num].ravel(), scales[first:first + num].ravel(), out.ravel()
    group = data.shape[2] // scales.shape[2]   # per slot: no division by zero when num is 0
    if group == LANES:
        for g in range(group_scales.shape[0]):
            _widen_lanes(values, g * LANES, group_scales[g], flat)
        return out
    for g in range(group_scales.shape[0]):
        scale = group_scales[g]
        for i in range(g * group, g * group + group):
            flat[i] = np.float32(values[i]) * scale
    return out


def _halves(data, scales, first, num, scratch):  # pragma: no cover - compiled
    """bf16 or fp16 (values' dtype says which), LANES at a time (`_widen_lanes`), the rest one by
    one as the scalar `_half`."""
    out = scratch[:num]
    values, flat = data[first:first + num].ravel(), out.ravel()
    whole = values.shape[0] - values.shape[0] % LANES
    for i in range(0, whole, LANES):
        _widen_lanes(values, i, np.float32(1), flat)
    for i in range(whole, values.shape[0]):
        flat[i] = _half(values[i])
    return out


@intrinsic
def _float_of_bits(typingctx, bits):
    """The float32 whose bits are the uint32 `bits`."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


def _half(bits):
    raise NotImplementedError("compiled only")


@overload(_half, jit_options={"fastmath": {"contract", "arcp"}})
def _half_overload(bits):
    """One bf16 (uint16 bits) or fp16 (int16 bits) value as float32. fp16: exponent and mantissa
    moved to float32's places, then scaled by 2^112 in float arithmetic, which rebiases normals
    and makes subnormals normal, exactly; then inf and NaN (exponent all ones) and the sign."""
    if bits == types.uint16:
        def bf16(bits):  # pragma: no cover - compiled
            return _float_of_bits(np.uint32(bits) << np.uint32(16))
        return bf16

    def fp16(bits):  # pragma: no cover - compiled
        half = np.uint16(bits)
        x = _float_of_bits(np.uint32(half & np.uint16(0x7FFF)) << np.uint32(13)) * _FP16_RESCALE
        if half & np.uint16(0x7C00) == np.uint16(0x7C00):
            x = np.float32(np.inf) if half & np.uint16(0x3FF) == 0 else np.float32(np.nan)
        return -x if half & np.uint16(0x8000) else x
    return fp16


@overload(load_block, jit_options={"fastmath": {"contract", "arcp"}})   # no "nsz": fp16's -0 stays -0
def _load_block(data, scales, first, num, scratch):
    """The widening for data's dtype (module docstring)."""
    kind = data.dtype
    if isinstance(kind, types.Float):
        return _plain
    return _int8 if kind == types.int8 else _halves
