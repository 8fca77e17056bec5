"""The compiled kernels (numba, cached on disk): the same operations as `reference.py`, same
arguments, same results within float rounding. The default backend.

Every function is compiled for float32 and float64 arrays on first call (`LlamaModel.warm_up` makes that happen at start-up) and the
machine code is cached next to this file (or in NUMBA_CACHE_DIR), so a second start does not
recompile. Loops release the GIL (`nogil`), so the HTTP thread keeps running while they do.
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
from numba import njit, prange

from vllmlite.kernels.attention_metadata import MAX_BATCHED_QUERY_LEN, AttentionMetadata
from vllmlite.kernels import blas, reference
from vllmlite.kernels.reference import copy_slots, empty, host_zeros, to_device, to_numpy, zeros  # noqa: F401 (numpy memory)
from vllmlite.kernels.prefill_attention import prepare_chunk
from vllmlite.kernels.quant import BLOCK, TILE, QuantizedMatrix

# Floating-point reassociation lets LLVM vectorize the dot products and sums; no "ninf"/"nnan",
# because the online softmax starts from -inf on purpose.
FASTMATH = {"reassoc", "contract", "arcp", "nsz"}

SKINNY_MAX_ROWS = 16  # tokens up to which `linear` uses the compiled product rather than BLAS
SERIAL_MAX_TOKENS = 8  # tokens up to which SiLU runs on one thread (waking the others costs more)

_serial = njit(cache=True, nogil=True, fastmath=FASTMATH)
_parallel = njit(cache=True, nogil=True, fastmath=FASTMATH, parallel=True)


# The model's activations are token-major views of C-contiguous feature-major arrays (see
# model.Workspace): the wrappers below hand the elementwise kernels those arrays (x.T, [features,
# tokens]), so their inner loops walk tokens with unit stride, known to the compiler.


@_serial
def _rms_norm(xt, weight, eps, out_t):  # pragma: no cover - compiled
    hidden, num_tokens = xt.shape
    total = np.zeros(num_tokens, dtype=xt.dtype)
    for j in range(hidden):
        for i in range(num_tokens):
            total[i] += xt[j, i] * xt[j, i]
    for i in range(num_tokens):
        total[i] = 1 / math.sqrt(total[i] / hidden + eps)
    for j in range(hidden):
        for i in range(num_tokens):
            out_t[j, i] = xt[j, i] * total[i] * weight[j]


@_serial
def _add_rms_norm(xt, residual_t, weight, eps, out_t):  # pragma: no cover - compiled
    hidden, num_tokens = xt.shape
    for j in range(hidden):
        for i in range(num_tokens):
            residual_t[j, i] += xt[j, i]
    _rms_norm(residual_t, weight, eps, out_t)


@_parallel
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


@_parallel
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


@_parallel
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


@_serial
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


@_serial
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


@_serial
def _dequantize_tile(qs, scales, mins, t, out):  # pragma: no cover - compiled
    """Either format: int4 bytes hold two of a block's values. (numba compiles only the branches
    that fit: none with an int4 tile when `mins` is None.)"""
    if mins is None:
        _dequantize_int8_tile(qs, scales, mins, t, out)
    elif qs.shape[2] * 2 == BLOCK:
        _dequantize_int4_tile(qs, scales, mins, t, out)
    else:
        _dequantize_int8_tile(qs, scales, mins, t, out)


@_parallel
def _dequantize_tiles(qs, scales, mins, first_tile, out):  # pragma: no cover - compiled
    """Tiles first_tile .. of a quantized matrix into out [n, cols, TILE] (`_dequantize_tile`)."""
    for k in prange(out.shape[0]):
        _dequantize_tile(qs, scales, mins, first_tile + k, out[k])


@_serial
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


@_parallel
def _quantized_gemm(qs, scales, mins, xp, tiles, gemm):  # pragma: no cover - compiled
    """A quantized matrix times many tokens in one parallel region: each worker takes a contiguous
    share of the tiles (`_gemm_tiles`, into its own tiles[w]), so no thread waits on another pool
    between tiles."""
    num_tiles, workers = qs.shape[0], tiles.shape[0]
    for w in prange(workers):
        _gemm_tiles(qs, scales, mins, xp, tiles[w], w * num_tiles // workers, (w + 1) * num_tiles // workers, gemm)


@_serial
def _rope(x, positions, cos, sin):  # pragma: no cover - compiled
    num_tokens, num_heads, head_dim = x.shape
    half = head_dim // 2
    for h in range(num_heads):
        for j in range(half):
            for i in range(num_tokens):
                x1, x2 = x[i, h, j], x[i, h, j + half]
                c, s = cos[positions[i], j], sin[positions[i], j]
                x[i, h, j] = x1 * c - x2 * s
                x[i, h, j + half] = x2 * c + x1 * s


@_serial
def _silu_and_mul_rows(gate_up_t, out_t, first, last):  # pragma: no cover - compiled
    inter, num_tokens = out_t.shape
    for j in range(first, last):
        for i in range(num_tokens):
            g = gate_up_t[j, i]
            out_t[j, i] = g / (1 + math.exp(-g)) * gate_up_t[j + inter, i]   # exp(-g) = inf gives -0


@_parallel
def _silu_and_mul(gate_up_t, out_t):  # pragma: no cover - compiled
    inter = out_t.shape[0]
    for part in prange((inter + 63) // 64):
        _silu_and_mul_rows(gate_up_t, out_t, part * 64, min(inter, part * 64 + 64))


@_serial
def _write_kv(k_cache, v_cache, k, v, slot_mapping):  # pragma: no cover - compiled
    num_tokens, num_kv_heads, head_dim = k.shape
    for i in range(num_tokens):
        slot = slot_mapping[i]
        for h in range(num_kv_heads):
            for d in range(head_dim):
                k_cache[slot, h, d] = k[i, h, d]
                v_cache[slot, h, d] = v[i, h, d]


@_serial
def _attend_tile(q, k_cache, v_cache, block_table, block_size, row0, num_queries, pos0, scale,
                 out):  # pragma: no cover - compiled
    """Queries row0 .. row0 + num_queries - 1 of one sequence (at positions pos0 ..), all heads,
    over the sequence's keys up to their own positions, read in place through `block_table` one
    block at a time with an online softmax: one pass over K/V, no score matrix beyond a block.

    The work is laid out per KV head: the rows sharing KV head h (each query's `group` heads) sit
    together in qt[h], acc[h], so GQA reads each K/V vector once for all of them and the inner
    loops are plain contiguous dot products and AXPYs that LLVM vectorizes. Its own function (not
    inlined in the prange body) so that it does.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    num_rows = num_queries * group              # per KV head; row i: query i // group, head h * group + i % group
    qt = np.empty((num_kv_heads, num_rows, head_dim), dtype=k_cache.dtype)   # scaled queries
    for h in range(num_kv_heads):
        for i in range(num_rows):
            for d in range(head_dim):
                qt[h, i, d] = q[row0 + i // group, h * group + i % group, d] * scale
    acc = np.zeros((num_kv_heads, num_rows, head_dim), dtype=k_cache.dtype)  # sum of p * v
    total = np.zeros((num_kv_heads, num_rows), dtype=k_cache.dtype)          # sum of p
    best = np.full((num_kv_heads, num_rows), -np.inf, dtype=k_cache.dtype)   # running max score
    probs = np.empty((num_kv_heads, num_rows, block_size), dtype=k_cache.dtype)  # this block's
    last_pos = pos0 + num_queries - 1
    for b in range(last_pos // block_size + 1):
        base = block_table[b] * block_size                              # the block's first slot
        first_pos = b * block_size
        num_keys = min(block_size, last_pos - first_pos + 1)
        # Key t of the block is seen by the rows of queries at or after its position (causal);
        # the rows before them get -inf, so exp gives them 0.
        for t in range(num_keys):
            first_row = min(max(0, first_pos + t - pos0) * group, num_rows)
            for h in range(num_kv_heads):
                key = k_cache[base + t, h]
                for i in range(first_row):
                    probs[h, i, t] = -np.inf
                for i in range(first_row, num_rows):
                    dot = qt[h, i, 0] * key[0]
                    for d in range(1, head_dim):
                        dot += qt[h, i, d] * key[d]
                    probs[h, i, t] = dot
        for h in range(num_kv_heads):
            for i in range(num_rows):
                top = best[h, i]
                for t in range(num_keys):
                    top = max(top, probs[h, i, t])
                rescale = math.exp(best[h, i] - top)                    # 0 on the first block
                best[h, i] = top
                row_total = total[h, i] * rescale
                for t in range(num_keys):
                    p = math.exp(probs[h, i, t] - top)
                    probs[h, i, t] = p
                    row_total += p
                total[h, i] = row_total
                if rescale != 1:                                        # the max moved
                    for d in range(head_dim):
                        acc[h, i, d] *= rescale
        for t in range(num_keys):
            first_row = min(max(0, first_pos + t - pos0) * group, num_rows)
            for h in range(num_kv_heads):
                value = v_cache[base + t, h]
                for i in range(first_row, num_rows):
                    p = probs[h, i, t]
                    for d in range(head_dim):
                        acc[h, i, d] += p * value[d]
    for h in range(num_kv_heads):
        for i in range(num_rows):
            inv = 1 / total[h, i]
            for d in range(head_dim):
                out[row0 + i // group, h * group + i % group, d] = acc[h, i, d] * inv


# Keys per work item of a decoding sequence: a decode's context is split into parts this long,
# attended in parallel and combined (flash-decoding), so a lone long sequence uses every core. The
# parts depend only on the sequence's own length, never on the batch around it.
DECODE_PART = 256


@_serial
def _attend_keys(q, k_cache, v_cache, block_table, block_size, first, last, scale, acc, best,
                 total):  # pragma: no cover - compiled
    """One query q [heads, head_dim] (a decode) over keys first .. last - 1 of its sequence, read in
    place through `block_table`: acc[h] = sum of p * v, best[h] = the largest score, total[h] =
    sum of p, with p = exp(score - best[h]), for `_paged_attention` to combine across parts. All
    scores of the part are kept (heads x DECODE_PART floats), so the softmax takes two plain passes
    and each K and V vector is read once for the `group` query heads sharing it."""
    num_heads, head_dim = q.shape
    group = num_heads // k_cache.shape[1]
    num_keys = last - first
    qs = np.empty((num_heads, head_dim), dtype=k_cache.dtype)
    for h in range(num_heads):
        for d in range(head_dim):
            qs[h, d] = q[h, d] * scale
    scores = np.empty((num_heads, num_keys), dtype=k_cache.dtype)
    for t in range(num_keys):
        pos = first + t
        slot = block_table[pos // block_size] * block_size + pos % block_size
        for h in range(num_heads):
            key = k_cache[slot, h // group]
            dot = qs[h, 0] * key[0]
            for d in range(1, head_dim):
                dot += qs[h, d] * key[d]
            scores[h, t] = dot
    for h in range(num_heads):
        top = scores[h, 0]
        for t in range(1, num_keys):
            top = max(top, scores[h, t])
        row_total = k_cache.dtype.type(0)
        for t in range(num_keys):
            p = math.exp(scores[h, t] - top)
            scores[h, t] = p
            row_total += p
        best[h], total[h] = top, row_total
        acc[h, :] = 0
    for t in range(num_keys):
        pos = first + t
        slot = block_table[pos // block_size] * block_size + pos % block_size
        for h in range(num_heads):
            value = v_cache[slot, h // group]
            p = scores[h, t]
            for d in range(head_dim):
                acc[h, d] += p * value[d]


@_serial
def _decode_parts(query_start, seq_lens):  # pragma: no cover - compiled
    """The work items of `_paged_attention`: sequence s owns items first_item[s] ..
    first_item[s + 1] - 1, and item i belongs to sequence item_seq[i]. A decode (one query) gets
    one item per DECODE_PART keys of its context, any other sequence one item. (Serial: inside a
    parallel function numba would run each of these array operations as a parallel region.)"""
    num_seqs = seq_lens.shape[0]
    first_item = np.empty(num_seqs + 1, dtype=np.int64)
    first_item[0] = 0
    for s in range(num_seqs):
        decode = query_start[s + 1] - query_start[s] == 1
        first_item[s + 1] = first_item[s] + ((seq_lens[s] + DECODE_PART - 1) // DECODE_PART if decode else 1)
    item_seq = np.empty(first_item[num_seqs], dtype=np.int64)
    for s in range(num_seqs):
        for i in range(first_item[s], first_item[s + 1]):
            item_seq[i] = s
    return first_item, item_seq


@_serial
def _combine_parts(query_start, first_item, acc, best, total, out):  # pragma: no cover - compiled
    """Each decode's output from its parts: their sums rescaled to the largest max of them."""
    num_heads, head_dim = acc.shape[1], acc.shape[2]
    for s in range(first_item.shape[0] - 1):
        if query_start[s + 1] - query_start[s] != 1:
            continue
        row, first, last = query_start[s], first_item[s], first_item[s + 1]
        for h in range(num_heads):
            top = best[first, h]
            for i in range(first + 1, last):
                top = max(top, best[i, h])
            denominator = acc.dtype.type(0)
            for d in range(head_dim):
                out[row, h, d] = 0
            for i in range(first, last):
                weight = math.exp(best[i, h] - top)
                denominator += weight * total[i, h]
                for d in range(head_dim):
                    out[row, h, d] += weight * acc[i, h, d]
            inv = 1 / denominator
            for d in range(head_dim):
                out[row, h, d] *= inv


@_parallel
def _paged_attention(q, k_cache, v_cache, query_start, seq_lens, block_tables, block_size, max_queries, scale,
                     first_item, item_seq, out):  # pragma: no cover - compiled
    """Work items (`_decode_parts`) spread over threads: a decode (one query) is one item per
    DECODE_PART keys of its context, combined afterwards; a sequence with 2 .. `max_queries`
    queries is one item (`_attend_tile`). Sequences with more queries are left to the caller."""
    num_items = item_seq.shape[0]
    acc = np.empty((num_items, q.shape[1], q.shape[2]), dtype=k_cache.dtype)
    best = np.empty((num_items, q.shape[1]), dtype=k_cache.dtype)
    total = np.empty((num_items, q.shape[1]), dtype=k_cache.dtype)
    for item in prange(num_items):
        s = item_seq[item]
        num_queries = query_start[s + 1] - query_start[s]
        if num_queries == 1:
            first = (item - first_item[s]) * DECODE_PART
            _attend_keys(q[query_start[s]], k_cache, v_cache, block_tables[s], block_size, first,
                         min(seq_lens[s], first + DECODE_PART), scale, acc[item], best[item], total[item])
        elif num_queries <= max_queries:
            _attend_tile(q, k_cache, v_cache, block_tables[s], block_size, query_start[s], num_queries,
                         seq_lens[s] - num_queries, scale, out)
    _combine_parts(query_start, first_item, acc, best, total, out)


# Tokens up to which quantized products read the packed bytes directly; beyond, each core
# dequantizes tiles for a one-thread sgemm (`_quantized_gemm`). Over the default model's matrices
# (Q4_1 layers, Q8_0 LM head; 2 AVX2 cores, weights streamed from memory; `python -m
# bench.quant_bench` at b4f77e2) the packed-bytes kernel took 0.44x float32's time at 1 token,
# 0.69x at 2, 0.90x at 4 and 0.98x at 8: it converts every weight for every token. Over the
# whole model at 12 tokens the tiles took 0.8x the packed-bytes kernel's time (scratch A/B runs,
# one core each), and 1.18x float32's at 16 tokens, 1.27x at 64.
QUANTIZED_FEW_ROWS = 8
DEQUANTIZE_TILES = 8  # tiles dequantized at a time for np.matmul, when numpy's BLAS is not OpenBLAS
_scratch = threading.local()  # per thread: the float32 tiles dequantized into, reused across calls


def linear(x: np.ndarray, weight: np.ndarray | QuantizedMatrix, out: np.ndarray) -> None:
    """BLAS for batches; for up to SKINNY_MAX_ROWS tokens (a lone decode, speculative verification,
    a small batch) the compiled product above, which reads the weights once: over the default
    model's weights on 2 AVX2 cores it took 66-93 ms at 4-16 tokens where OpenBLAS's GEMM took
    97-104 ms (and about as long as one token at 2-3); BLAS wins from about 24 tokens. Quantized
    weights go their own way (`_quantized_linear`)."""
    if isinstance(weight, QuantizedMatrix):
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


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray) -> None:
    _rms_norm(x.T, weight, eps, out.T)


def add_rms_norm(x: np.ndarray, residual: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray) -> None:
    _add_rms_norm(x.T, residual.T, weight, eps, out.T)


def rope(x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> None:
    _rope(x, positions, cos, sin)


def silu_and_mul(gate_up: np.ndarray, out: np.ndarray) -> None:
    """On one thread for a few tokens: waking the other threads cost more than the work (a lone
    decode's 1536 values: ~25-45 us in parallel)."""
    if gate_up.shape[0] <= SERIAL_MAX_TOKENS:
        _silu_and_mul_rows(gate_up.T, out.T, 0, out.shape[1])
    else:
        _silu_and_mul(gate_up.T, out.T)


def write_kv(k_cache: np.ndarray, v_cache: np.ndarray, k: np.ndarray, v: np.ndarray,
             slot_mapping: np.ndarray) -> None:
    _write_kv(k_cache, v_cache, k, v, slot_mapping)


def paged_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, meta: AttentionMetadata,
                    out: np.ndarray) -> None:
    """Decodes and short queries (speculative verification, short chunks) in the compiled kernel;
    each long prefill chunk in query tiles with BLAS products (prefill_attention.py), since the
    kernel's inner loops ran there at about half BLAS speed (48 vs 24 ms a layer for a 512-token
    prompt). A long chunk's work grows with its queries times its context, its gathered copy of
    the context only with its context.

    The tiles run on threads of their own, each with a one-thread OpenBLAS (`_attend_long_chunks`):
    their products are small (a tile's rows by its keys, 64 deep), and OpenBLAS splitting each of
    them over the cores lost time, much of it while another process held a core (one layer at
    2048 tokens, tiles of 128, load average 2-3 on 2 cores: median 751 ms so, 173 on one OpenBLAS
    thread), where whole tiles per thread nearly halve it (one layer of SmolLM2 at 2048 tokens,
    quiet machine: 108 ms on one thread, 56 on two, the dense reference 253; `python -m
    bench.prefill_attention`)."""
    scale = q.dtype.type(1.0 / math.sqrt(q.shape[-1]))
    parts = meta.kernel_cache.get("decode_parts")
    if parts is None:   # the same for every layer of the step
        parts = meta.kernel_cache["decode_parts"] = _decode_parts(meta.query_start, meta.seq_lens)
    _paged_attention(q, k_cache, v_cache, meta.query_start, meta.seq_lens, meta.block_tables,
                     meta.block_size, MAX_BATCHED_QUERY_LEN, scale, *parts, out)
    if len(meta.long_seqs):
        _attend_long_chunks(q, k_cache, v_cache, meta, out)


# Query-key pairs per tile (`Chunk.num_pairs` over the step's tiles) from which a step's long
# chunks are attended on several threads: below, handing tiles to threads and back cost about what
# the second core gave. One SmolLM2 layer's paged_attention, 2 cores, two threads vs one: a
# 256-token prompt (2,741 pairs a tile) 4.1 vs 3.6 ms, 512 tokens (5,472) 13.9 vs 13.4, 768 tokens
# (8,203) 26.5 vs 31.3, 1024 tokens 23 vs 40, a 256-token chunk after 1792 tokens (40,971) 29 vs 41.
# Over the whole model (30 layers, `model.forward`): a 16-token chunk after 2000 tokens (10,712)
# 126 vs 138 ms, 64 after 2000 (43,360) 314 vs 333, 64 after 500 (11,360) 173 vs 181.
PARALLEL_MIN_TILE_PAIRS = 8192

# Threads that attend long chunks' tiles (`_attend_long_chunks`); started on first use.
_tile_workers = ThreadPoolExecutor(max_workers=numba.config.NUMBA_NUM_THREADS, thread_name_prefix="vllmlite-attention")


def _attend_long_chunks(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, meta: AttentionMetadata,
                        out: np.ndarray) -> None:
    """The tiles of every long chunk (prefill_attention.py) dealt round robin, tile by tile, to as
    many threads as numba uses, which run them at once: numpy's products and loops release the
    GIL. Round robin evens out the work, which grows with each tile's keys."""
    chunks = [prepare_chunk(q, k_cache, v_cache, meta, int(seq)) for seq in meta.long_seqs]
    work = [(chunk, h, t0) for chunk in chunks for h, t0 in chunk.tiles]
    num_pairs = sum(chunk.num_pairs for chunk in chunks)
    parallel = num_pairs >= PARALLEL_MIN_TILE_PAIRS * len(work)
    num_workers = min(numba.get_num_threads(), len(work)) if parallel else 1

    def attend_share(worker: int) -> None:
        for chunk, h, t0 in work[worker::num_workers]:
            chunk.attend_tile(h, t0, out)

    with blas.one_thread():
        if num_workers == 1:
            attend_share(0)
        else:
            list(_tile_workers.map(attend_share, range(num_workers)))
