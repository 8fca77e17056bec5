"""The numba backend's integer-dot `linear` on quantized weights: activations rounded to 8 bits per
block, exact integer sums per block, scales applied per block (the contract:
vllmlite/kernels/int_dot.py). Knows nothing of the model; `linear(..., int_dot=True)` in linear.py
chooses it.

One loop order serves every token count: a work item is a tile of TILE rows, and each of its
blocks is multiplied by every token's block before the next, so the weights are read from memory
once whatever the batch. Two kernels:

- `_int_dot_bytes` (x86 CPUs with AVX-512 VNNI or AVX2): the rows regrouped so that 4 bytes of one
  row fill a 32-bit lane (QuantizedMatrix.grouped_qs), multiplied a register of bytes per
  instruction (vpdpbusd, or vpmaddubsw and vpmaddwd: byte_dots.py).
- `_int_dot` (elsewhere, and the check on those): quant.py's layout (the rows side by side), each
  block widened to int16 once (32 x TILE, in L1); the innermost loop runs over the tile's rows
  with one activation integer broadcast: LLVM multiplies 32 lanes at a time in int16 (vpmullw) and
  widens every second product into int32 sums.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from vllmlite.kernels.numba import byte_dots
from vllmlite.kernels.numba.jit import exact, exact_parallel, serial
from vllmlite.kernels.quant import BLOCK, TILE, QuantizedMatrix

I16, I32, F32 = np.int16, np.int32, np.float32
HALF = BLOCK // 2
BYTES = byte_dots.ISA is not None   # the compiling CPU multiplies bytes (`_int_dot_bytes` runs)
# The kernels that round the activations themselves compile without fastmath (jit.exact): with it,
# LLVM took the inlined x / d for x * (1 / d) (the caller's function attributes apply to inlined
# code), and the rounded integers were no longer numpy's.


# No fastmath: x / d must round as numpy's does, not as x * (1 / d).
@exact
def _quantize_activations(x, q, d, sums):  # pragma: no cover - compiled
    """x [tokens, in] -> q int8 [tokens, blocks, 32], d float32 [tokens, blocks] (the scales) and
    sums int32 [tokens, blocks] (each block's sum of q), as int_dot.quantize_activations. The
    loops run over tokens innermost: the model's x is a view of a feature-major [in, tokens]
    array, so that is unit stride, and LLVM vectorizes them into a block's buffer `values`
    [32, tokens], copied to q after (token-major loops, or stores straight into q, stayed scalar
    and took 2-4x longer)."""
    num_tokens, num_blocks = d.shape
    top = np.empty(num_tokens, dtype=F32)
    divisor = np.empty(num_tokens, dtype=F32)
    values = np.empty((BLOCK, num_tokens), dtype=F32)
    for b in range(num_blocks):
        top[:] = 0
        for j in range(BLOCK):
            for r in range(num_tokens):
                a = abs(F32(x[r, b * BLOCK + j]))
                top[r] = a if a > top[r] else top[r]
        for r in range(num_tokens):
            d[r, b] = top[r] / F32(127)
            divisor[r] = d[r, b] if d[r, b] != 0 else F32(1)
        for j in range(BLOCK):
            for r in range(num_tokens):
                v = np.rint(F32(x[r, b * BLOCK + j]) / divisor[r])
                v = v if v > F32(-127) else F32(-127)      # selects, not min/max: those stayed scalar
                values[j, r] = v if v < F32(127) else F32(127)
        for r in range(num_tokens):
            total = 0
            for j in range(BLOCK):
                q[r, b, j] = values[j, r]
                total += I32(values[j, r])
            sums[r, b] = total


@exact
def _quantized(x):  # pragma: no cover - compiled
    """x [tokens, in] -> (q, d, sums) of `_quantize_activations`, allocated here: inside the
    kernels' one compiled call (at 1 token, a call and three arrays more from Python cost about as
    much as the product)."""
    num_tokens, cols = x.shape
    q = np.empty((num_tokens, cols // BLOCK, BLOCK), dtype=np.int8)
    d = np.empty((num_tokens, cols // BLOCK), dtype=F32)
    sums = np.empty((num_tokens, cols // BLOCK), dtype=I32)
    _quantize_activations(x, q, d, sums)
    return q, d, sums


@exact
def _round_activations(x, xt):  # pragma: no cover - compiled
    """xt [in, tokens] = q_x * d_x of `_quantize_activations` (one compiled call: for the few
    tokens this serves, numpy's steps around it cost more than the rounding)."""
    num_tokens, cols = x.shape
    q, d, _ = _quantized(x)
    for b in range(cols // BLOCK):
        for j in range(BLOCK):
            for r in range(num_tokens):
                xt[b * BLOCK + j, r] = F32(q[r, b, j]) * d[r, b]


def rounded_activations(x: np.ndarray) -> np.ndarray:
    """x [tokens, in] rounded to 8 bits per block, as the float32 values q_x * d_x: a float kernel
    multiplying them computes int_dot's function up to float32 rounding (q_w . q_x is exact in
    float32: |sum| <= 32 * 128 * 127 < 2^24). Returned as the transpose of a feature-major [in,
    tokens] array, as the model's activations are."""
    xt = np.empty((x.shape[1], x.shape[0]), dtype=F32)    # [in, tokens]
    _round_activations(x, xt)
    return xt.T


@serial
def _widen_int8_block(src, flat):  # pragma: no cover - compiled
    """An int8 block's bytes src [32 * TILE] into flat int16 [32 * TILE]. One flat loop: over
    [32, TILE] (in the kernel or here), LLVM unrolled the 64 lanes into scalar code."""
    for k in range(BLOCK * TILE):
        flat[k] = src[k]


@serial
def _unpack_int4_block(src, flat):  # pragma: no cover - compiled
    """An int4 block's bytes src [16 * TILE] into flat int16 [32 * TILE]: low nibbles are elements
    0-15, high 16-31 (LLVM shifts the bytes with vgf2p8affineqb; `>> 4` stayed scalar)."""
    size = HALF * TILE
    for k in range(size):
        flat[k] = src[k] & 15
    for k in range(size):
        flat[size + k] = src[k] // np.uint8(16)


@exact_parallel
def _int_dot(x, qs, scales, mins, out_t):  # pragma: no cover - compiled
    """out_t [rows, tokens] = the weight times x [tokens, in] rounded to 8 bits (rounded first, on
    this thread); mins None: symmetric int8. Each block of a tile is widened to int16 once (w), then for every token two
    products at a time (four for int4) are summed in int16 (|q_w| <= 128 and |q_x| <= 127: 2 * 128
    * 127 = 32512 fits) and widened into the int32 sums; written as one expression, LLVM keeps the
    products in int16 lanes (vpmullw). Summed in a loop of their own into an int16 array, they
    stayed scalar."""
    q_x, d_x, s_x = _quantized(x)
    num_tiles, num_blocks = qs.shape[0], qs.shape[1]
    num_tokens, num_rows = q_x.shape[0], out_t.shape[0]
    is_int4 = qs.shape[2] * 2 == BLOCK
    size = BLOCK * TILE
    for t in prange(num_tiles):
        acc = np.empty((num_tokens, TILE), dtype=F32)
        flat = np.empty(size, dtype=I16)    # block b's integers, widened once for every token
        w = flat.reshape((BLOCK, TILE))
        src = qs[t].reshape(num_blocks * qs.shape[2] * TILE)
        dots = np.empty(TILE, dtype=I32)    # q_w . q_x of each row, for one block and token
        acc[:] = 0
        for b in range(num_blocks):
            # from a flat slice of the tile: from qs[t, b] these took up to twice as long
            if is_int4:
                _unpack_int4_block(src[b * size // 2:(b + 1) * size // 2], flat)
            else:
                _widen_int8_block(src[b * size:(b + 1) * size], flat)
            for r in range(num_tokens):
                dots[:] = 0
                if is_int4:   # nibbles <= 15: four products fit (4 * 15 * 127 = 7620)
                    for j in range(0, BLOCK, 4):
                        x0, x1 = I16(q_x[r, b, j]), I16(q_x[r, b, j + 1])
                        x2, x3 = I16(q_x[r, b, j + 2]), I16(q_x[r, b, j + 3])
                        for i in range(TILE):
                            dots[i] += I32(I16(w[j, i] * x0 + w[j + 1, i] * x1
                                               + w[j + 2, i] * x2 + w[j + 3, i] * x3))
                else:
                    for j in range(0, BLOCK, 2):
                        x0, x1 = I16(q_x[r, b, j]), I16(q_x[r, b, j + 1])
                        for i in range(TILE):
                            dots[i] += I32(I16(w[j, i] * x0 + w[j + 1, i] * x1))
                dx = d_x[r, b]
                if mins is None:
                    for i in range(TILE):
                        acc[r, i] += scales[t, b, i] * (dx * F32(dots[i]))
                else:
                    dx_sum = dx * F32(s_x[r, b])
                    for i in range(TILE):
                        acc[r, i] += scales[t, b, i] * (dx * F32(dots[i])) + mins[t, b, i] * dx_sum
        for r in range(num_tokens):
            for i in range(min(TILE, num_rows - t * TILE)):
                out_t[t * TILE + i, r] = acc[r, i]


@exact_parallel
def _int_dot_bytes(x, grouped, scales, mins, out_t):  # pragma: no cover - compiled
    """`_int_dot` through byte_dots' products, on the weights as grouped_qs lays them out: each
    block's 64 rows times byte_dots.TOKENS_PER_CALL tokens at a time (the last few one by one), so
    those tokens share each weight load (and int4's nibble masks), the scales folded into the
    accumulators in registers by the same float32 expressions as `_int_dot`'s. One core, VNNI,
    before the scales moved into the products: 4.6 ns a block and token for int4 and 5.3 for int8,
    against 7.5 and 11.9 one token at a time."""
    q_x, d_x, s_x = _quantized(x)
    num_tiles, num_blocks = grouped.shape[0], grouped.shape[1]
    num_tokens, num_rows = q_x.shape[0], out_t.shape[0]
    is_int4 = grouped.shape[2] * 2 * 4 == BLOCK
    block_bytes = grouped.shape[2] * TILE * 4
    words = q_x.reshape(num_tokens * num_blocks * BLOCK).view(np.int32)   # a block's 32 int8 as 8 int32
    stride = num_blocks * 8                                               # words from one token to the next
    group = byte_dots.TOKENS_PER_CALL
    for t in prange(num_tiles):
        acc = np.zeros(num_tokens * TILE, dtype=F32)   # [tokens, TILE]
        w = grouped[t].reshape(num_blocks * block_bytes)
        for b in range(num_blocks):
            at, rows = b * block_bytes, (t * num_blocks + b) * TILE             # w's block, scales[t, b]
            for first in range(0, num_tokens, group):
                count = min(group, num_tokens - first)
                start, token = first * stride + b * 8, first * num_blocks + b    # q_x[first, b], d_x[first, b]
                if count == group and is_int4:
                    byte_dots.int4_block_fold_n(w, at, words, start, stride, scales, mins, rows, d_x, s_x, token,
                                                num_blocks, acc, first * TILE)
                elif count == group:
                    byte_dots.int8_block_fold_n(w, at, words, start, stride, scales, mins, rows, d_x, s_x, token,
                                                num_blocks, acc, first * TILE)
                else:
                    for k in range(count):
                        if is_int4:
                            byte_dots.int4_block_fold(w, at, words, start + k * stride, 0, scales, mins, rows, d_x,
                                                      s_x, token + k * num_blocks, 0, acc, (first + k) * TILE)
                        else:
                            byte_dots.int8_block_fold(w, at, words, start + k * stride, 0, scales, mins, rows, d_x,
                                                      s_x, token + k * num_blocks, 0, acc, (first + k) * TILE)
        for r in range(num_tokens):
            for i in range(min(TILE, num_rows - t * TILE)):
                out_t[t * TILE + i, r] = acc[r * TILE + i]


def int_dot_linear(x: np.ndarray, weight: QuantizedMatrix, out: np.ndarray, portable: bool = False) -> None:
    """out [tokens, rows] = x [tokens, in] times `weight` with 8-bit activations (int_dot.py);
    through the CPU's byte products where it has them (byte_dots.ISA), else, or with `portable`,
    through int16 products."""
    if BYTES and not portable:
        _int_dot_bytes(x, weight.grouped_qs, weight.scales, weight.mins, out.T)
    else:
        _int_dot(x, weight.qs, weight.scales, weight.mins, out.T)
