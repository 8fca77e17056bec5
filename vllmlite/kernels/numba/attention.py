"""The numba backend's paged attention: decodes and short queries in one compiled kernel (a decode's
context split into parts attended in parallel, flash-decoding), long prefill chunks in query tiles
with BLAS products on threads of their own (prefill_attention.py). Knows nothing of the other ops.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
from numba import prange

from vllmlite.kernels import blas, kv_dtype
from vllmlite.kernels.attention_metadata import MAX_BATCHED_QUERY_LEN, AttentionMetadata, check_attention_options
from vllmlite.kernels.numba import block_products as blocks
from vllmlite.kernels.numba.block_products import block_scores, block_values, packed_scores, packed_values, reads_packed
from vllmlite.kernels.numba.elementwise import round_queries
from vllmlite.kernels.numba.fast_exp import exp_shifted
from vllmlite.kernels.numba.hadamard import turn_heads
from vllmlite.kernels.numba.jit import parallel, serial
from vllmlite.kernels.numba.kv_read import block_scratch, cache_arrays, load_block, prefetch_block
from vllmlite.kernels.prefill_attention import prepare_chunk


@serial
def _attend_tile(q, k_cache, v_cache, block_table, block_size, row0, num_queries, pos0, scale, window, softcap,
                 out):  # pragma: no cover - compiled
    """Queries row0 .. row0 + num_queries - 1 of one sequence (at positions pos0 ..), all heads,
    over the sequence's keys up to their own positions (and after their position - window), read
    in place through `block_table` one block at a time, from the block holding the first query's
    first key, with an online softmax: one pass over K/V, no score matrix beyond a block.

    The work is laid out per KV head: the rows sharing KV head h (each query's `group` heads) sit
    together in qt[h], acc[h], so GQA reads each K/V vector once for all of them and the inner
    loops are plain contiguous dot products and AXPYs that LLVM vectorizes. Its own function (not
    inlined in the prange body) so that it does.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    (k_data, k_scales), (v_data, v_scales) = k_cache, v_cache
    num_kv_heads = k_data.shape[1]
    group = num_heads // num_kv_heads
    num_rows = num_queries * group              # per KV head; row i: query i // group, head h * group + i % group
    qt = np.empty((num_kv_heads, num_rows, head_dim), dtype=q.dtype)   # scaled queries
    for h in range(num_kv_heads):
        for i in range(num_rows):
            for d in range(head_dim):
                qt[h, i, d] = q[row0 + i // group, h * group + i % group, d] * scale
    acc = np.zeros((num_kv_heads, num_rows, head_dim), dtype=q.dtype)  # sum of p * v
    total = np.zeros((num_kv_heads, num_rows), dtype=q.dtype)          # sum of p
    best = np.full((num_kv_heads, num_rows), -np.inf, dtype=q.dtype)   # running max score
    probs = np.empty((num_kv_heads, num_rows, block_size), dtype=q.dtype)  # this block's
    powers = np.empty(block_size, np.int32)                            # exp_shifted's scratch
    scratch = block_scratch(q, block_size, num_kv_heads)
    last_pos = pos0 + num_queries - 1
    first_block = 0 if window is None else max(0, pos0 - window + 1) // block_size
    for b in range(first_block, last_pos // block_size + 1):
        base = block_table[b] * block_size                              # the block's first slot
        first_pos = b * block_size
        num_keys = min(block_size, last_pos - first_pos + 1)
        if b < last_pos // block_size:   # the next block on its way
            prefetch_block(k_data, k_scales, block_table[b + 1] * block_size, block_size)
            prefetch_block(v_data, v_scales, block_table[b + 1] * block_size, block_size)
        keys = load_block(k_data, k_scales, base, num_keys, scratch)
        # Key t of the block is seen by the rows of queries at or after its position (causal) and
        # before its position + window; the other rows get -inf, so exp gives them 0.
        for t in range(num_keys):
            first_row = min(max(0, first_pos + t - pos0) * group, num_rows)
            end_row = num_rows if window is None else min(max(0, first_pos + t + window - pos0) * group, num_rows)
            for h in range(num_kv_heads):
                key = keys[t, h]
                for i in range(first_row):
                    probs[h, i, t] = -np.inf
                for i in range(end_row, num_rows):
                    probs[h, i, t] = -np.inf
                for i in range(first_row, end_row):
                    dot = q.dtype.type(0)
                    for d in range(head_dim):
                        dot += qt[h, i, d] * key[d]
                    probs[h, i, t] = dot
        if softcap is not None:   # a pass of its own over the scores just made
            for t in range(num_keys):
                first_row = min(max(0, first_pos + t - pos0) * group, num_rows)
                end_row = num_rows if window is None else min(max(0, first_pos + t + window - pos0) * group, num_rows)
                for h in range(num_kv_heads):
                    for i in range(first_row, end_row):
                        probs[h, i, t] = softcap * math.tanh(probs[h, i, t] / softcap)
        for h in range(num_kv_heads):
            for i in range(num_rows):
                top = best[h, i]
                for t in range(num_keys):
                    top = max(top, probs[h, i, t])
                if window is not None and top == -np.inf:   # a later query whose window starts past this block
                    for t in range(num_keys):
                        probs[h, i, t] = 0
                    continue
                rescale = math.exp(best[h, i] - top)                    # 0 on the first block
                best[h, i] = top
                exp_shifted(probs[h, i], top, num_keys, powers)
                row_total = total[h, i] * rescale
                for t in range(num_keys):
                    row_total += probs[h, i, t]
                total[h, i] = row_total
                if rescale != 1:                                        # the max moved
                    for d in range(head_dim):
                        acc[h, i, d] *= rescale
        values = load_block(v_data, v_scales, base, num_keys, scratch)
        for t in range(num_keys):
            first_row = min(max(0, first_pos + t - pos0) * group, num_rows)
            end_row = num_rows if window is None else min(max(0, first_pos + t + window - pos0) * group, num_rows)
            for h in range(num_kv_heads):
                value = values[t, h]
                for i in range(first_row, end_row):
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
# parts depend only on the sequence's own length (and window), never on the batch around it.
DECODE_PART = 256
# A decode's last part takes in up to this many keys past its DECODE_PART instead of being a part
# of its own: at 513 keys (a 512-token context and the new token) a third part of one key cost its
# scratch and a work item per sequence and layer.
DECODE_PART_SLACK = 64


@serial
def _num_parts(num_keys):  # pragma: no cover - compiled
    """Parts of a decode over num_keys keys: DECODE_PART each, the last up to DECODE_PART +
    DECODE_PART_SLACK. 1 .. 320 keys -> 1, 321 .. 576 -> 2, 577 .. 832 -> 3."""
    return max(1, (num_keys - 1 - DECODE_PART_SLACK) // DECODE_PART + 1)


@serial
def _run(block_table, block_size, pos, last):  # pragma: no cover - compiled
    """(first slot, length) of the keys from pos to the end of its block or to last - 1."""
    return block_table[pos // block_size] * block_size + pos % block_size, min(block_size - pos % block_size, last - pos)


@serial
def _prefetch_share(data, scales, slot, num, share, shares):  # pragma: no cover - compiled
    """Prefetches share `share` of `shares` of the run of num slots from slot (kv_read.prefetch_block).
    The decode kernel spreads a block's prefetches over its KV heads' products instead of issuing
    them all at once: a burst of a block's 60 cache lines stalled the core until the lines were on
    their way, about as long as the reads themselves took. Attention in the int8 32 x 512 step of
    the default model (30 layers, 2-core EPYC): 43.7 -> 34.6 and 46.7 -> 42.7 ms, alternated in one
    process."""
    lo, hi = share * num // shares, (share + 1) * num // shares
    prefetch_block(data, scales, slot + lo, hi - lo)


@serial
def _attend_keys(q, rounding, row, k_cache, v_cache, block_table, block_size, first, last, scale, softcap, acc,
                 best, total):  # pragma: no cover - compiled
    """One query q [heads, head_dim] (a decode) over keys first .. last - 1 of its sequence, read in
    place through `block_table`: acc[h] = sum of p * v, best[h] = the largest score, total[h] =
    sum of p, with p = exp(score - best[h]), for `_paged_attention` to combine across parts. All
    scores of the part are kept (heads x up to DECODE_PART + DECODE_PART_SLACK floats), so the softmax takes two plain passes
    (exp_shifted's vectors) and each K and V vector is read once, a block at a time (load_block
    widens a packed one, or the int8 products read it in place), for the `group` query heads sharing it.
    rounding, row: `_paged_attention`'s rounding and q's row in it, for integer products on int8 keys."""
    num_heads, head_dim = q.shape
    (k_data, k_scales), (v_data, v_scales) = k_cache, v_cache
    num_kv_heads = k_data.shape[1]
    group = num_heads // num_kv_heads
    num_keys = last - first
    qs = q * scale
    scores = np.empty((num_heads, num_keys), dtype=q.dtype)
    scratch = block_scratch(q, block_size, num_kv_heads)
    packed = reads_packed(q, k_data)   # int8 read in place by the products, else widened here a block at a time
    words, word_scales = blocks.integer_queries(rounding, row, scale)
    pos = first
    while pos < last:   # the keys, a block (or the part of one in first .. last - 1) at a time
        slot, num = _run(block_table, block_size, pos, last)
        if pos + num < last:   # the next block's keys, else the first values, on their way
            next_data, next_scales, next_pos = k_data, k_scales, pos + num
        else:
            next_data, next_scales, next_pos = v_data, v_scales, first
        next_slot, next_num = _run(block_table, block_size, next_pos, last)
        # (not load_block of no slots: its ravel of an empty run still cost numba a reshape call,
        # 5-6% of the int8 32 x 513 attention)
        keys = scratch[:0] if packed else load_block(k_data, k_scales, slot, num, scratch)
        for kv in range(num_kv_heads):
            _prefetch_share(next_data, next_scales, next_slot, next_num, kv, num_kv_heads)
            if packed:
                packed_scores(qs, words, word_scales, k_data, k_scales, slot, num, kv, group, scores, pos - first)
            else:
                block_scores(qs, keys, kv, group, scores, pos - first)
        pos += num
    if softcap is not None:
        for h in range(num_heads):
            for t in range(num_keys):
                scores[h, t] = softcap * math.tanh(scores[h, t] / softcap)
    powers = np.empty(num_keys, np.int32)   # exp_shifted's scratch
    for h in range(num_heads):
        top = scores[h, 0]
        for t in range(1, num_keys):
            top = max(top, scores[h, t])
        exp_shifted(scores[h], top, num_keys, powers)
        row_total = scores[h, 0]
        for t in range(1, num_keys):
            row_total += scores[h, t]
        best[h], total[h] = top, row_total
        acc[h, :] = 0
    pos = first
    while pos < last:
        slot, num = _run(block_table, block_size, pos, last)
        next_slot, next_num = _run(block_table, block_size, pos + num, last) if pos + num < last else (0, 0)
        values = scratch[:0] if packed else load_block(v_data, v_scales, slot, num, scratch)
        for kv in range(num_kv_heads):
            _prefetch_share(v_data, v_scales, next_slot, next_num, kv, num_kv_heads)
            if packed:
                packed_values(scores, v_data, v_scales, slot, num, kv, group, acc, pos - first)
            else:
                block_values(scores, values, kv, group, acc, pos - first)
        pos += num


@serial
def _decode_parts(query_start, seq_lens, window):  # pragma: no cover - compiled
    """The work items of `_paged_attention`: sequence s owns items first_item[s] ..
    first_item[s + 1] - 1, and item i belongs to sequence item_seq[i]. A decode (one query) gets
    `_num_parts` items over the keys it sees (its context, or its window), any other sequence one
    item. (Serial: inside a
    parallel function numba would run each of these array operations as a parallel region.)"""
    num_seqs = seq_lens.shape[0]
    first_item = np.empty(num_seqs + 1, dtype=np.int64)
    first_item[0] = 0
    for s in range(num_seqs):
        decode = query_start[s + 1] - query_start[s] == 1
        num_keys = seq_lens[s] if window is None else min(seq_lens[s], window)
        first_item[s + 1] = first_item[s] + (_num_parts(num_keys) if decode else 1)
    item_seq = np.empty(first_item[num_seqs], dtype=np.int64)
    for s in range(num_seqs):
        for i in range(first_item[s], first_item[s + 1]):
            item_seq[i] = s
    return first_item, item_seq


@serial
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


@parallel
def _paged_attention(q, rounding, k_cache, v_cache, query_start, seq_lens, block_tables, block_size, max_queries, scale,
                     window, softcap, first_item, item_seq, out):  # pragma: no cover - compiled
    """Work items (`_decode_parts`) spread over threads: a decode (one query) is one item per
    DECODE_PART keys it sees (the last `window` of its context), combined afterwards; a sequence
    with 2 .. `max_queries` queries is one item (`_attend_tile`). Sequences with more queries are
    left to the caller. k_cache and v_cache: (data, scales) as kv_read.cache_arrays gives them.
    rounding: None, or q's integers and scales over an int8 K cache (kv_dtype.round_queries; q rounded).

    window and softcap are None or a number: compiled apart, so that without them (numba prunes
    the branches on a None argument) the loops are the plain causal ones."""
    num_items = item_seq.shape[0]
    acc = np.empty((num_items, q.shape[1], q.shape[2]), dtype=q.dtype)
    best = np.empty((num_items, q.shape[1]), dtype=q.dtype)
    total = np.empty((num_items, q.shape[1]), dtype=q.dtype)
    for item in prange(num_items):
        s = item_seq[item]
        num_queries = query_start[s + 1] - query_start[s]
        if num_queries == 1:
            first = (0 if window is None else max(0, seq_lens[s] - window)) + (item - first_item[s]) * DECODE_PART
            last = seq_lens[s] if item == first_item[s + 1] - 1 else first + DECODE_PART   # the last part: the rest
            row = query_start[s]
            _attend_keys(q[row], rounding, row, k_cache, v_cache, block_tables[s], block_size, first, last, scale,
                         softcap, acc[item], best[item], total[item])
        elif num_queries <= max_queries:
            _attend_tile(q, k_cache, v_cache, block_tables[s], block_size, query_start[s], num_queries,
                         seq_lens[s] - num_queries, scale, window, softcap, out)
    _combine_parts(query_start, first_item, acc, best, total, out)


def attend_short_queries(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, meta: AttentionMetadata,
                         out: np.ndarray, scale: float | None = None, sliding_window: int | None = None,
                         softcap: float | None = None, turn_out: bool = False, rounding=None) -> None:
    """The compiled kernel's part of paged_attention: out's rows of the decodes and short queries
    (the long chunks' rows are left to the caller, holding anything).

    The kernel sees C-contiguous q and out only: a strided view (the engine's q and out are views of
    its workspace) would be one more compiled kernel for each dtype, kind and option (29 in a test
    run instead of 15, each about 8 s to compile); the copies cost a few microseconds a decode step.
    turn_out: out's rows turned back (hadamard.py) before they are copied there. rounding: `_paged_attention`'s."""
    dtype = q.dtype.type
    window = None if sliding_window is None else int(sliding_window)
    parts = meta.kernel_cache.get(f"decode_parts {window}")
    if parts is None:   # the same for every layer of the step with this window
        parts = meta.kernel_cache[f"decode_parts {window}"] = _decode_parts(meta.query_start, meta.seq_lens, window)
    compact = out if out.flags.c_contiguous else np.empty(out.shape, out.dtype)
    _paged_attention(np.ascontiguousarray(q), rounding, cache_arrays(k_cache), cache_arrays(v_cache), meta.query_start,
                     meta.seq_lens, meta.block_tables, meta.block_size, MAX_BATCHED_QUERY_LEN,
                     dtype(1.0 / math.sqrt(q.shape[-1]) if scale is None else scale), window,
                     None if softcap is None else dtype(softcap), *parts, compact)
    if turn_out:
        turn_heads(compact, compact)
    if compact is not out:
        out[...] = compact


def paged_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, meta: AttentionMetadata,
                    out: np.ndarray, *, scale: float | None = None, sliding_window: int | None = None,
                    softcap: float | None = None, unturned: bool = False) -> None:
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
    bench.prefill_attention`).

    Options as reference.paged_attention's; a window bounds every query's keys, so a decode with
    one costs O(window) and blocks wholly before it are never read. Over int8 K/V, stored turned,
    q is turned and rounded on its way in (the contiguous copy the kernel takes anyway; the decodes
    multiply its integers) and the output turned back (hadamard.py), as kv_dtype.attending does."""
    check_attention_options(scale, sliding_window, softcap)
    turning = kv_dtype.turned(k_cache) and not unturned
    q = turn_heads(q) if turning else q
    rounding = None
    if kv_dtype.rounds_queries(k_cache):
        q, rounding = round_queries(np.ascontiguousarray(q))
    attend_short_queries(q, k_cache, v_cache, meta, out, scale, sliding_window, softcap, turning, rounding)
    if len(meta.long_seqs):
        _attend_long_chunks(q, k_cache, v_cache, meta, out,
                            dict(scale=scale, sliding_window=sliding_window, softcap=softcap))
        for seq in meta.long_seqs if turning else ():
            rows = out[meta.query_start[seq]:meta.query_start[seq + 1]]
            rows[...] = turn_heads(rows)


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
                        out: np.ndarray, options: dict) -> None:
    """The tiles of every long chunk (prefill_attention.py) dealt round robin, tile by tile, to as
    many threads as numba uses, which run them at once: numpy's products and loops release the
    GIL. Round robin evens out the work, which grows with each tile's keys. `options`: paged_attention's."""
    chunks = [prepare_chunk(q, k_cache, v_cache, meta, int(seq), **options) for seq in meta.long_seqs]
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
