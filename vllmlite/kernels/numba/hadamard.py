"""The numba backend's turn of int8 K/V and of the queries that read them: x @ kv_dtype.rotation(head_dim)
for every (token, head) row of x, as butterflies (a fast Walsh-Hadamard transform), the sums and
differences in kv_dtype.turn's order, so both backends store the same int8 bytes.

A row's butterflies of steps 1, 2 and 4 pair lanes of one 8-element vector: here two shuffles, a
sum, a difference and a blend a vector per step, as each vector comes in (`_turn_vectors`, LLVM IR),
where plain numba loops ran them one element at a time; the later steps pair whole vectors. The
288 query rows of a 32-sequence decode step of the default model (9 heads of 64), 2-core AVX2
EPYC: 16 us so, 35-57 us as one BLAS product with the matrix, 187 us as element-wise numba loops,
73 us with 8 rows side by side in the lanes (the transposes in and out cost what the butterflies
saved); results/kv_turn_butterflies.json.
Numba's disk cache keys a kernel on its own file only: after editing this one, delete the cached
kernels of the modules that call it (elementwise.py, attention.py).
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from vllmlite.kernels.numba.jit import exact

VECTOR = 8            # elements of a vector the in-register steps work on (steps 1, 2, 4)
_INDEX = ir.IntType(64)
_MASK = ir.IntType(32)


def _in_vector_step(builder, vector, step):
    """One butterfly step within a vector: lane i with bit `step` clear gets x[i] + x[i + step], the
    other x[i - step] - x[i] (kv_dtype.turn's a + b and a - b)."""
    masks = ir.VectorType(_MASK, VECTOR)
    low = builder.shuffle_vector(vector, vector, ir.Constant(masks, [i & ~step for i in range(VECTOR)]))
    high = builder.shuffle_vector(vector, vector, ir.Constant(masks, [i | step for i in range(VECTOR)]))
    sums, differences = builder.fadd(low, high), builder.fsub(low, high)
    return builder.shuffle_vector(sums, differences,
                                  ir.Constant(masks, [i + VECTOR if i & step else i for i in range(VECTOR)]))


def _pointer(context, builder, array_type, array, offset, vector_type):
    """A pointer to the vector at element `offset` of the array's data (any layout: the caller's offset)."""
    data = context.make_array(array_type)(context, builder, array).data
    return builder.bitcast(builder.gep(data, [offset]), vector_type.as_pointer())


@intrinsic
def _turn_vectors(typingctx, src, src_offset, dst, dst_offset, head_dim, n, scale):
    """dst[dst_offset:][:head_dim] = turn(src[src_offset:][:head_dim]) * scale for head_dim a multiple
    of VECTOR (so n >= VECTOR): steps 1, 2, 4 in registers as each vector comes in, the later steps
    over the stored vectors, pair by pair, the scale with the last step (or alone where n is VECTOR)."""
    if not (isinstance(src, types.Array) and isinstance(dst, types.Array) and src.dtype == dst.dtype
            and src.dtype in (types.float32, types.float64)):
        return None

    def codegen(context, builder, signature, args):
        src_array, src_at, dst_array, dst_at, length, blocks, factor = args
        vector_type = ir.VectorType(context.get_value_type(signature.args[0].dtype), VECTOR)
        source = _pointer(context, builder, signature.args[0], src_array, src_at, vector_type)
        target = _pointer(context, builder, signature.args[2], dst_array, dst_at, vector_type)
        splat = builder.shuffle_vector(builder.insert_element(ir.Constant(vector_type, ir.Undefined), factor,
                                                              ir.Constant(_MASK, 0)),
                                       ir.Constant(vector_type, ir.Undefined),
                                       ir.Constant(ir.VectorType(_MASK, VECTOR), [0] * VECTOR))
        vectors = builder.udiv(length, ir.Constant(_INDEX, VECTOR))
        first_block = ir.Constant(_INDEX, VECTOR)
        only_registers = builder.icmp_unsigned("==", blocks, first_block)
        with cgutils.for_range(builder, vectors) as loop:
            vector = builder.load(builder.gep(source, [loop.index]), align=1)
            for step in (1, 2, 4):
                vector = _in_vector_step(builder, vector, step)
            vector = builder.select(only_registers, builder.fmul(vector, splat), vector)
            builder.store(vector, builder.gep(target, [loop.index]), align=1)
        # steps VECTOR, 2 VECTOR, ... < n, in vectors: pair p of a step joins vectors i and i + stride
        # (stride = step / VECTOR), i = (p // stride) * 2 * stride + p % stride
        stride_slot = cgutils.alloca_once_value(builder, ir.Constant(_INDEX, 1))
        condition = builder.append_basic_block("steps")
        body = builder.append_basic_block("step")
        done = builder.append_basic_block("steps_done")
        builder.branch(condition)
        builder.position_at_end(condition)
        stride = builder.load(stride_slot)
        step = builder.mul(stride, first_block)
        builder.cbranch(builder.icmp_unsigned("<", step, blocks), body, done)
        builder.position_at_end(body)
        last = builder.icmp_unsigned("==", builder.mul(step, ir.Constant(_INDEX, 2)), blocks)
        with cgutils.for_range(builder, builder.udiv(vectors, ir.Constant(_INDEX, 2))) as loop:
            i = builder.add(builder.mul(builder.udiv(loop.index, stride), builder.mul(stride, ir.Constant(_INDEX, 2))),
                            builder.urem(loop.index, stride))
            a_pointer, b_pointer = builder.gep(target, [i]), builder.gep(target, [builder.add(i, stride)])
            a, b = builder.load(a_pointer, align=1), builder.load(b_pointer, align=1)
            total, difference = builder.fadd(a, b), builder.fsub(a, b)
            builder.store(builder.select(last, builder.fmul(total, splat), total), a_pointer, align=1)
            builder.store(builder.select(last, builder.fmul(difference, splat), difference), b_pointer, align=1)
        builder.store(builder.mul(stride, ir.Constant(_INDEX, 2)), stride_slot)
        builder.branch(condition)
        builder.position_at_end(done)
        return context.get_dummy_value()

    return types.void(src, src_offset, dst, dst_offset, head_dim, n, scale), codegen


@exact
def _turn_row(row, n):  # pragma: no cover - compiled
    """row @ the unscaled Hadamard blocks of n, element by element (head_dims that are no multiple
    of VECTOR): steps 1, 2, 4, ..., n / 2, each pairing j and j + step within blocks of 2 * step."""
    head_dim, step = row.shape[0], 1
    while step < n:
        for base in range(0, head_dim, 2 * step):
            for j in range(base, base + step):
                a, b = row[j], row[j + step]
                row[j] = a + b
                row[j + step] = a - b
        step *= 2


@exact
def _turn_heads(x, out, n, scale):  # pragma: no cover - compiled
    """out[t, h] = turn(x[t, h]) * scale for x, out [tokens, heads, head_dim] (unit stride along
    head_dim, any other strides; out may be x)."""
    num_tokens, num_heads, head_dim = x.shape
    if head_dim % VECTOR == 0:
        x_strides = (x.strides[0] // x.itemsize, x.strides[1] // x.itemsize)
        out_strides = (out.strides[0] // out.itemsize, out.strides[1] // out.itemsize)
        for t in range(num_tokens):
            for h in range(num_heads):
                _turn_vectors(x, t * x_strides[0] + h * x_strides[1], out, t * out_strides[0] + h * out_strides[1],
                              head_dim, n, scale)
        return
    row = np.empty(head_dim, x.dtype)
    for t in range(num_tokens):
        for h in range(num_heads):
            for d in range(head_dim):
                row[d] = x[t, h, d]
            _turn_row(row, n)
            for d in range(head_dim):
                out[t, h, d] = row[d] * scale


def turn_heads(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """x [tokens, heads, head_dim] @ kv_dtype.rotation(head_dim), bit for bit kv_dtype.turn(x), into
    out (unit stride along head_dim; may be x) or, if None, a new C-contiguous array. An x without
    unit stride along head_dim (the workspace's feature-major views) is copied to one first and
    turned there: the vector path reads rows of head_dim."""
    if x.size == 0:   # (numpy gives an empty array zero strides)
        return np.empty(x.shape, x.dtype) if out is None else out
    if x.strides[-1] != x.itemsize:
        x = np.ascontiguousarray(x)
        out = x if out is None else out
    out = np.empty(x.shape, x.dtype) if out is None else out
    if out.strides[-1] != out.itemsize:
        raise ValueError("turn_heads writes rows of head_dim with unit stride")
    n = x.shape[-1] & -x.shape[-1]
    _turn_heads(x, out, n, x.dtype.type(1 / math.sqrt(n)))
    return out
