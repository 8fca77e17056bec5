"""The numba backend's `linear`: the skinny product for a few tokens, BLAS for batches, and the quantized
products (straight from the packed bytes for a few tokens, dequantized tiles times sgemm for more).
Knows nothing of norms or attention.
"""

from __future__ import annotations

import threading

import numba
import numpy as np
from numba import prange

from vllmlite.kernels import blas, reference
from vllmlite.kernels.numba.int_linear import BYTES, int_dot_linear, rounded_activations
from vllmlite.kernels.numba.jit import parallel, serial
from vllmlite.kernels.quant import BLOCK, TILE, QuantizedMatrix

SKINNY_MAX_ROWS = 16  # tokens up to which `linear` uses the compiled product rather than BLAS

@parallel
def _skinny_linear(xt, weight, out_t):  # pragma: no cover - compiled
    """out_t[o, r] = weight[o] . x[r] for a few tokens r: each weight row is read from memory once
    and dotted with every token while it is in cache, so the cost stays close to one pass over the
    weights. Four weight rows at a time share each load of x. xt [in, tokens] and out_t [out,
    tokens] are the feature-major arrays."""
    num_out, num_in = weight.shape
    num_tokens = xt.shape[1]
    x = np.empty((num_tokens, num_in), dtype=weight.dtype)    # token-major: unit-stride dot products
    for i in range(num_in):
        for r in range(num_tokens):
            x[r, i] = xt[i, r]
    for tile in prange((num_out + 3) // 4):
        o = tile * 4
        if o + 4 <= num_out:
            for r in range(num_tokens):
                a0 = a1 = a2 = a3 = weight.dtype.type(0)
                for i in range(num_in):
                    xi = x[r, i]
                    a0 += weight[o, i] * xi
                    a1 += weight[o + 1, i] * xi
                    a2 += weight[o + 2, i] * xi
                    a3 += weight[o + 3, i] * xi
                out_t[o, r], out_t[o + 1, r], out_t[o + 2, r], out_t[o + 3, r] = a0, a1, a2, a3
        else:                                                  # the last 1-3 rows
            for row in range(o, num_out):
                for r in range(num_tokens):
                    acc = weight.dtype.type(0)
                    for i in range(num_in):
                        acc += weight[row, i] * x[r, i]
                    out_t[row, r] = acc


I32, F32 = np.int32, np.float32


@parallel
def _int4_gemv(xt, qs, scales, mins, out_t):  # pragma: no cover - compiled
    """out_t[o, r] = dequantized row o . x[r] for a few tokens, straight from the packed bytes.

    Per block, w = scale * q + min, so row . x = sum over blocks of scale * (q . x_block) +
    min * sum(x_block). One work item is a tile of rows (vllmlite/kernels/quant.py): the innermost loop
    runs over its rows, one byte each, with the activations broadcast, so LLVM vectorizes it
    with no sum across lanes. A byte q holds q_lo = q & 15 and q_hi = q >> 4, and
    q_lo * x_lo + q_hi * x_hi = q_lo * (x_lo - x_hi / 16) + q * (x_hi / 16): two conversions
    and no shift per byte (a shift made LLVM widen the lanes to 64 bits).
    """
    num_tiles, num_blocks, num_bytes = qs.shape[0], qs.shape[1], qs.shape[2]
    lanes = TILE                        # a compile-time trip count: no remainder loop, no checks
    num_tokens = xt.shape[1]
    x_lo = np.empty((num_tokens, num_blocks, num_bytes), dtype=F32)   # x_lo - x_hi / 16
    x_hi = np.empty((num_tokens, num_blocks, num_bytes), dtype=F32)   # x_hi / 16
    x_sum = np.empty((num_tokens, num_blocks), dtype=F32)   # not np.zeros: that is a parallel region
    for r in range(num_tokens):
        for b in range(num_blocks):
            x_sum[r, b] = 0
            for j in range(num_bytes):
                low, high = xt[b * 32 + j, r], xt[b * 32 + 16 + j, r]
                x_lo[r, b, j], x_hi[r, b, j] = low - high / 16, high / 16
                x_sum[r, b] += low + high
    num_rows = out_t.shape[0]
    for t in prange(num_tiles):
        acc = np.empty(lanes, dtype=F32)
        dots = np.empty(lanes, dtype=F32)   # q . x_block of each row
        for r in range(num_tokens):
            acc[:] = 0
            for b in range(num_blocks):
                dots[:] = 0
                for j in range(num_bytes):
                    lo, hi = x_lo[r, b, j], x_hi[r, b, j]
                    for i in range(lanes):
                        q = I32(qs[t, b, j, i])
                        dots[i] += F32(q & I32(15)) * lo + F32(q) * hi
                total = x_sum[r, b]
                for i in range(lanes):
                    acc[i] += scales[t, b, i] * dots[i] + mins[t, b, i] * total
            for i in range(min(lanes, num_rows - t * lanes)):
                out_t[t * lanes + i, r] = acc[i]


@parallel
def _int8_gemv(xt, qs, scales, mins, out_t):  # pragma: no cover - compiled
    """The same for int8: w = scale * q, or scale * q + min when `mins` is not None (numba
    compiles the two cases separately)."""
    num_tiles, num_blocks, block = qs.shape[0], qs.shape[1], qs.shape[2]
    lanes = TILE
    num_tokens = xt.shape[1]
    x_sum = np.empty((num_tokens if mins is not None else 0, num_blocks), dtype=F32)   # for the mins term
    for r in range(x_sum.shape[0]):
        for b in range(num_blocks):
            x_sum[r, b] = 0
            for j in range(block):
                x_sum[r, b] += xt[b * block + j, r]
    num_rows = out_t.shape[0]
    for t in prange(num_tiles):
        acc = np.empty(lanes, dtype=F32)
        dots = np.empty(lanes, dtype=F32)
        for r in range(num_tokens):
            acc[:] = 0
            for b in range(num_blocks):
                dots[:] = 0
                for j in range(block):
                    x = xt[b * block + j, r]
                    for i in range(lanes):
                        dots[i] += F32(I32(qs[t, b, j, i])) * x
                if mins is None:
                    for i in range(lanes):
                        acc[i] += scales[t, b, i] * dots[i]
                else:
                    total = x_sum[r, b]
                    for i in range(lanes):
                        acc[i] += scales[t, b, i] * dots[i] + mins[t, b, i] * total
            for i in range(min(lanes, num_rows - t * lanes)):
                out_t[t * lanes + i, r] = acc[i]


@serial
def _dequantize_int4_tile(qs, scales, mins, t, out):  # pragma: no cover - compiled
    """Tile t of an int4 matrix as float32 into out [cols, TILE], transposed and with the columns
    permuted: out[p * blocks + b, row] is element p of block b (so every store runs along the
    tile's rows). One loop per nibble (with both in one, the extra memory streams stopped LLVM
    from vectorizing it); q_hi = (q - q_lo) / 16, exact in float32, needs no shift. A whole array
    of its own, indexed from 0: writing at a column offset into a wider buffer, the offset's
    possible negative wrap-around kept LLVM from vectorizing the stores (1 G weights/s instead of
    4-5 on one core)."""
    num_blocks, num_bytes, lanes = qs.shape[1], qs.shape[2], TILE
    for b in range(num_blocks):
        for j in range(num_bytes):
            low, high = j * num_blocks + b, (j + num_bytes) * num_blocks + b
            for i in range(lanes):
                out[low, i] = scales[t, b, i] * F32(I32(qs[t, b, j, i]) & I32(15)) + mins[t, b, i]
            for i in range(lanes):
                q = I32(qs[t, b, j, i])
                out[high, i] = scales[t, b, i] * (F32(q - (q & I32(15))) * F32(0.0625)) + mins[t, b, i]


@serial
def _dequantize_int8_tile(qs, scales, mins, t, out):  # pragma: no cover - compiled
    """The same for int8 (mins None: symmetric)."""
    num_blocks, block, lanes = qs.shape[1], qs.shape[2], TILE
    for b in range(num_blocks):
        for j in range(block):
            row = j * num_blocks + b
            if mins is None:
                for i in range(lanes):
                    out[row, i] = scales[t, b, i] * F32(I32(qs[t, b, j, i]))
            else:
                for i in range(lanes):
                    out[row, i] = scales[t, b, i] * F32(I32(qs[t, b, j, i])) + mins[t, b, i]


@serial
def _dequantize_tile(qs, scales, mins, t, out):  # pragma: no cover - compiled
    """Either format: int4 bytes hold two of a block's values. (numba compiles only the branches
    that fit: none with an int4 tile when `mins` is None.)"""
    if mins is None:
        _dequantize_int8_tile(qs, scales, mins, t, out)
    elif qs.shape[2] * 2 == BLOCK:
        _dequantize_int4_tile(qs, scales, mins, t, out)
    else:
        _dequantize_int8_tile(qs, scales, mins, t, out)


@parallel
def _dequantize_tiles(qs, scales, mins, first_tile, out):  # pragma: no cover - compiled
    """Tiles first_tile .. of a quantized matrix into out [n, cols, TILE] (`_dequantize_tile`)."""
    for k in prange(out.shape[0]):
        _dequantize_tile(qs, scales, mins, first_tile + k, out[k])


@serial
def _gemm_tiles(qs, scales, mins, xp, tile, first, last, gemm):  # pragma: no cover - compiled
    """Output rows of tiles first .. last - 1 of a quantized matrix, on this thread: each tile
    dequantized into `tile` [cols, TILE], then multiplied by the activations xp [cols, tokens]
    (permuted as the tile's columns) with a one-thread sgemm. `gemm` says where the output goes
    (`_quantized_gemm`)."""
    c_address, row_bytes, num_rows, order, trans_a, trans_b, ldc = gemm
    cols, tokens = xp.shape
    for t in range(first, last):
        _dequantize_tile(qs, scales, mins, t, tile)
        lo = t * TILE
        blas.sgemm(order, trans_a, trans_b, min(TILE, num_rows - lo), tokens, cols, F32(1), tile.ctypes.data, TILE,
                   xp.ctypes.data, tokens, F32(0), c_address + lo * row_bytes, ldc)


@parallel
def _quantized_gemm(qs, scales, mins, xp, tiles, gemm):  # pragma: no cover - compiled
    """A quantized matrix times many tokens in one parallel region: each worker takes a contiguous
    share of the tiles (`_gemm_tiles`, into its own tiles[w]), so no thread waits on another pool
    between tiles."""
    num_tiles, workers = qs.shape[0], tiles.shape[0]
    for w in prange(workers):
        _gemm_tiles(qs, scales, mins, xp, tiles[w], w * num_tiles // workers, (w + 1) * num_tiles // workers, gemm)


# Tokens up to which quantized products read the packed bytes directly; beyond, each core
# dequantizes tiles for a one-thread sgemm (`_quantized_gemm`). Over the default model's matrices
# (Q4_1 layers, Q8_0 LM head; 2 AVX2 cores, weights streamed from memory; `python -m
# bench.quant_bench` at b4f77e2) the packed-bytes kernel took 0.44x float32's time at 1 token,
# 0.69x at 2, 0.90x at 4 and 0.98x at 8: it converts every weight for every token. Over the
# whole model at 12 tokens the tiles took 0.8x the packed-bytes kernel's time (scratch A/B runs,
# one core each), and 1.18x float32's at 16 tokens, 1.27x at 64.
QUANTIZED_FEW_ROWS = 8
# Tokens from which `linear(..., int_dot=True)` runs the integer kernel (int_linear.py); below, the
# rounded activations go through the packed-bytes kernels above, the same function up to float32
# rounding. With byte products the integer kernel was as fast or faster from 1 token on (`python -m
# bench.int_dot`): with AVX-512 VNNI (results/int_dot.json, int4: 0.23-1.02x float32's time at 1
# token where the rounded activations through the packed bytes took 0.26-1.09x; 0.38-0.52x at 32
# tokens), with AVX2 (results/int_dot_avx2.json, int4: 0.15-0.65x at 1 token against 0.33-1.20x;
# 0.46-0.62x at 32). The portable int16 form, on the VNNI machine, was about even with them at
# 4-8 tokens (0.83-0.98x against 0.85-1.05x) and faster from 16 (0.77-1.23x against 1.17-1.58x).
INT_DOT_MIN_ROWS = 1 if BYTES else 9
DEQUANTIZE_TILES = 8  # tiles dequantized at a time for np.matmul, when numpy's BLAS is not OpenBLAS
_scratch = threading.local()  # per thread: the float32 tiles dequantized into, reused across calls


def linear(x: np.ndarray, weight: np.ndarray | QuantizedMatrix, out: np.ndarray, int_dot: bool = False) -> None:
    """BLAS for batches; for up to SKINNY_MAX_ROWS tokens (a lone decode, speculative verification,
    a small batch) the compiled product above, which reads the weights once: over the default
    model's weights on 2 AVX2 cores it took 66-93 ms at 4-16 tokens where OpenBLAS's GEMM took
    97-104 ms (and about as long as one token at 2-3); BLAS wins from about 24 tokens. Quantized
    weights go their own way (`_quantized_linear`), or with `int_dot` (off by default: it rounds
    the activations to 8 bits too) through integer dot products (int_linear.py); `int_dot`
    changes nothing for float weights."""
    if isinstance(weight, QuantizedMatrix):
        if int_dot and x.shape[0] >= INT_DOT_MIN_ROWS:
            int_dot_linear(x, weight, out)
        elif int_dot:    # the same function: these floats are the rounded activations
            _quantized_linear(rounded_activations(x), weight, out)
        else:
            _quantized_linear(x, weight, out)
    elif x.shape[0] <= SKINNY_MAX_ROWS:
        _skinny_linear(x.T, weight, out.T)
    else:
        reference.linear(x, weight, out)


def _quantized_linear(x: np.ndarray, weight: QuantizedMatrix, out: np.ndarray) -> None:
    """A few tokens: straight from the packed bytes. More: tiles dequantized into a cache-sized
    float32 buffer and multiplied there by BLAS; no float copy of the whole matrix."""
    xt = np.ascontiguousarray(x.T, dtype=np.float32)     # [in, tokens]; a view for workspace rows
    out_t = out.T
    num_tokens = x.shape[0]
    if num_tokens <= QUANTIZED_FEW_ROWS:
        if weight.format == "int4":
            _int4_gemv(xt, weight.qs, weight.scales, weight.mins, out_t)
        else:
            _int8_gemv(xt, weight.qs, weight.scales, weight.mins, out_t)
        return
    rows, cols = weight.shape
    # The activations with their rows in the order of the dequantized columns (element p of block b
    # at p * blocks + b).
    permuted = np.ascontiguousarray(xt.reshape(-1, BLOCK, num_tokens).transpose(1, 0, 2)).reshape(cols, num_tokens)
    gemm = _gemm_output(out_t) if blas.AVAILABLE else None
    if gemm is not None:
        workers = numba.get_num_threads()
        with blas.one_thread():
            _quantized_gemm(weight.qs, weight.scales, weight.mins, permuted, _tiles(workers, cols), gemm)
        return
    num_tiles = weight.qs.shape[0]   # another BLAS: batches of tiles, each batch one np.matmul
    for first in range(0, num_tiles, DEQUANTIZE_TILES):
        tiles = _tiles(min(DEQUANTIZE_TILES, num_tiles - first), cols)
        _dequantize_tiles(weight.qs, weight.scales, weight.mins, first, tiles)
        lo, hi = first * TILE, min(rows, (first + len(tiles)) * TILE)
        out_t[lo:hi] = np.matmul(tiles.transpose(0, 2, 1), permuted).reshape(-1, num_tokens)[:hi - lo]


def _gemm_output(out_t: np.ndarray) -> tuple[int, ...] | None:
    """Where `_quantized_gemm` writes out_t [rows, tokens]: its address, the bytes from one row to
    the next, its rows, and the sgemm layout that writes it in place (rows or tokens contiguous;
    the leading dimension is at least the contiguous extent, whatever the strides of a single row
    or column say); None for any other layout."""
    if out_t.dtype != np.float32:
        return None
    step = out_t.itemsize
    if out_t.strides[1] == step:     # the workspace's feature-major buffers
        layout = (blas.ROW_MAJOR, blas.TRANS, blas.NO_TRANS, max(out_t.strides[0] // step, out_t.shape[1]))
    elif out_t.strides[0] == step:   # token-major, as the logits are
        layout = (blas.COL_MAJOR, blas.NO_TRANS, blas.TRANS, max(out_t.strides[1] // step, out_t.shape[0]))
    else:
        return None
    return (out_t.ctypes.data, out_t.strides[0], out_t.shape[0], *layout)


def _tiles(count: int, cols: int) -> np.ndarray:
    """`count` float32 tiles [cols, TILE] in this thread's scratch, allocated once, so a step does
    not page-fault fresh memory in for every matrix."""
    size = count * cols * TILE
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.size < size:
        buffer = _scratch.buffer = np.empty(size, dtype=np.float32)
    return buffer[:size].reshape(count, cols, TILE)
