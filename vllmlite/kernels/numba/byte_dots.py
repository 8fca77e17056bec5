"""The integer kernel's inner product (int_linear.py) on x86: one block of a tile's TILE rows times
a few tokens' 8-bit activations, exact int32 sums, in the instruction that multiplies bytes:

- AVX-512 VNNI: `vpdpbusd` multiplies 64 unsigned bytes by 64 signed bytes and adds each group of
  four products into one of 16 int32 lanes: 64 of a block's multiply-adds per instruction.
- AVX2 (llama.cpp's path on such CPUs): `vpmaddubsw` multiplies 32 unsigned bytes by 32 signed
  ones and adds pairs into 16 int16 lanes, `vpmaddwd` by ones adds pairs of those into 8 int32
  lanes. int4's nibbles (<= 15) keep a whole block's sums in int16 (16 products: 16 * 15 * 127 =
  30480) and widen once. int8's signed weights go as |q| times the activations with q's sign
  (`vpsignb`: 2 * 128 * 127 = 32512 fits a pair) and widen every group.

Numba does not emit these from a loop, so each product is an `@intrinsic` that writes LLVM IR
calling them. Knows nothing of scales or the model.

The weights must be regrouped (QuantizedMatrix.grouped_qs): byte k of row i's 32-bit lane in
group g is element 4g + k of that row's block, the TILE rows side by side, one lane a row:

    int8  [groups 8, TILE, 4] = q + 128 (unsigned for VNNI: the kernel subtracts 128 * sum(q_x)
          after; AVX2 flips the top bit back to q in registers)
    int4  [groups 4, TILE, 4] = the packed bytes 4g .. 4g + 3: low nibbles are elements
          4g .. 4g + 3 and high nibbles 16 + 4g .. 16 + 4g + 3 (masked and shifted in registers)

The activations are the block's 32 int8 as 8 int32 words (word g = elements 4g .. 4g + 3), each
broadcast to the lanes it multiplies.

Numba's disk cache keys a kernel on its own file only: after editing this one, delete the cached
int_linear kernels (vllmlite/kernels/numba/__pycache__/int_linear.*.nb*) or they keep the old code.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from vllmlite.kernels.numba.jit import cpu_features
from vllmlite.kernels.quant import BLOCK, TILE

GROUP = 4                # bytes a 32-bit lane sums
I1, I8, I16, I32, I64 = (ir.IntType(n) for n in (1, 8, 16, 32, 64))


def _isa(features: frozenset[str]) -> str | None:
    """"vnni" where numba compiles for AVX-512 VNNI, "avx2" where for AVX2, else None."""
    if {"avx512vnni", "avx512bw"} <= features:
        return "vnni"
    return "avx2" if "avx2" in features else None


ISA = _isa(cpu_features())


def _vector(element: ir.IntType, bits: int) -> ir.VectorType:
    return ir.VectorType(element, bits // element.width)


def _splat(vector_type: ir.VectorType, value: int) -> ir.Constant:
    return ir.Constant(vector_type, [value] * vector_type.count)


def _call(builder: ir.IRBuilder, name: str, result: ir.Type, *args):
    fn = builder.module.declare_intrinsic(name, fnty=ir.FunctionType(result, [a.type for a in args]))
    return builder.call(fn, list(args))


class _Vnni:
    """512-bit registers; vpdpbusd on q + 128 (int8) or the nibbles (int4); one token keeps two
    accumulators a register (shorter dependency chains), several keep one each."""
    bits = 512
    words = _vector(I32, 512)

    def __init__(self, builder: ir.IRBuilder, is_int4: bool, num_tokens: int):
        self.builder, self.is_int4 = builder, is_int4
        self.num_sets = 2 if num_tokens == 1 else 1

    def zero(self):
        return [_splat(self.words, 0)] * self.num_sets

    def operands(self, v):
        """A register of weights -> what each token's product reads (loaded and split once)."""
        b = self.builder
        if not self.is_int4:
            return (v,)
        nibble = _splat(self.words, 0x0F0F0F0F)
        return b.and_(v, nibble), b.and_(b.lshr(v, _splat(self.words, 4)), nibble)

    def add(self, acc, operands, x_low, x_high, g):
        if self.is_int4:
            acc[0] = self._dot(acc[0], operands[0], x_low)
            acc[-1] = self._dot(acc[-1], operands[1], x_high)
        else:
            acc[g % self.num_sets] = self._dot(acc[g % self.num_sets], operands[0], x_low)

    def total(self, acc):
        return acc[0] if self.num_sets == 1 else self.builder.add(acc[0], acc[1])

    def _dot(self, acc, w, x):
        return _call(self.builder, "llvm.x86.avx512.vpdpbusd.512", self.words, acc, w, x)


class _Avx2:
    """256-bit registers; vpmaddubsw and vpmaddwd (module docstring)."""
    bits = 256
    words = _vector(I32, 256)
    bytes = _vector(I8, 256)
    halves = _vector(I16, 256)

    def __init__(self, builder: ir.IRBuilder, is_int4: bool, num_tokens: int):
        self.builder, self.is_int4 = builder, is_int4
        self.ones = _splat(self.halves, 1)

    def zero(self):
        return [_splat(self.halves if self.is_int4 else self.words, 0)]

    def operands(self, v):
        b = self.builder
        v = b.bitcast(v, self.bytes)
        if self.is_int4:
            nibble = _splat(self.bytes, 0x0F)
            high = b.bitcast(b.lshr(b.bitcast(v, self.halves), _splat(self.halves, 4)), self.bytes)
            return b.and_(v, nibble), b.and_(high, nibble)
        q = b.xor(v, _splat(self.bytes, -128))                          # q + 128 -> q
        return q, _call(b, "llvm.abs.v32i8", self.bytes, q, ir.Constant(I1, 0))

    def add(self, acc, operands, x_low, x_high, g):
        b = self.builder
        if self.is_int4:
            low = self._pairs(operands[0], x_low)
            acc[0] = b.add(acc[0], b.add(low, self._pairs(operands[1], x_high)))
        else:
            q, magnitude = operands
            signed_x = _call(b, "llvm.x86.avx2.psign.b", self.bytes, b.bitcast(x_low, self.bytes), q)
            acc[0] = b.add(acc[0], self._widen(self._pairs(magnitude, signed_x)))

    def total(self, acc):
        return self._widen(acc[0]) if self.is_int4 else acc[0]

    def _pairs(self, unsigned, signed):
        b = self.builder
        return _call(b, "llvm.x86.avx2.pmadd.ub.sw", self.halves, unsigned, b.bitcast(signed, self.bytes))

    def _widen(self, halves):
        return _call(self.builder, "llvm.x86.avx2.pmadd.wd", self.words, halves, self.ones)


# Registers of a tile's rows accumulated at once: the whole tile (4) with VNNI's 32 registers; on
# AVX2's 16, half the tile (4 of 8) times TOKENS_PER_CALL tokens.
_CHUNK = {"vnni": TILE // 16, "avx2": 4}


def _block_dots_codegen(isa: str, is_int4: bool, num_tokens: int):
    """IR for one block of one tile times `num_tokens` tokens: dots[k * TILE + i] = the weights'
    bytes . token k's bytes of row i (int4: the nibbles; int8: q + 128 with VNNI, q with AVX2),
    unrolled. Each weight register is loaded (and split) once for all the tokens."""
    num_groups = BLOCK // GROUP // (2 if is_int4 else 1)
    unit = _Vnni if isa == "vnni" else _Avx2
    lanes = unit.bits // 32                  # rows of a register
    registers, chunk = TILE // lanes, _CHUNK[isa]

    def codegen(context, builder, signature, args):
        w_type, _, x_type, _, _, dots_type = signature.args
        w_arr = context.make_array(w_type)(context, builder, args[0])
        x_arr = context.make_array(x_type)(context, builder, args[2])
        dots_arr = context.make_array(dots_type)(context, builder, args[5])
        w_base = builder.gep(w_arr.data, [args[1]])                         # uint8*
        x_bases = [builder.gep(x_arr.data, [builder.add(args[3], builder.mul(args[4], ir.Constant(args[4].type, k)))])
                   for k in range(num_tokens)]                              # int32* of each token's block
        ops = unit(builder, is_int4, num_tokens)
        vector_ptr = ops.words.as_pointer()

        def word(k, index):
            """Token k's word `index`, in every lane."""
            value = builder.load(builder.gep(x_bases[k], [ir.Constant(I64, index)]))
            one = builder.insert_element(ir.Constant(ops.words, ir.Undefined), value, ir.Constant(I32, 0))
            return builder.shuffle_vector(one, one, ir.Constant(ops.words, [0] * lanes))

        for first in range(0, registers, chunk):
            acc = [[ops.zero() for _ in range(chunk)] for _ in range(num_tokens)]
            for g in range(num_groups):
                x_low = [word(k, g) for k in range(num_tokens)]
                x_high = [word(k, num_groups + g) for k in range(num_tokens)] if is_int4 else [None] * num_tokens
                for c in range(chunk):
                    offset = ir.Constant(I64, (g * TILE + (first + c) * lanes) * GROUP)
                    v = builder.load(builder.bitcast(builder.gep(w_base, [offset]), vector_ptr), align=1)
                    operands = ops.operands(v)
                    for k in range(num_tokens):
                        ops.add(acc[k][c], operands, x_low[k], x_high[k], g)
            for k in range(num_tokens):
                for c in range(chunk):
                    ptr = builder.gep(dots_arr.data, [ir.Constant(I64, k * TILE + (first + c) * lanes)])
                    builder.store(ops.total(acc[k][c]), builder.bitcast(ptr, vector_ptr), align=4)
        return context.get_dummy_value()
    return codegen


def _block_dots_intrinsic(is_int4: bool, num_tokens: int):
    @intrinsic
    def block_dots(typingctx, w, w_start, x, x_start, x_stride, dots):
        """w uint8 1-D (C), x int32 1-D (C), dots int32 1-D (C, >= num_tokens * TILE):
        dots[k * TILE:(k + 1) * TILE] = block w[w_start:] . x[x_start + k * x_stride:] for each
        of the num_tokens tokens k (module docstring), on this CPU's ISA."""
        arrays = ((w, types.uint8), (x, types.int32), (dots, types.int32))
        if ISA is None or not all(isinstance(a, types.Array) and a.dtype == dtype and a.ndim == 1 and a.layout == "C"
                                  for a, dtype in arrays):
            return None
        return (types.void(w, types.intp, x, types.intp, types.intp, dots),
                _block_dots_codegen(ISA, is_int4, num_tokens))
    return block_dots


TOKENS_PER_CALL = 4 if ISA == "vnni" else 2   # tokens the *_block_dots_n products take at once
int4_block_dots = _block_dots_intrinsic(True, 1)
int8_block_dots = _block_dots_intrinsic(False, 1)
int4_block_dots_n = _block_dots_intrinsic(True, TOKENS_PER_CALL)
int8_block_dots_n = _block_dots_intrinsic(False, TOKENS_PER_CALL)
