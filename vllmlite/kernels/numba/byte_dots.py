"""The integer kernel's inner product (int_linear.py) on x86: one block of a tile's TILE rows times
a few tokens' 8-bit activations, exact int32 sums, in the instruction that multiplies bytes, then
the scales applied in registers and the result added to the tokens' float32 accumulators:

- AVX-512 VNNI: `vpdpbusd` multiplies 64 unsigned bytes by 64 signed bytes and adds each group of
  four products into one of 16 int32 lanes: 64 of a block's multiply-adds per instruction.
- AVX2 (llama.cpp's path on such CPUs): `vpmaddubsw` multiplies 32 unsigned bytes by 32 signed
  ones and adds pairs into 16 int16 lanes, `vpmaddwd` by ones adds pairs of those into 8 int32
  lanes. int4's nibbles (<= 15) keep a whole block's sums in int16 (16 products: 16 * 15 * 127 =
  30480) and widen once. int8's signed weights go as |q| times the activations with q's sign
  (`vpsignb`: 2 * 128 * 127 = 32512 fits a pair) and widen every group.

Numba does not emit these from a loop, so each product is an `@intrinsic` that writes LLVM IR
calling them. The scales fold in as the portable kernel's float32 expressions (int_linear._int_dot),
so both give the same bits. Knows nothing of the model.

The weights must be regrouped (QuantizedMatrix.grouped_qs): byte k of row i's 32-bit lane in
group g is element 4g + k of that row's block, the TILE rows side by side, one lane a row:

    int8  [groups 8, TILE, 4] = q + 128 (unsigned for VNNI: 128 * sum(q_x) comes off the sums;
          AVX2 flips the top bit back to q in registers)
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
        """One register of rows' accumulators for one token (a list: `add` replaces its items)."""
        return [_splat(self.words, 0)] * self.num_sets

    def operands(self, v):
        """A register of weights -> what each token's product reads (loaded and split once)."""
        b = self.builder
        if not self.is_int4:
            return (v,)
        nibble = _splat(self.words, 0x0F0F0F0F)
        return b.and_(v, nibble), b.and_(b.lshr(v, _splat(self.words, 4)), nibble)

    def add(self, acc, operands, x_low, x_high, g):
        """Group g's products of one token (x_low: its word g in every lane; x_high: int4's word
        of the high nibbles) into acc."""
        if self.is_int4:
            acc[0] = self._dot(acc[0], operands[0], x_low)
            acc[-1] = self._dot(acc[-1], operands[1], x_high)
        else:
            acc[g % self.num_sets] = self._dot(acc[g % self.num_sets], operands[0], x_low)

    def total(self, acc):
        """The register's int32 sums."""
        return acc[0] if self.num_sets == 1 else self.builder.add(acc[0], acc[1])

    def _dot(self, acc, w, x):
        return _call(self.builder, "llvm.x86.avx512.vpdpbusd.512", self.words, acc, w, x)


class _EmulatedVnni(_Vnni):
    """_Vnni with vpdpbusd written out in plain IR (widen 64 bytes each way, multiply, add each 4
    into a lane), which any CPU runs: the tests check VNNI's products and folds on machines
    without it. Not for speed."""

    def _dot(self, acc, w, x):
        b, wide = self.builder, ir.VectorType(I32, 64)
        products = b.mul(b.zext(b.bitcast(w, ir.VectorType(I8, 64)), wide), b.sext(b.bitcast(x, ir.VectorType(I8, 64)), wide))
        for k in range(GROUP):
            acc = b.add(acc, b.shuffle_vector(products, products, ir.Constant(ir.VectorType(I32, 16),
                                                                              list(range(k, 64, GROUP)))))
        return acc


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


_UNITS = {"vnni": _Vnni, "avx2": _Avx2, "emulated-vnni": _EmulatedVnni}


def _block_fold_codegen(isa: str, is_int4: bool, num_tokens: int, has_mins: bool):
    """IR for one block of one tile times `num_tokens` tokens, unrolled: each register of rows'
    integer sums (the weights' bytes . token k's bytes: int4's nibbles; int8's q, or q + 128 with
    VNNI less 128 sum(q_x)) go to float32 and are folded into the token's accumulators as
    acc += scale * (d_x * dot) + min * (d_x * sum(q_x)), in that order, no fused multiply-add (the
    portable kernel's float32 expressions, so the same bits). Each weight register is loaded (and
    split) once for all the tokens."""
    num_groups = BLOCK // GROUP // (2 if is_int4 else 1)
    unit = _UNITS[isa]
    lanes = unit.bits // 32                  # rows of a register
    # Registers of rows accumulated at once: the whole tile (4) in VNNI's 32 registers; in AVX2's 16,
    # half the tile (4 of 8) times TOKENS_PER_CALL tokens.
    registers = TILE // lanes
    chunk = registers if issubclass(unit, _Vnni) else registers // 2
    floats = ir.VectorType(ir.FloatType(), lanes)
    offset = 128 if issubclass(unit, _Vnni) and not is_int4 else 0   # VNNI multiplies int8's q + 128

    def codegen(context, builder, signature, args):
        w, x, scales, mins, d_x, s_x, acc = (
            context.make_array(signature.args[i])(context, builder, args[i]).data if i != 6 or has_mins else None
            for i in (0, 2, 5, 6, 8, 9, 12))                                   # the arrays' data pointers
        w_start, x_start, x_stride, s_start, d_start, d_stride, acc_start = (args[i] for i in (1, 3, 4, 7, 10, 11, 13))
        w_base = builder.gep(w, [w_start])                                       # uint8*
        x_bases, d_at = [], []
        for k in range(num_tokens):
            x_bases.append(builder.gep(x, [builder.add(x_start, builder.mul(x_stride, ir.Constant(I64, k)))]))
            d_at.append(builder.add(d_start, builder.mul(d_stride, ir.Constant(I64, k))))
        ops = unit(builder, is_int4, num_tokens)
        vector_ptr, float_ptr = ops.words.as_pointer(), floats.as_pointer()

        def splat(value, vector_type):
            one = builder.insert_element(ir.Constant(vector_type, ir.Undefined), value, ir.Constant(I32, 0))
            return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(I32, lanes), [0] * lanes))

        def word(k, index):
            """Token k's word `index`, in every lane."""
            return splat(builder.load(builder.gep(x_bases[k], [ir.Constant(I64, index)])), ops.words)

        def row_floats(base, row):
            return builder.load(builder.bitcast(builder.gep(base, [builder.add(s_start, row)]), float_ptr), align=4)

        sums = [builder.load(builder.gep(s_x, [d_at[k]])) for k in range(num_tokens)]     # sum(q_x), int32
        dx = [splat(builder.load(builder.gep(d_x, [d_at[k]])), floats) for k in range(num_tokens)]
        if has_mins:
            dx_sums = [builder.fmul(dx[k], splat(builder.sitofp(sums[k], ir.FloatType()), floats)) for k in range(num_tokens)]
        if offset:
            offsets = [splat(builder.mul(sums[k], ir.Constant(I32, offset)), ops.words) for k in range(num_tokens)]
        for first in range(0, registers, chunk):
            sums_int = [[ops.zero() for _ in range(chunk)] for _ in range(num_tokens)]
            for g in range(num_groups):
                x_low = [word(k, g) for k in range(num_tokens)]
                x_high = [word(k, num_groups + g) for k in range(num_tokens)] if is_int4 else [None] * num_tokens
                for c in range(chunk):
                    at = ir.Constant(I64, (g * TILE + (first + c) * lanes) * GROUP)
                    v = builder.load(builder.bitcast(builder.gep(w_base, [at]), vector_ptr), align=1)
                    operands = ops.operands(v)
                    for k in range(num_tokens):
                        ops.add(sums_int[k][c], operands, x_low[k], x_high[k], g)
            for c in range(chunk):
                row = ir.Constant(I64, (first + c) * lanes)
                scale = row_floats(scales, row)
                low = row_floats(mins, row) if has_mins else None
                for k in range(num_tokens):
                    dot = ops.total(sums_int[k][c])
                    if offset:
                        dot = builder.sub(dot, offsets[k])
                    term = builder.fmul(scale, builder.fmul(dx[k], builder.sitofp(dot, floats)))
                    if has_mins:
                        term = builder.fadd(term, builder.fmul(low, dx_sums[k]))
                    at = builder.add(acc_start, ir.Constant(I64, k * TILE + (first + c) * lanes))
                    ptr = builder.bitcast(builder.gep(acc, [at]), float_ptr)
                    builder.store(builder.fadd(builder.load(ptr, align=4), term), ptr, align=4)
        return context.get_dummy_value()
    return codegen


def block_fold(is_int4: bool, num_tokens: int, isa: str | None = ISA):
    """The intrinsic below for int4 or int8 weights, `num_tokens` at a time, written for `isa`
    (this CPU's unless a test asks for "emulated-vnni")."""
    @intrinsic
    def fold(typingctx, w, w_start, x, x_start, x_stride, scales, mins, s_start, d_x, s_x, d_start, d_stride, acc,
             acc_start):
        """One block of a tile times num_tokens tokens k, folded into acc (module docstring):

            acc[acc_start + k * TILE + i] += scales[s_start + i] * (dx_k * (w[w_start:] . x[x_start + k * x_stride:])_i)
                                             + mins[s_start + i] * (dx_k * s_x[d_start + k * d_stride])

        with dx_k = d_x[d_start + k * d_stride], flat indices into C-contiguous arrays: w uint8,
        x int32 (the activations' bytes as words), scales and mins float32 (mins None: no term),
        d_x float32, s_x int32 (sum(q_x) of each block), acc float32 1-D."""
        arrays = [(w, types.uint8), (x, types.int32), (scales, types.float32), (d_x, types.float32), (s_x, types.int32),
                  (acc, types.float32)]
        has_mins = not isinstance(mins, types.NoneType)
        if has_mins:
            arrays.append((mins, types.float32))
        if isa is None or not all(isinstance(a, types.Array) and a.dtype == dtype and a.layout == "C" for a, dtype in arrays):
            return None
        i = types.intp
        return (types.void(w, i, x, i, i, scales, mins, i, d_x, s_x, i, i, acc, i),
                _block_fold_codegen(isa, is_int4, num_tokens, has_mins))
    return fold


TOKENS = {"vnni": 4, "emulated-vnni": 4, "avx2": 2}   # tokens the *_block_fold_n products take at once
TOKENS_PER_CALL = TOKENS.get(ISA, 1)
int4_block_fold = block_fold(True, 1)
int8_block_fold = block_fold(False, 1)
int4_block_fold_n = block_fold(True, TOKENS_PER_CALL)
int8_block_fold_n = block_fold(False, TOKENS_PER_CALL)
