"""The numba backend's products of one query head with KEYS keys at a time, written as explicit
vectors for the decode kernel (attention.py, through block_products.py): the scores q . k of KEYS
keys, and the sum of KEYS values weighted by their probabilities. Knows nothing of caches or softmax.

Loops of plain numba left these to LLVM, which reduced each dot product's vector to a number on
its own (eight instructions per key, more than its multiply-adds) and reloaded the accumulators
of the weighted sum between keys. Here the KEYS dot products end in one transposing sum that
leaves score j in lane j (45 shuffles and adds for 16 keys instead of 128), and the weighted sum
keeps each 16-value chunk of its output in a register while all KEYS values are added to it.

Vectors are float32, LANES wide (an AVX-512 register; LLVM splits them on AVX2). Each array is
addressed from its first element by an element offset the caller computes, as if it were flat
and C-contiguous: the caller makes sure that it is (block_products.py's `_contiguous`); nothing here
checks.
Numba's disk cache keys a kernel on its own file only: after editing this one, delete the cached
attention kernels (vllmlite/kernels/numba/__pycache__/attention.*.nb*).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

LANES = 16   # float32 values in a vector
KEYS = 16    # keys a call handles: one vector of scores

_FLOAT = ir.FloatType()
_VECTOR = ir.VectorType(_FLOAT, LANES)
_INDEX = ir.IntType(64)
_MASK = ir.IntType(32)


def _floats(*arrays):
    """Whether these are all float32 arrays (the only kind these products take)."""
    return all(isinstance(a, types.Array) and a.dtype == types.float32 for a in arrays)


def _pointer(context, builder, array_type, array):
    return context.make_array(array_type)(context, builder, array).data


def _vector_at(builder, base, offset):
    """A pointer to the LANES floats at base[offset], for an unaligned vector load or store."""
    return builder.bitcast(builder.gep(base, [offset]), _VECTOR.as_pointer())


def _fma(builder, a, b, c):
    """a * b + c in each lane, rounded once (llvm.fma: a vfmadd instruction)."""
    fma = builder.module.declare_intrinsic(f"llvm.fma.v{LANES}f32", fnty=ir.FunctionType(_VECTOR, [_VECTOR] * 3))
    return builder.call(fma, [a, b, c])


def _splat(builder, value):
    lane = builder.insert_element(ir.Constant(_VECTOR, ir.Undefined), value, ir.Constant(_MASK, 0))
    return builder.shuffle_vector(lane, lane, ir.Constant(ir.VectorType(_MASK, LANES), [0] * LANES))


def lane_sums(builder, vectors):
    """One vector whose lane j is the sum of vectors[j]'s lanes, for LANES vectors: pairs of
    vectors halve their runs of one key's partial sums (first a key in every lane, then 8 lanes
    each of 2 keys, then 4 lanes each of 4 ...) by adding their interleaved halves, one shuffle
    each, until one vector holds one lane a key; then a last shuffle puts key j in lane j."""
    owners = [[key] * LANES for key in range(len(vectors))]   # the key each lane's partial sum is of
    run = LANES
    while len(vectors) > 1:
        half = run // 2
        low = [i + part for start in range(0, LANES, run) for part in (0, LANES) for i in range(start, start + half)]
        high = [i + half for i in low]
        next_vectors, next_owners = [], []
        for k in range(0, len(vectors), 2):
            (a, b), (owner_a, owner_b) = vectors[k:k + 2], owners[k:k + 2]
            both = owner_a + owner_b
            masks = [ir.Constant(ir.VectorType(_MASK, LANES), mask) for mask in (low, high)]
            next_vectors.append(builder.fadd(builder.shuffle_vector(a, b, masks[0]), builder.shuffle_vector(a, b, masks[1])))
            next_owners.append([both[i] for i in low])
        vectors, owners, run = next_vectors, next_owners, half
    order = [owners[0].index(key) for key in range(LANES)]
    return builder.shuffle_vector(vectors[0], vectors[0], ir.Constant(ir.VectorType(_MASK, LANES), order))


@intrinsic
def dot_keys(typingctx, q, q_offset, keys, key_offset, key_stride, num_chunks, scores, score_offset):
    """scores[score_offset + j] = q[q_offset:][:n] . keys[key_offset + j * key_stride:][:n] for the
    KEYS keys j, n = LANES * num_chunks: one accumulator vector a key over the chunks, then
    `lane_sums`, one store."""
    def codegen(context, builder, signature, args):
        q_data, keys_data, scores_data = (_pointer(context, builder, signature.args[i], args[i]) for i in (0, 2, 6))
        q_offset, key_offset, key_stride, num_chunks, score_offset = (args[i] for i in (1, 3, 4, 5, 7))
        zero = ir.Constant(_VECTOR, [0.0] * LANES)
        sums = [cgutils.alloca_once_value(builder, zero) for _ in range(KEYS)]   # registers once promoted
        with cgutils.for_range(builder, num_chunks) as loop:
            chunk = builder.mul(loop.index, ir.Constant(_INDEX, LANES))
            query = builder.load(_vector_at(builder, q_data, builder.add(q_offset, chunk)), align=4)
            row = builder.add(key_offset, chunk)
            for j in range(KEYS):
                key = builder.load(_vector_at(builder, keys_data, row), align=4)
                builder.store(_fma(builder, query, key, builder.load(sums[j])), sums[j])
                row = builder.add(row, key_stride)
        total = lane_sums(builder, [builder.load(s) for s in sums])
        builder.store(total, _vector_at(builder, scores_data, score_offset), align=4)
        return context.get_dummy_value()
    if not _floats(q, keys, scores):
        return None
    return types.void(q, types.intp, keys, types.intp, types.intp, types.intp, scores, types.intp), codegen


@intrinsic
def add_weighted_values(typingctx, p, p_offset, values, value_offset, value_stride, num_chunks, acc, acc_offset):
    """acc[acc_offset:][:n] += sum over the KEYS keys j of p[p_offset + j] * values[value_offset +
    j * value_stride:][:n], n = LANES * num_chunks: a chunk of acc at a time, in four registers
    (keys j, j + 4, ... in the same one) added together at the chunk's end."""
    def codegen(context, builder, signature, args):
        p_data, values_data, acc_data = (_pointer(context, builder, signature.args[i], args[i]) for i in (0, 2, 6))
        p_offset, value_offset, value_stride, num_chunks, acc_offset = (args[i] for i in (1, 3, 4, 5, 7))
        weights = [_splat(builder, builder.load(builder.gep(p_data, [builder.add(p_offset, ir.Constant(_INDEX, j))])))
                   for j in range(KEYS)]
        zero = ir.Constant(_VECTOR, [0.0] * LANES)
        with cgutils.for_range(builder, num_chunks) as loop:
            chunk = builder.mul(loop.index, ir.Constant(_INDEX, LANES))
            target = _vector_at(builder, acc_data, builder.add(acc_offset, chunk))
            partial = [builder.load(target, align=4), zero, zero, zero]
            row = builder.add(value_offset, chunk)
            for j in range(KEYS):
                value = builder.load(_vector_at(builder, values_data, row), align=4)
                partial[j % 4] = _fma(builder, weights[j], value, partial[j % 4])
                row = builder.add(row, value_stride)
            total = builder.fadd(builder.fadd(partial[0], partial[1]), builder.fadd(partial[2], partial[3]))
            builder.store(total, target, align=4)
        return context.get_dummy_value()
    if not _floats(p, values, acc):
        return None
    return types.void(p, types.intp, values, types.intp, types.intp, types.intp, acc, types.intp), codegen
