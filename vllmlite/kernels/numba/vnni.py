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


def _block_dots_codegen(is_int4: bool):
    """IR for one block of one tile times one token: dots[i] = the weights' bytes . the token's bytes
    of row i (int4: the nibbles; int8: q + 128), unrolled, 2 x REGISTERS accumulators in registers."""
    num_groups = BLOCK // GROUP // (2 if is_int4 else 1)

    def codegen(context, builder, signature, args):
        w_type, _, x_type, _, dots_type = signature.args
        w_arr = context.make_array(w_type)(context, builder, args[0])
        x_arr = context.make_array(x_type)(context, builder, args[2])
        dots_arr = context.make_array(dots_type)(context, builder, args[4])
        w_base = builder.gep(w_arr.data, [args[1]])                         # uint8*
        x_base = builder.gep(x_arr.data, [args[3]])                         # int32*
        vector_ptr = I32X16.as_pointer()
        zero = ir.Constant(I32X16, [0] * LANES)
        nibble = ir.Constant(I32X16, [0x0F0F0F0F] * LANES)
        four = ir.Constant(I32X16, [4] * LANES)
        acc = [[zero] * REGISTERS for _ in range(2)]
        for g in range(num_groups):
            x_low = _broadcast(builder, builder.load(builder.gep(x_base, [ir.Constant(ir.IntType(64), g)])))
            if is_int4:
                x_high = _broadcast(builder, builder.load(
                    builder.gep(x_base, [ir.Constant(ir.IntType(64), num_groups + g)])))
            for c in range(REGISTERS):
                offset = ir.Constant(ir.IntType(64), (g * TILE + c * LANES) * GROUP)
                v = builder.load(builder.bitcast(builder.gep(w_base, [offset]), vector_ptr), align=1)
                if is_int4:
                    acc[0][c] = _vpdpbusd(builder, acc[0][c], builder.and_(v, nibble), x_low)
                    acc[1][c] = _vpdpbusd(builder, acc[1][c], builder.and_(builder.lshr(v, four), nibble), x_high)
                else:
                    acc[g % 2][c] = _vpdpbusd(builder, acc[g % 2][c], v, x_low)
        for c in range(REGISTERS):
            ptr = builder.gep(dots_arr.data, [ir.Constant(ir.IntType(64), c * LANES)])
            builder.store(builder.add(acc[0][c], acc[1][c]), builder.bitcast(ptr, vector_ptr), align=4)
        return context.get_dummy_value()
    return codegen


def _block_dots_intrinsic(is_int4: bool):
    @intrinsic
    def block_dots(typingctx, w, w_start, x, x_start, dots):
        """w uint8 1-D (C), x int32 1-D (C), dots int32 1-D (C, >= TILE): dots[:TILE] = block
        w[w_start:] . x[x_start:] (module docstring)."""
        arrays = ((w, types.uint8), (x, types.int32), (dots, types.int32))
        if not all(isinstance(a, types.Array) and a.dtype == dtype and a.ndim == 1 and a.layout == "C"
                   for a, dtype in arrays):
            return None
        return types.void(w, types.intp, x, types.intp, dots), _block_dots_codegen(is_int4)
    return block_dots


int4_block_dots = _block_dots_intrinsic(True)
int8_block_dots = _block_dots_intrinsic(False)
