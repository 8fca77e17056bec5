"""The numba backend's products of one query head with KEYS keys at a time, written as explicit
vectors for the decode kernel (attention.py, through block_products.py): the scores q . k of KEYS
keys, and the sum of KEYS values weighted by their probabilities; and the same for up to
INT8_HEADS query heads at once straight from int8 K/V (below `_widened`), whose scores AVX-512 VNNI
takes as integer products (at the end). Knows nothing of caches or softmax.

Loops of plain numba left these to LLVM, which reduced each dot product's vector to a number on
its own (eight instructions per key, more than its multiply-adds) and reloaded the accumulators
of the weighted sum between keys. Here the KEYS dot products end in one transposing sum that
leaves score j in lane j (45 shuffles and adds for 16 keys instead of 128), and the weighted sum
keeps each register's share of its output in a register while all KEYS values are added to it.

Vectors are float32 registers, WIDTH wide: 16 with AVX-512, else 8 (AVX2), so that the
accumulators fit the registers there are; head_dim goes in chunks of LANES (16), one or two
registers each. Each array is
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

from vllmlite.kernels.numba.byte_dots import ISA
from vllmlite.kernels.numba.jit import cpu_features

LANES = 16   # float32 values in a chunk of head_dim: an int8 group (kv_dtype.INT8_GROUP) shares a scale


# float32 lanes of a register: the products keep their accumulators in vectors this wide, a chunk
# in LANES // WIDTH of them. Without AVX-512 (16 registers of 8 floats) a LANES-wide accumulator
# took two registers, and the int8 scores' 24 of them spilled to the stack (111 stack accesses in
# a 242-instruction loop).
WIDTH = 16 if "avx512f" in cpu_features() else 8
KEYS = WIDTH   # keys a call handles: one vector of scores
_PARTS = LANES // WIDTH

_FLOAT = ir.FloatType()
_VECTOR = ir.VectorType(_FLOAT, WIDTH)
_ZERO = ir.Constant(_VECTOR, [0.0] * WIDTH)
_INDEX = ir.IntType(64)
_MASK = ir.IntType(32)


def _floats(*arrays):
    """Whether these are all float32 arrays (the only kind these products take)."""
    return all(isinstance(a, types.Array) and a.dtype == types.float32 for a in arrays)


def _pointer(context, builder, array_type, array):
    return context.make_array(array_type)(context, builder, array).data


def _vector_at(builder, base, offset):
    """A pointer to the WIDTH floats at base[offset], for an unaligned vector load or store."""
    return builder.bitcast(builder.gep(base, [offset]), _VECTOR.as_pointer())


def _fma(builder, a, b, c):
    """a * b + c in each lane, rounded once (llvm.fma: a vfmadd instruction)."""
    fma = builder.module.declare_intrinsic(f"llvm.fma.v{WIDTH}f32", fnty=ir.FunctionType(_VECTOR, [_VECTOR] * 3))
    return builder.call(fma, [a, b, c])


def _splat(builder, value):
    lane = builder.insert_element(ir.Constant(_VECTOR, ir.Undefined), value, ir.Constant(_MASK, 0))
    return builder.shuffle_vector(lane, lane, ir.Constant(ir.VectorType(_MASK, WIDTH), [0] * WIDTH))


def _chunk_parts(builder, num_chunks):
    """Loops over the chunks (a `for_range`), yielding (chunk index, element offset) of each
    WIDTH-float part of each: one part a chunk with AVX-512, two without."""
    with cgutils.for_range(builder, num_chunks) as loop:
        for part in range(_PARTS):
            yield loop.index, builder.add(builder.mul(loop.index, ir.Constant(_INDEX, LANES)), ir.Constant(_INDEX, part * WIDTH))


def _parts(builder, num_chunks):
    """Loops over the WIDTH-float parts of the chunks one at a time (a `for_range`), yielding (chunk
    index, element offset) of each: a loop body holds one part's vectors, not a whole chunk's."""
    with cgutils.for_range(builder, builder.mul(num_chunks, ir.Constant(_INDEX, _PARTS))) as loop:
        yield builder.udiv(loop.index, ir.Constant(_INDEX, _PARTS)), builder.mul(loop.index, ir.Constant(_INDEX, WIDTH))


def _pairwise_sum(builder, vectors):
    """(v0 + v1) + (v2 + v3) ..., for a power-of-two count of vectors."""
    while len(vectors) > 1:
        vectors = [builder.fadd(vectors[i], vectors[i + 1]) for i in range(0, len(vectors), 2)]
    return vectors[0]


def lane_sums(builder, vectors):
    """A vector of len(vectors) lanes (a power of two up to the vectors' width) whose lane j is the sum of
    vectors[j]'s lanes: pairs of vectors halve their runs of one key's partial sums (first a key in
    every lane, then 8 lanes each of 2 keys, then 4 lanes each of 4 ...) by adding their
    interleaved halves, one shuffle each, until one vector is left; for fewer keys than lanes each
    run of that one is then added to itself shifted by half a run until one lane a key is left;
    then a last shuffle puts key j in lane j."""
    num, lanes = len(vectors), vectors[0].type.count
    owners = [[key] * lanes for key in range(num)]   # the key each lane's partial sum is of
    run = lanes
    while len(vectors) > 1:
        half = run // 2
        low = [i + part for start in range(0, lanes, run) for part in (0, lanes) for i in range(start, start + half)]
        high = [i + half for i in low]
        next_vectors, next_owners = [], []
        for k in range(0, len(vectors), 2):
            (a, b), (owner_a, owner_b) = vectors[k:k + 2], owners[k:k + 2]
            both = owner_a + owner_b
            masks = [ir.Constant(ir.VectorType(_MASK, lanes), mask) for mask in (low, high)]
            next_vectors.append(builder.fadd(builder.shuffle_vector(a, b, masks[0]), builder.shuffle_vector(a, b, masks[1])))
            next_owners.append([both[i] for i in low])
        vectors, owners, run = next_vectors, next_owners, half
    vector, owner = vectors[0], owners[0]
    while run > 1:
        half = run // 2
        shifted = [i + half if i % run < half else i - half for i in range(lanes)]
        vector = builder.fadd(vector, builder.shuffle_vector(vector, vector, ir.Constant(ir.VectorType(_MASK, lanes), shifted)))
        run = half
    order = [owner.index(key) for key in range(num)]
    return builder.shuffle_vector(vector, vector, ir.Constant(ir.VectorType(_MASK, num), order))


@intrinsic
def dot_keys(typingctx, q, q_offset, keys, key_offset, key_stride, num_chunks, scores, score_offset):
    """scores[score_offset + j] = q[q_offset:][:n] . keys[key_offset + j * key_stride:][:n] for the
    KEYS keys j, n = LANES * num_chunks: one accumulator vector a key over the chunks, then
    `lane_sums`, one store."""
    def codegen(context, builder, signature, args):
        q_data, keys_data, scores_data = (_pointer(context, builder, signature.args[i], args[i]) for i in (0, 2, 6))
        q_offset, key_offset, key_stride, num_chunks, score_offset = (args[i] for i in (1, 3, 4, 5, 7))
        sums = [cgutils.alloca_once_value(builder, _ZERO) for _ in range(KEYS)]   # registers once promoted
        for _, chunk in _chunk_parts(builder, num_chunks):
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
    j * value_stride:][:n], n = LANES * num_chunks: WIDTH floats of acc at a time, in four
    registers (keys j, j + 4, ... in the same one) added together at the part's end."""
    def codegen(context, builder, signature, args):
        p_data, values_data, acc_data = (_pointer(context, builder, signature.args[i], args[i]) for i in (0, 2, 6))
        p_offset, value_offset, value_stride, num_chunks, acc_offset = (args[i] for i in (1, 3, 4, 5, 7))
        weights = [_splat(builder, builder.load(builder.gep(p_data, [builder.add(p_offset, ir.Constant(_INDEX, j))])))
                   for j in range(KEYS)]
        for _, chunk in _chunk_parts(builder, num_chunks):
            target = _vector_at(builder, acc_data, builder.add(acc_offset, chunk))
            partial = [builder.load(target, align=4), _ZERO, _ZERO, _ZERO]
            row = builder.add(value_offset, chunk)
            for j in range(KEYS):
                value = builder.load(_vector_at(builder, values_data, row), align=4)
                partial[j % 4] = _fma(builder, weights[j], value, partial[j % 4])
                row = builder.add(row, value_stride)
            builder.store(_pairwise_sum(builder, partial), target, align=4)
        return context.get_dummy_value()
    if not _floats(p, values, acc):
        return None
    return types.void(p, types.intp, values, types.intp, types.intp, types.intp, acc, types.intp), codegen


# int8 K and V straight from the cache: each group of LANES int8 values (kv_dtype.INT8_GROUP, one
# float32 scale) is widened in registers, as kv_read's `_widen_lanes` does it (sign extension,
# conversion, a product with the scale), WIDTH values at a time, and serves every query head of a
# pass before the next one is read. Widening a block into scratch first and reading it back once a
# head cost a store and a load a vector more; 32 x 513 int8 keys and values, default model's heads:
# 1.07-1.15 -> 0.90-0.94 ms a layer (2-core EPYC, one process, alternated).
# How many accumulators the passes keep depends on the registers: AVX-512 (32 of 16 floats) holds
# 3 heads x 8 keys; AVX2 (16 of 8 floats) 3 x 2, with a part's query vectors, the key and its scale
# beside them. At 3 x 4 the loop kept its 12 accumulators on the stack (32 stack accesses in a
# 91-instruction loop) and took 1.13-1.32x as long (2-core Zen 3 EPYC, 256 keys x 9 heads, alternated
# in one process: results/kv_decode_step_avx2_products.json).
INT8_HEADS = 3                         # query heads a pass at most
# keys a scores call takes for 2 or 3 heads (AVX-512, 3 heads: 0.90 ms a layer against 0.97 with
# 16 keys, 0.94 with 4); one head takes KEYS
INT8_SCORE_KEYS = 8 if WIDTH == 16 else 2
_VALUE_PARTS = 4 if WIDTH == 16 else 2     # registers a head's weighted sum is split over (keys j, j + parts, ...)
_BYTES = ir.VectorType(ir.IntType(8), WIDTH)


def _widened(builder, data, scales, offset, scale_offset):
    """The WIDTH int8 values at data[offset] times the float32 at scales[scale_offset]."""
    packed = builder.load(builder.bitcast(builder.gep(data, [offset]), _BYTES.as_pointer()), align=1)
    ints = builder.sext(packed, ir.VectorType(ir.IntType(32), WIDTH))
    return builder.fmul(builder.sitofp(ints, _VECTOR), _splat(builder, builder.load(builder.gep(scales, [scale_offset]))))


def _head_chunks(builder, base, offset, chunk, head_dim, heads):
    """Pointers to the WIDTH floats at `chunk` of each of `heads` rows of head_dim from base[offset]."""
    return [_vector_at(builder, base, builder.add(builder.add(offset, chunk), builder.mul(head_dim, ir.Constant(_INDEX, h))))
            for h in range(heads)]


def _int8(data, scales):
    return isinstance(data, types.Array) and data.dtype == types.int8 and _floats(scales)


def _int8_dot_keys(heads, keys):
    @intrinsic
    def dot(typingctx, q, q_offset, data, scales, offset, stride, scale_offset, scale_stride, num_chunks, scores,
            score_offset, score_row):
        """scores[score_offset + h * score_row + j] = q[q_offset + h * n:][:n] . key j, for the
        `heads` heads h and `keys` keys j, n = LANES * num_chunks; key j is the int8 values at
        data[offset + j * stride:][:n], each LANES times its scale at scales[scale_offset + j *
        scale_stride + chunk]. One accumulator of WIDTH floats a head and key."""
        def codegen(context, builder, signature, args):
            q_data, k_data, s_data, out = (_pointer(context, builder, signature.args[i], args[i]) for i in (0, 2, 3, 9))
            q_offset, offset, stride, scale_offset, scale_stride, num_chunks, score_offset, score_row = \
                (args[i] for i in (1, 4, 5, 6, 7, 8, 10, 11))
            head_dim = builder.mul(num_chunks, ir.Constant(_INDEX, LANES))
            sums = [[cgutils.alloca_once_value(builder, _ZERO) for _ in range(keys)] for _ in range(heads)]
            for index, chunk in _parts(builder, num_chunks):
                queries = [builder.load(at, align=4) for at in _head_chunks(builder, q_data, q_offset, chunk, head_dim, heads)]
                row, scale_row = builder.add(offset, chunk), builder.add(scale_offset, index)
                for j in range(keys):
                    key = _widened(builder, k_data, s_data, row, scale_row)
                    for h in range(heads):
                        builder.store(_fma(builder, queries[h], key, builder.load(sums[h][j])), sums[h][j])
                    row, scale_row = builder.add(row, stride), builder.add(scale_row, scale_stride)
            for h in range(heads):
                total = lane_sums(builder, [builder.load(s) for s in sums[h]])
                at = builder.add(score_offset, builder.mul(score_row, ir.Constant(_INDEX, h)))
                builder.store(total, builder.bitcast(builder.gep(out, [at]), total.type.as_pointer()), align=4)
            return context.get_dummy_value()
        if not (_floats(q, scores) and _int8(data, scales)):
            return None
        return types.void(q, types.intp, data, scales, *[types.intp] * 5, scores, types.intp, types.intp), codegen
    return dot


def _int8_add_weighted_values(heads):
    @intrinsic
    def add(typingctx, p, p_offset, p_row, data, scales, offset, stride, scale_offset, scale_stride, num_chunks,
            acc, acc_offset):
        """acc[acc_offset + h * n:][:n] += sum over the KEYS keys j of p[p_offset + h * p_row + j]
        * value j, for the `heads` heads h, n = LANES * num_chunks, value j read as `_int8_dot_keys`
        reads key j; per head and WIDTH floats of a chunk _VALUE_PARTS registers (keys j, j +
        _VALUE_PARTS, ... in the same one), as `add_weighted_values`."""
        def codegen(context, builder, signature, args):
            p_data, v_data, s_data, acc_data = (_pointer(context, builder, signature.args[i], args[i]) for i in (0, 3, 4, 10))
            p_offset, p_row, offset, stride, scale_offset, scale_stride, num_chunks, acc_offset = \
                (args[i] for i in (1, 2, 5, 6, 7, 8, 9, 11))
            head_dim = builder.mul(num_chunks, ir.Constant(_INDEX, LANES))
            for index, chunk in _chunk_parts(builder, num_chunks):
                targets = _head_chunks(builder, acc_data, acc_offset, chunk, head_dim, heads)
                partial = [[builder.load(target, align=4)] + [_ZERO] * (_VALUE_PARTS - 1) for target in targets]
                row, scale_row = builder.add(offset, chunk), builder.add(scale_offset, index)
                for j in range(KEYS):
                    value = _widened(builder, v_data, s_data, row, scale_row)
                    for h in range(heads):
                        at = builder.add(builder.add(p_offset, ir.Constant(_INDEX, j)), builder.mul(p_row, ir.Constant(_INDEX, h)))
                        weight = _splat(builder, builder.load(builder.gep(p_data, [at])))
                        partial[h][j % _VALUE_PARTS] = _fma(builder, weight, value, partial[h][j % _VALUE_PARTS])
                    row, scale_row = builder.add(row, stride), builder.add(scale_row, scale_stride)
                for target, parts in zip(targets, partial):
                    builder.store(_pairwise_sum(builder, parts), target, align=4)
            return context.get_dummy_value()
        if not (_floats(p, acc) and _int8(data, scales)):
            return None
        return types.void(p, types.intp, types.intp, data, scales, *[types.intp] * 5, acc, types.intp), codegen
    return add


int8_dot_keys_1, int8_dot_keys_2, int8_dot_keys_3 = \
    _int8_dot_keys(1, KEYS), *(_int8_dot_keys(h, INT8_SCORE_KEYS) for h in (2, 3))
int8_add_values_1, int8_add_values_2, int8_add_values_3 = (_int8_add_weighted_values(h) for h in (1, 2, 3))


# Integer scores on int8 keys (AVX-512 VNNI): over an int8 K cache attention's queries are rounded to
# 16 bits per head (kv_dtype.round_queries), so q . k is the sum over the key's groups of its scale
# times an integer sum, which `vpdpwssd` takes 32 products at a time: it multiplies pairs of int16
# and adds each pair into one of 16 int32 lanes. A register of 64 key bytes, read as 32 int16 words,
# gives its even bytes (shifted up and back, keeping the sign) and its odd bytes (shifted down) as
# int16; against the query's even and odd elements (`integer_queries` lays them out so) the two
# products leave elements 4i .. 4i + 3 in lane i, as the key's groups of LANES lie. Four
# instructions a head and 64 elements (two products, a conversion to float, a multiply-add by the
# lanes' group scales) where widening took a sign extension, a conversion and a product a 16
# elements (shared by the heads) and a multiply-add each head; one head_dim of 64 is one register.
# (8-bit queries, vpdpbusd's one product, cost 3 of 13 parity prompts their greedy agreement.)
QUAD = 64                              # int8 elements of one register (four groups of LANES)
VNNI_SCORE_KEYS = 8                    # keys a call takes for 2 or 3 heads; one head takes KEYS
_WORDS = ir.VectorType(ir.IntType(32), 16)    # one register of int32 lanes (any CPU runs the emulated form)
_HALVES = ir.VectorType(ir.IntType(16), 32)
_FLOATS = ir.VectorType(_FLOAT, 16)
_SPREAD = ir.Constant(ir.VectorType(_MASK, 16), [lane * 4 // LANES for lane in range(16)])   # group of each lane
_EIGHT = ir.Constant(_HALVES, [8] * 32)


def _vpdpwssd(builder, acc, a, b, emulated):
    """acc + in each int32 lane the two products of its int16 halves in a and in b (vpdpwssd, or the
    same in plain IR on CPUs without it, for the tests)."""
    if not emulated:
        fn = builder.module.declare_intrinsic("llvm.x86.avx512.vpdpwssd.512", fnty=ir.FunctionType(_WORDS, [_WORDS] * 3))
        return builder.call(fn, [acc, a, b])
    wide = ir.VectorType(ir.IntType(32), 32)
    products = builder.mul(builder.sext(builder.bitcast(a, _HALVES), wide), builder.sext(builder.bitcast(b, _HALVES), wide))
    for k in range(2):
        acc = builder.add(acc, builder.shuffle_vector(products, products, ir.Constant(ir.VectorType(_MASK, 16),
                                                                                       list(range(k, 32, 2)))))
    return acc


def _vnni_dot_keys(heads, keys, emulated=False):
    @intrinsic
    def dot(typingctx, q_words, q_offset, q_scales, data, scales, offset, stride, scale_offset, scale_stride, num_quads,
            scores, score_offset, score_row):
        """scores[score_offset + h * score_row + j] = q_scales[h] * (query h . key j) for the `heads`
        heads h and `keys` keys j: query h's 16-bit integers are the int32 words from q_words[q_offset +
        h * n / 2], each quad's 16 words of its even elements then 16 of its odd ones
        (block_products.integer_queries), n = QUAD * num_quads; key j the int8 values at data[offset
        + j * stride:][:n], each LANES times its scale at scales[scale_offset + j * scale_stride +
        group]. Per head and key the float32 sum over the quads of their 16 lanes times their groups'
        scales, then the keys' sums (`lane_sums`) times the head's scale."""
        def codegen(context, builder, signature, args):
            q_data, qs_data, k_data, s_data, out = (_pointer(context, builder, signature.args[i], args[i]) for i in (0, 2, 3, 4, 10))
            q_offset, offset, stride, scale_offset, scale_stride, num_quads, score_offset, score_row = \
                (args[i] for i in (1, 5, 6, 7, 8, 9, 11, 12))
            head_words = builder.mul(num_quads, ir.Constant(_INDEX, QUAD // 2))
            sums = [[cgutils.alloca_once_value(builder, ir.Constant(_FLOATS, [0.0] * 16)) for _ in range(keys)]
                    for _ in range(heads)]
            fma = builder.module.declare_intrinsic("llvm.fma.v16f32", fnty=ir.FunctionType(_FLOATS, [_FLOATS] * 3))

            def words_at(index):
                return builder.load(builder.bitcast(builder.gep(q_data, [index]), _WORDS.as_pointer()), align=4)
            with cgutils.for_range(builder, num_quads) as loop:
                quad = builder.add(q_offset, builder.mul(loop.index, ir.Constant(_INDEX, QUAD // 2)))
                queries = []
                for h in range(heads):
                    first = builder.add(quad, builder.mul(head_words, ir.Constant(_INDEX, h)))
                    queries.append((words_at(first), words_at(builder.add(first, ir.Constant(_INDEX, 16)))))
                row = builder.add(offset, builder.mul(loop.index, ir.Constant(_INDEX, QUAD)))
                scale_row = builder.add(scale_offset, builder.mul(loop.index, ir.Constant(_INDEX, QUAD // LANES)))
                for j in range(keys):
                    halves = builder.load(builder.bitcast(builder.gep(k_data, [row]), _HALVES.as_pointer()), align=1)
                    even = builder.bitcast(builder.ashr(builder.shl(halves, _EIGHT), _EIGHT), _WORDS)
                    odd = builder.bitcast(builder.ashr(halves, _EIGHT), _WORDS)
                    four = builder.load(builder.bitcast(builder.gep(s_data, [scale_row]),
                                                        ir.VectorType(_FLOAT, QUAD // LANES).as_pointer()), align=4)
                    spread = builder.shuffle_vector(four, four, _SPREAD)
                    for h in range(heads):
                        ints = _vpdpwssd(builder, ir.Constant(_WORDS, [0] * 16), even, queries[h][0], emulated)
                        ints = _vpdpwssd(builder, ints, odd, queries[h][1], emulated)
                        builder.store(builder.call(fma, [builder.sitofp(ints, _FLOATS), spread, builder.load(sums[h][j])]),
                                      sums[h][j])
                    row, scale_row = builder.add(row, stride), builder.add(scale_row, scale_stride)
            first_head = builder.udiv(q_offset, head_words)
            for h in range(heads):
                total = lane_sums(builder, [builder.load(s) for s in sums[h]])
                scale = builder.load(builder.gep(qs_data, [builder.add(first_head, ir.Constant(_INDEX, h))]))
                lanes = ir.VectorType(_FLOAT, keys)
                one = builder.insert_element(ir.Constant(lanes, ir.Undefined), scale, ir.Constant(_MASK, 0))
                total = builder.fmul(total, builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(_MASK, keys), [0] * keys)))
                at = builder.add(score_offset, builder.mul(score_row, ir.Constant(_INDEX, h)))
                builder.store(total, builder.bitcast(builder.gep(out, [at]), total.type.as_pointer()), align=4)
            return context.get_dummy_value()
        if not (isinstance(q_words, types.Array) and q_words.dtype == types.int32 and _floats(q_scales, scores)
                and _int8(data, scales)):
            return None
        return (types.void(q_words, types.intp, q_scales, data, scales, *[types.intp] * 5, scores, types.intp, types.intp),
                codegen)
    return dot


def vnni_products(emulated=False):
    """The integer score products for passes of 1, 2 and 3 heads (KEYS, VNNI_SCORE_KEYS, VNNI_SCORE_KEYS keys)."""
    return tuple(_vnni_dot_keys(h, KEYS if h == 1 else VNNI_SCORE_KEYS, emulated) for h in (1, 2, 3))


# Without VNNI the plain-IR form, which LLVM can compile there: the decode kernel holds these calls
# on every CPU, and takes them only where block_products.INTEGER_SCORES.
vnni_dot_keys_1, vnni_dot_keys_2, vnni_dot_keys_3 = vnni_products(emulated=ISA != "vnni")
