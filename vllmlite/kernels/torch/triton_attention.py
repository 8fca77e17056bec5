"""Paged attention in Triton for every query of a step (decodes, speculative verification, prefill
chunks over cached context): each query reads its own sequence's keys and values straight from
the paged cache through the block table, never gathering a copy. float32 products run in full
float32 ("ieee", not TF32), so greedy tokens match the CPU paths; bfloat16 and float16 ones on the
tensor cores.

The work is cut into tiles: a tile is up to ROWS consecutive query rows of one sequence (a decode
is a tile of one row; a prefill chunk of 300 rows is ten tiles of 32), described by four integers
(first row, number of rows, sequence, position of the first row). One program per (tile, KV head,
split): it holds that KV head's group of query heads for all of the tile's rows as one
[ROWS * GROUP_PAD, head_dim] block (grouped-query attention without repeating K/V), walks its
share of the context in tiles of BLOCK_N positions (each position's page looked up in the block
table, so BLOCK_N is independent of the block size) and keeps an online softmax in float32. A
query at position p sees keys 0..p of its sequence: the causal mask inside a chunk.

Split over the context ("flash decoding"): when a step has too few (tile, KV head) programs to
fill the GPU (one long sequence), each is cut into num_splits ranges of the context, which write
partial softmax states; the split that finishes last (an atomic count per (tile, KV head)) combines
them, in the same kernel. Each program cuts its own tile's context
(the keys its rows can see) into num_splits ranges of whole BLOCK_N tiles, in the kernel: a plan
made for a long context (a CUDA graph captured for max_model_len) spreads a short one over all its
splits too. A split left with no keys writes a neutral state (max -inf, sum 0) that the combine
weighs 0.

Integer arguments that change from step to step (token strides, the block table's width, the
number of splits, the window) are not specialized on (do_not_specialize): Triton would compile a
variant each time one's divisibility by 16 (or being 1) changed.

Runs on CUDA, and on the CPU under TRITON_INTERPRET=1 (the tests' way to check it without a GPU).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl

from vllmlite.kernels.torch import pdl

BLOCK_N = 64        # context positions per tile
MIN_SPLIT_KEYS = 128  # the shortest stretch of context worth a program of its own (see split_plan)
MAX_SPLITS = 16     # the most splits of one program's context (the combine unrolls over them)
FEW_PROGRAMS_PER_SM = 3   # programs a multiprocessor up to which a launch's programs get 8 warps (warps_for)
TILE_FIELDS = 4     # first row, number of rows, sequence, position of the first row
NARROW_CACHE = 2**31   # the most elements a K or V cache may have for the kernel's 32-bit offsets into it


@triton.jit(do_not_specialize=["stride_q_tok", "stride_o_tok", "stride_bt_seq", "num_splits", "window"])
def _attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, tiles_ptr, block_tables_ptr, part_ptr, state_ptr,
                      counters_ptr, scale, stride_q_tok, stride_q_head, stride_q_d, stride_o_tok, stride_o_head, stride_o_d,
                      stride_bt_seq, block_size, num_kv_heads, num_splits, window, softcap,
                      SPLIT: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, ROWS: tl.constexpr,
                      HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                      WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr, MAX_SPLITS: tl.constexpr, WIDE: tl.constexpr,
                      PDL: tl.constexpr):
    pdl.start(PDL)
    t = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row0 = tl.load(tiles_ptr + t * 4).to(tl.int64)
    count = tl.load(tiles_ptr + t * 4 + 1)
    seq = tl.load(tiles_ptr + t * 4 + 2)
    pos0 = tl.load(tiles_ptr + t * 4 + 3)
    i = tl.arange(0, ROWS * GROUP_PAD)                                 # [Q] (row, query head) pairs
    r = i // GROUP_PAD
    g = i % GROUP_PAD
    head = kv_head * GROUP + g
    d = tl.arange(0, HEAD_PAD)                                         # [HEAD_PAD] (a power of 2, >= 16)
    d_valid = d < HEAD_DIM
    q_valid = (r < count) & (g < GROUP)
    q = tl.load(q_ptr + (row0 + r)[:, None] * stride_q_tok + head[:, None] * stride_q_head + d[None, :] * stride_q_d,
                mask=q_valid[:, None] & d_valid[None, :], other=0.0)
    position = pos0 + r                                                # [Q] each query sees keys 0..position
    # The tile's keys lo..hi (past its last row's position), cut into num_splits ranges of whole tiles.
    hi = pos0 + count
    lo = 0
    if WINDOWED:   # ... and only position - window + 1 ..: from the first row's first key
        lo = tl.maximum(pos0 - window + 1, 0)
    split_len = tl.cdiv(tl.cdiv(hi - lo, num_splits), BLOCK_N) * BLOCK_N
    key_start = lo + split * split_len
    key_end = tl.minimum(hi, key_start + split_len)                    # <= key_start: no keys, a neutral state
    m = tl.full([ROWS * GROUP_PAD], float("-inf"), tl.float32)         # running max
    denom = tl.zeros([ROWS * GROUP_PAD], tl.float32)                   # running sum of exp
    acc = tl.zeros([ROWS * GROUP_PAD, HEAD_PAD], tl.float32)
    for start in range(key_start, key_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)                              # [BLOCK_N] context positions
        valid = n < key_end
        block_id = tl.load(block_tables_ptr + seq * stride_bt_seq + n // block_size, mask=valid, other=0)
        if WIDE:   # a cache of 2**31 elements or more: 64-bit offsets
            slot = block_id.to(tl.int64) * block_size + n % block_size
        else:      # 32-bit offsets: fewer instructions a key (see paged_attention_tiles)
            slot = block_id.to(tl.int32) * block_size + n % block_size
        kv_offset = (slot[:, None] * num_kv_heads + kv_head) * HEAD_DIM + d[None, :]   # [BLOCK_N, HEAD_PAD]
        if HEAD_PAD == HEAD_DIM:   # a mask constant along the head: the loads stay vectorized
            kv_mask = valid[:, None]
        else:
            kv_mask = valid[:, None] & d_valid[None, :]
        # Issued together (one wait, not two); an fp8 cache widened to q's dtype (a no-op otherwise).
        k = tl.load(k_cache_ptr + kv_offset, mask=kv_mask, other=0.0).to(q.dtype)
        v = tl.load(v_cache_ptr + kv_offset, mask=kv_mask, other=0.0).to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale   # [Q, BLOCK_N]
        if SOFTCAP:   # softcap * tanh(scores / softcap), tanh(x) = 1 - 2 / (exp(2x) + 1): no libdevice
            scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
        seen = valid[None, :] & (n[None, :] <= position[:, None])
        if WINDOWED:
            seen = seen & (n[None, :] > position[:, None] - window)
        scores = tl.where(seen, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)         # a row with no key yet: no NaN
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
        denom = denom * alpha + tl.sum(p, axis=1)
        m = m_new
    if not SPLIT:
        out = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
        tl.store(out_ptr + (row0 + r)[:, None] * stride_o_tok + head[:, None] * stride_o_head + d[None, :] * stride_o_d,
                 out.to(out_ptr.dtype.element_ty), mask=q_valid[:, None] & d_valid[None, :])
    else:   # this split's softmax state; the last split of the (tile, KV head) to finish combines them
        base = ((t * num_kv_heads + kv_head) * num_splits + split) * (ROWS * GROUP_PAD)
        # Only the tile's rows and heads: a decode's tile has one row of ROWS, the rest is padding.
        tl.store(part_ptr + (base + i)[:, None] * HEAD_PAD + d[None, :], acc, mask=q_valid[:, None])
        tl.store(state_ptr + 2 * (base + i), m, mask=q_valid)
        tl.store(state_ptr + 2 * (base + i) + 1, denom, mask=q_valid)
        tl.debug_barrier()   # every thread's stores issued before the count is taken (acq_rel below)
        counter = counters_ptr + t * num_kv_heads + kv_head
        if tl.atomic_add(counter, 1, sem="acq_rel") == num_splits - 1:
            tl.atomic_xchg(counter, 0)   # back to zero for the next launch (a CUDA graph's next replay)
            _combine(out_ptr, part_ptr, state_ptr, row0, count, kv_head, (t * num_kv_heads + kv_head) * num_splits,
                     stride_o_tok, stride_o_head, stride_o_d, num_splits, GROUP, GROUP_PAD, ROWS, HEAD_DIM, HEAD_PAD,
                     MAX_SPLITS)


@triton.jit
def _combine(out_ptr, part_ptr, state_ptr, row0, count, kv_head, first_split, stride_o_tok, stride_o_head, stride_o_d,
             num_splits, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
             HEAD_PAD: tl.constexpr, MAX_SPLITS: tl.constexpr):
    """out = the splits' partial attention (splits first_split .. + num_splits - 1), each weighted
    by exp(its max - the overall max); run by the program that finished last, so no second
    kernel: at one decode a layer that kernel cost about 4.6 us and a gap between launches
    (Llama-3.2-1B's shapes on an H200, results/gpu_runs/run23_launch_floor.json).

    Read past the L1 cache (.cg): the other programs wrote them. Every split's loads are issued at
    once (the loop unrolled to MAX_SPLITS, splits past num_splits masked off), so the program waits
    on memory about once rather than once a split: a loop over the splits whose every step waited
    on its loads took 8.8 us of a one-sequence decode's layer (H200, in a CUDA graph, 11 splits)."""
    i = tl.arange(0, ROWS * GROUP_PAD)
    r = i // GROUP_PAD
    g = i % GROUP_PAD
    d = tl.arange(0, HEAD_PAD)
    q_valid = (r < count) & (g < GROUP)                                         # [Q] what the splits wrote
    first = first_split * (ROWS * GROUP_PAD)
    s = tl.arange(0, MAX_SPLITS)
    state = 2 * (first + s[:, None] * (ROWS * GROUP_PAD) + i[None, :])          # [MAX_SPLITS, Q]
    valid = (s < num_splits)[:, None] & q_valid[None, :]
    m = tl.load(state_ptr + state, mask=valid, other=float("-inf"), cache_modifier=".cg")
    m_all = tl.max(m, axis=0)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
    totals = tl.load(state_ptr + state + 1, mask=valid, other=0.0, cache_modifier=".cg")
    denom = tl.sum(tl.exp(m - m_all[None, :]) * totals, axis=0)
    acc = tl.zeros([ROWS * GROUP_PAD, HEAD_PAD], tl.float32)
    for k in tl.static_range(MAX_SPLITS):
        base = first + k * (ROWS * GROUP_PAD)
        present = q_valid & (k < num_splits)
        weight = tl.exp(tl.load(state_ptr + 2 * (base + i), mask=present, other=float("-inf"), cache_modifier=".cg")
                        - m_all)
        acc += weight[:, None] * tl.load(part_ptr + (base + i)[:, None] * HEAD_PAD + d[None, :],
                                         mask=present[:, None], other=0.0, cache_modifier=".cg")
    out = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
    mask = q_valid[:, None] & (d < HEAD_DIM)[None, :]
    head = kv_head * GROUP + g
    tl.store(out_ptr + (row0 + r)[:, None] * stride_o_tok + head[:, None] * stride_o_head + d[None, :] * stride_o_d,
             out.to(out_ptr.dtype.element_ty), mask=mask)


def tile_rows(num_heads: int, num_kv_heads: int, long: bool) -> int:
    """Query rows per tile: enough that a tile's (row, head) block has at least 16 rows (tl.dot's
    minimum), and 64 for prefill chunks, where a tile's keys are read once for all its rows."""
    group_pad = triton.next_power_of_2(num_heads // num_kv_heads)
    return max(1, (64 if long else 16) // group_pad)


def make_tiles(query_start: np.ndarray, positions: np.ndarray, seqs: np.ndarray, rows: int) -> np.ndarray:
    """[num_tiles, 4] int64 tiles (first row, rows, sequence, first position) cutting the queries of
    sequences `seqs` into runs of at most `rows` consecutive rows, the longest context (first
    position + rows) first: the programs that read the most keys start first, so the launch does not
    end on a few long ones (a batch of 256 decodes of 100-1,280 keys at Llama-3.1-8B's shapes on an
    H200: 0.95x the time in sequence order, results/gpu_attention_decode_offsets.json).
    Example: query_start [0, 1, 6], positions [9, 0, 1, 2, 3, 4], seqs [0, 1], rows 4
      -> [[0, 1, 0, 9], [5, 1, 1, 4], [1, 4, 1, 0]]."""
    lens = query_start[seqs + 1] - query_start[seqs]                     # [S]
    per_seq = -(-lens // rows)                                           # [S] tiles of each sequence
    seq = np.repeat(seqs, per_seq)                                       # [T]
    k = np.arange(len(seq)) - np.repeat(np.cumsum(per_seq) - per_seq, per_seq)   # tile index in its sequence
    row0 = query_start[seq] + k * rows
    count = np.minimum(rows, query_start[seq + 1] - row0)
    tiles = np.stack([row0, count, seq, positions[row0]], axis=1).astype(np.int64)
    return tiles[np.argsort(-(tiles[:, 3] + count), kind="stable")]


def paged_attention_tiles(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tiles: torch.Tensor,
                          rows: int, block_tables: torch.Tensor, block_size: int, out: torch.Tensor,
                          num_splits: int = 1, block_n: int = BLOCK_N, num_warps: int = 4,
                          num_stages: int = 2, *, scale: float | None = None, sliding_window: int | None = None,
                          softcap: float | None = None) -> None:
    """out[row] = attention of q[row] over its sequence's paged context, for every row of `tiles`
    ([num_tiles, 4] int64 on the device, see make_tiles), written in place.

    q, out [num_tokens, heads, head_dim], any strides; caches [slots, kv_heads, head_dim] contiguous,
    in q's dtype or float8 e4m3 (kv_cache_dtype fp8, widened to q's dtype as it is read);
    block_tables [num_seqs, max_blocks] int; num_splits > 1 cuts each tile's context into that many
    ranges (whole block_n tiles, sized in the kernel from the tile's own context) combined afterwards.
    block_n, num_warps, num_stages: the kernel's tuning (bench/gpu_attention.py sweeps them).
    scale, sliding_window, softcap: as reference.paged_attention's. With a window a tile's context
    starts at its first row's first key (and its splits cut only that); without one or the other
    the kernel is compiled without their code.
    Offsets into caches of up to NARROW_CACHE elements are computed in 32 bits: at Llama-3.1-8B's
    shapes on an H200, 256 decodes of 100-1,280 keys read K/V at 3.50 TB/s with 64 keys a tile,
    against 2.99 TB/s in 64 bits (results/gpu_attention_decode_offsets.json).
    """
    num_tiles = tiles.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    shape = dict(GROUP=group, GROUP_PAD=triton.next_power_of_2(group), ROWS=rows, HEAD_DIM=head_dim,
                 HEAD_PAD=max(16, triton.next_power_of_2(head_dim)))
    q_rows = rows * shape["GROUP_PAD"]
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    if num_splits > 1:
        part, state = split_buffers(num_tiles * num_kv_heads * num_splits * q_rows, shape["HEAD_PAD"], q.device)
        counters = split_counters(num_tiles * num_kv_heads, q.device)
    else:
        part = state = counters = out   # not read
    _attention_kernel[(num_tiles, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, tiles, block_tables, part, state, counters,
        1.0 / math.sqrt(head_dim) if scale is None else scale,
        *q.stride(), *out.stride(), block_tables.stride(0), block_size, num_kv_heads, num_splits,
        sliding_window or 0, softcap or 0.0, SPLIT=num_splits > 1, BLOCK_N=block_n,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", WINDOWED=sliding_window is not None,
        SOFTCAP=softcap is not None, MAX_SPLITS=MAX_SPLITS, WIDE=k_cache.numel() > NARROW_CACHE, **pdl.options(q),
        num_warps=num_warps, num_stages=num_stages, **shape)


def split_buffers(num_rows: int, head_pad: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The splits' partial softmax states, float32: accumulators [num_rows, head_pad] and (max, sum)
    pairs [2 * num_rows], one row per (tile, KV head, split, query row) in that order."""
    part = torch.empty((num_rows, head_pad), dtype=torch.float32, device=device)
    return part, torch.empty((2 * num_rows,), dtype=torch.float32, device=device)


_counters: dict[torch.device, torch.Tensor] = {}
MIN_COUNTERS = 1 << 16   # int32s: split launches have under 2 programs a multiprocessor (split_plan)


def split_counters(num: int, device: torch.device) -> torch.Tensor:
    """At least `num` int32 counters on `device`, all zero: each (tile, KV head) of a split launch
    counts its finished splits in one, and the last split sets it back to zero. Kept for the
    process and shared by every launch (they run one after another on the stream), so a CUDA graph
    captures no zeroing; made once, outside any capture in practice (MIN_COUNTERS is far more than
    a split launch's programs)."""
    device = torch.device(device)
    counters = _counters.get(device)
    if counters is None or counters.numel() < num:
        counters = _counters[device] = torch.zeros(max(num, MIN_COUNTERS), dtype=torch.int32, device=device)
    return counters


def short_query_plan(num_programs: int, max_context: int, num_sms: int) -> tuple[int, int, int]:
    """(splits, keys per tile, warps) of a launch of short queries (decodes, guesses) whose tiles
    times KV heads make `num_programs`: split_plan's, BLOCK_N, and warps_for's over the split programs.

    Keys per tile: BLOCK_N at every shape. With 64-bit offsets 32 keys were faster for heads of 128
    and a batch of 256 (3.15-3.20 against 2.88-2.94 TB/s); with 32-bit ones 64 keys are the fastest
    at the three bench shapes and batches 1/32/256: 0.80x the old plan's time for 256 decodes of
    100-1,280 keys at Llama-3.1-8B's heads, 0.89x at Llama-3.2-1B's, never slower
    (results/gpu_attention_decode_offsets.json)."""
    num_splits = split_plan(num_programs, max_context, num_sms)
    return num_splits, BLOCK_N, warps_for(num_programs * num_splits, num_sms)


def warps_for(num_programs: int, num_sms: int) -> int:
    """Warps a program of a launch of `num_programs` programs: 8 while they are few (up to
    FEW_PROGRAMS_PER_SM a multiprocessor: decode batches up to 8 at 8 KV heads, split), else 4.

    Why: on an H200 (results/gpu_attention_warps.json: 16 launches in a CUDA graph, bf16, 8 KV
    heads, the splits a graph gets for 1,168 tokens) 8 warps took 0.84-0.85x 4 warps' time for one
    decode at head_dim 64 and 0.80x at 128 (contexts 192 and 512), 0.85-0.98x for 2-8 decodes: more
    warps keep more of a lone program's loads in flight. At 32 decodes (512 programs) it took
    0.87-1.25x, and at 256 decodes 1.15-1.38x. In the engine, one stream (results/gpu_runs/
    run41_attention_warps.json): 1,010 decode tok/s against 978-989 at the 1B shapes, 1,053-1,068
    against 946-995 at 0.6B."""
    return 8 if num_sms and num_programs <= FEW_PROGRAMS_PER_SM * num_sms else 4


def split_plan(num_programs: int, max_context: int, num_sms: int) -> int:
    """The number of splits of each (tile, KV head) program's context: enough for two programs per
    multiprocessor, at most MAX_SPLITS, and none shorter than MIN_SPLIT_KEYS keys of max_context; 1 (no
    split) when the step's programs already fill the GPU or the context is short.

    Why split short contexts: a decode of one sequence at 512 keys (Qwen3-0.6B, 8 KV heads: 8
    programs) took 23 us per layer on an H200, timed inside a CUDA graph: 8 serial BLOCK_N
    iterations of dependent loads (block table -> slot -> K/V), about 2.5 us each, latency-bound.
    128 keys are 2 such iterations, and the combine, which the last split runs, is short. (The earlier
    sweep, results/gpu_attention_sweep.json from bench/gpu_attention.py, timed launches from
    Python, whose overhead hid the kernel's own time and made splitting below 512 keys look
    useless.) The kernel sizes each program's range from its own tile's context, so splits planned
    for a longer context than a step's (a CUDA graph's max_model_len) still share its work."""
    wanted = min(MAX_SPLITS, -(-2 * num_sms // max(num_programs, 1)), -(-max_context // MIN_SPLIT_KEYS))
    return max(wanted, 1)
