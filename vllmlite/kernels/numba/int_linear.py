"""The numba backend's integer-dot `linear` on quantized weights: activations rounded to 8 bits per
block, int16/int32 products, scales applied per block (the contract: vllmlite/kernels/int_dot.py).
Knows nothing of the model; `linear(..., int_dot=True)` in linear.py chooses it.

One loop order serves every token count: a work item is a tile of TILE rows (quant.py's layout,
the rows side by side), and each of its blocks (32 x TILE bytes, in L1) is multiplied by every
token's block before the next, so the weights are read from memory once whatever the batch.
The innermost loop runs over the tile's rows with one activation integer broadcast: products
fit in int16, so LLVM multiplies 32 lanes at a time (vpmullw) and widens to int32 only where a
sum could pass 32767.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from vllmlite.kernels.numba.jit import parallel
from vllmlite.kernels.quant import BLOCK, TILE, QuantizedMatrix

I16, I32, F32 = np.int16, np.int32, np.float32
HALF = BLOCK // 2


@njit(cache=True, nogil=True)   # no fastmath: x / d must round as numpy's does, not as x * (1 / d)
def _quantize_activations(x, q, d, sums):  # pragma: no cover - compiled
    """x [tokens, in] -> q int8 [tokens, blocks, 32], d float32 [tokens, blocks] (the scales) and
    sums int32 [tokens, blocks] (each block's sum of q), as int_dot.quantize_activations."""
    num_tokens, num_blocks = d.shape
    for r in range(num_tokens):
        for b in range(num_blocks):
            top = F32(0)
            for j in range(BLOCK):
                top = max(top, abs(F32(x[r, b * BLOCK + j])))
            scale = top / F32(127)
            divisor = scale if scale != 0 else F32(1)
            total = 0
            for j in range(BLOCK):
                v = min(max(np.rint(F32(x[r, b * BLOCK + j]) / divisor), F32(-127)), F32(127))
                q[r, b, j] = v
                total += I32(v)
            d[r, b], sums[r, b] = scale, total


@parallel
def _int8_dot(q_x, d_x, s_x, qs, scales, mins, out_t):  # pragma: no cover - compiled
    """out_t [rows, tokens] for int8 weights (mins None: symmetric). A pair of products fits in
    int16 (2 * 128 * 127 = 32512), so two bytes are multiplied and added in int16 and widened once."""
    num_tiles, num_blocks = qs.shape[0], qs.shape[1]
    num_tokens, num_rows = q_x.shape[0], out_t.shape[0]
    for t in prange(num_tiles):
        acc = np.empty((num_tokens, TILE), dtype=F32)
        dots = np.empty(TILE, dtype=I32)       # q_w . q_x of each row, for one block and token
        pairs = np.empty(TILE, dtype=I16)      # two bytes' products: a loop of its own stays int16
        acc[:] = 0
        for b in range(num_blocks):
            for r in range(num_tokens):
                dots[:] = 0
                for j in range(0, BLOCK, 2):
                    x0, x1 = I16(q_x[r, b, j]), I16(q_x[r, b, j + 1])
                    for i in range(TILE):
                        pairs[i] = I16(qs[t, b, j, i]) * x0 + I16(qs[t, b, j + 1, i]) * x1
                    for i in range(TILE):
                        dots[i] += I32(pairs[i])
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


@parallel
def _int4_dot(q_x, d_x, s_x, qs, scales, mins, out_t):  # pragma: no cover - compiled
    """The same for int4: byte j holds elements j (low nibble) and j + 16 (high). Sixteen
    products of a nibble (<= 15) and an int8 fit in int16 (16 * 15 * 127 = 30480), so each half
    of a block sums in int16 and is widened once."""
    num_tiles, num_blocks = qs.shape[0], qs.shape[1]
    num_tokens, num_rows = q_x.shape[0], out_t.shape[0]
    for t in prange(num_tiles):
        acc = np.empty((num_tokens, TILE), dtype=F32)
        low = np.empty(TILE, dtype=I16)
        high = np.empty(TILE, dtype=I16)
        acc[:] = 0
        for b in range(num_blocks):
            for r in range(num_tokens):
                low[:] = 0
                high[:] = 0
                for j in range(HALF):
                    x_lo, x_hi = I16(q_x[r, b, j]), I16(q_x[r, b, j + HALF])
                    for i in range(TILE):
                        q = I16(qs[t, b, j, i])
                        low[i] = I16(low[i] + (q & I16(15)) * x_lo)
                        high[i] = I16(high[i] + (q >> I16(4)) * x_hi)
                dx, dx_sum = d_x[r, b], d_x[r, b] * F32(s_x[r, b])
                for i in range(TILE):
                    acc[r, i] += scales[t, b, i] * (dx * F32(I32(low[i]) + I32(high[i]))) + mins[t, b, i] * dx_sum
        for r in range(num_tokens):
            for i in range(min(TILE, num_rows - t * TILE)):
                out_t[t * TILE + i, r] = acc[r, i]


def int_dot_linear(x: np.ndarray, weight: QuantizedMatrix, out: np.ndarray) -> None:
    """out [tokens, rows] = x [tokens, in] times `weight` with 8-bit activations (int_dot.py)."""
    num_tokens, cols = x.shape
    num_blocks = cols // BLOCK
    q_x = np.empty((num_tokens, num_blocks, BLOCK), dtype=np.int8)
    d_x = np.empty((num_tokens, num_blocks), dtype=F32)
    s_x = np.empty((num_tokens, num_blocks), dtype=I32)
    _quantize_activations(x, q_x, d_x, s_x)
    kernel = _int4_dot if weight.format == "int4" else _int8_dot
    kernel(q_x, d_x, s_x, weight.qs, weight.scales, weight.mins, out.T)
