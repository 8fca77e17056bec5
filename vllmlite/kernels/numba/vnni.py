"""The integer kernel's inner product on CPUs with AVX-512 VNNI: `vpdpbusd` multiplies 64 unsigned
bytes by 64 signed bytes and adds each group of four products into one of 16 int32 lanes, so one
instruction does 64 of a block's multiply-adds (the int16 loop of int_linear.py does 32 and then
widens). Numba does not emit it from a loop, so the block's product is an `@intrinsic` that
writes LLVM IR calling `llvm.x86.avx512.vpdpbusd.512`. Knows nothing of scales or the model.

The weights must be regrouped for it (QuantizedMatrix.grouped_qs): byte k of row i's 32-bit lane
in group g is element 4g + k of that row's block, the TILE rows side by side, 16 lanes to a register:

    int8  [groups 8, TILE, 4] = q + 128 (unsigned: the kernel subtracts 128 * sum(q_x) after)
    int4  [groups 4, TILE, 4] = the packed bytes 4g .. 4g + 3: low nibbles are elements
          4g .. 4g + 3 and high nibbles 16 + 4g .. 16 + 4g + 3 (masked and shifted in registers)

The activations are the block's 32 int8 as 8 int32 words (word g = elements 4g .. 4g + 3), each
broadcast to the 16 lanes it multiplies.

Numba's disk cache keys a kernel on its own file only: after editing this one, delete the cached
int_linear kernels (vllmlite/kernels/numba/__pycache__/int_linear.*.nb*) or they keep the old code.
"""

from __future__ import annotations

import llvmlite.binding as llvm
import numba
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from vllmlite.kernels.quant import BLOCK, TILE

LANES = 16               # int32 lanes of a 512-bit register
REGISTERS = TILE // LANES  # registers per group: the tile's rows
GROUP = 4                # bytes a lane sums


def available() -> bool:
    """Whether numba compiles for a CPU with AVX-512 VNNI (the host's features, no NUMBA_CPU_NAME)."""
    features = llvm.get_host_cpu_features()
    return (numba.config.CPU_NAME is None and bool(features.get("avx512vnni"))
            and bool(features.get("avx512bw")))


I32X16 = ir.VectorType(ir.IntType(32), LANES)


def _vpdpbusd(builder: ir.IRBuilder, acc, weights, x):
    fnty = ir.FunctionType(I32X16, [I32X16, I32X16, I32X16])
    fn = builder.module.declare_intrinsic("llvm.x86.avx512.vpdpbusd.512", fnty=fnty)
    return builder.call(fn, [acc, weights, x])


def _broadcast(builder: ir.IRBuilder, word):
    """One int32 in all 16 lanes."""
    one = builder.insert_element(ir.Constant(I32X16, ir.Undefined), word, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(ir.IntType(32), LANES), [0] * LANES))


def _block_dots_codegen(is_int4: bool, num_tokens: int):
    """IR for one block of one tile times `num_tokens` tokens: dots[k * TILE + i] = the weights'
    bytes . token k's bytes of row i (int4: the nibbles; int8: q + 128), unrolled. Each weight
    register is loaded (and for int4 split into nibbles) once for all the tokens; one token keeps
    two accumulators per register (shorter dependency chains), several keep one each."""
    num_groups = BLOCK // GROUP // (2 if is_int4 else 1)
    num_sets = 2 if num_tokens == 1 else 1

    def codegen(context, builder, signature, args):
        w_type, _, x_type, _, _, dots_type = signature.args
        w_arr = context.make_array(w_type)(context, builder, args[0])
        x_arr = context.make_array(x_type)(context, builder, args[2])
        dots_arr = context.make_array(dots_type)(context, builder, args[5])
        w_base = builder.gep(w_arr.data, [args[1]])                         # uint8*
        x_bases = [builder.gep(x_arr.data, [builder.add(args[3], builder.mul(args[4], ir.Constant(args[4].type, k)))])
                   for k in range(num_tokens)]                              # int32* of each token's block
        vector_ptr = I32X16.as_pointer()
        zero = ir.Constant(I32X16, [0] * LANES)
        nibble = ir.Constant(I32X16, [0x0F0F0F0F] * LANES)
        four = ir.Constant(I32X16, [4] * LANES)
        acc = [[[zero] * REGISTERS for _ in range(num_sets)] for _ in range(num_tokens)]

        def word(k, index):
            return _broadcast(builder, builder.load(builder.gep(x_bases[k], [ir.Constant(ir.IntType(64), index)])))

        for g in range(num_groups):
            x_low = [word(k, g) for k in range(num_tokens)]
            x_high = [word(k, num_groups + g) for k in range(num_tokens)] if is_int4 else None
            for c in range(REGISTERS):
                offset = ir.Constant(ir.IntType(64), (g * TILE + c * LANES) * GROUP)
                v = builder.load(builder.bitcast(builder.gep(w_base, [offset]), vector_ptr), align=1)
                if is_int4:
                    low, high = builder.and_(v, nibble), builder.and_(builder.lshr(v, four), nibble)
                for k in range(num_tokens):
                    if is_int4:
                        acc[k][0][c] = _vpdpbusd(builder, acc[k][0][c], low, x_low[k])
                        acc[k][-1][c] = _vpdpbusd(builder, acc[k][-1][c], high, x_high[k])
                    else:
                        acc[k][g % num_sets][c] = _vpdpbusd(builder, acc[k][g % num_sets][c], v, x_low[k])
        for k in range(num_tokens):
            for c in range(REGISTERS):
                total = acc[k][0][c] if num_sets == 1 else builder.add(acc[k][0][c], acc[k][1][c])
                ptr = builder.gep(dots_arr.data, [ir.Constant(ir.IntType(64), k * TILE + c * LANES)])
                builder.store(total, builder.bitcast(ptr, vector_ptr), align=4)
        return context.get_dummy_value()
    return codegen


def _block_dots_intrinsic(is_int4: bool, num_tokens: int):
    @intrinsic
    def block_dots(typingctx, w, w_start, x, x_start, x_stride, dots):
        """w uint8 1-D (C), x int32 1-D (C), dots int32 1-D (C, >= num_tokens * TILE):
        dots[k * TILE:(k + 1) * TILE] = block w[w_start:] . x[x_start + k * x_stride:] for each
        of the num_tokens tokens k (module docstring)."""
        arrays = ((w, types.uint8), (x, types.int32), (dots, types.int32))
        if not all(isinstance(a, types.Array) and a.dtype == dtype and a.ndim == 1 and a.layout == "C"
                   for a, dtype in arrays):
            return None
        return (types.void(w, types.intp, x, types.intp, types.intp, dots),
                _block_dots_codegen(is_int4, num_tokens))
    return block_dots


TOKENS_PER_CALL = 4   # tokens the *_block_dots_4 products take at once
int4_block_dots = _block_dots_intrinsic(True, 1)
int8_block_dots = _block_dots_intrinsic(False, 1)
int4_block_dots_4 = _block_dots_intrinsic(True, TOKENS_PER_CALL)
int8_block_dots_4 = _block_dots_intrinsic(False, TOKENS_PER_CALL)
