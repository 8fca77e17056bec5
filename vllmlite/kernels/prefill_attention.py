"""Causal attention of a long prefill chunk in query tiles, with BLAS products: the compiled
backend's path for chunks longer than MAX_BATCHED_QUERY_LEN.

Computes what `reference.attend_group` computes for a one-sequence group (the readable dense
version, and the oracle the tests hold this to) without its dense [queries, context] score matrix:
a tile of queries attends only to the keys it can see, so the masked upper triangle is never
computed, and each tile's scores stay small enough to sit in cache. A tile is a unit of work the
caller may run on any thread (numba/attention.py runs a step's tiles on several). Knows nothing of
scheduling or threads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from vllmlite.kernels import kv_dtype
from vllmlite.kernels.attention_metadata import AttentionMetadata

# Queries a tile. Per KV head a tile's scores are [tile * group, context]: 1.5 MB at SmolLM2's
# group of 3 and 2048 tokens of context. One layer's attention at SmolLM2's shape on one OpenBLAS
# thread (AMD EPYC, AVX2), 2048 tokens: 114 ms with tiles of 48 or 64 queries, 119 with 128, 143
# with 256, 171 with 512, 121 with 32; 512 tokens: 9.1 ms at 48-64, 9.4-9.7 at 32 and 96-128
# (`python -m bench.prefill_attention`; the dense reference: 320 and 25 ms).
TILE_QUERIES = 64


@dataclass
class Chunk:
    """One long chunk's operands in one layer, gathered once; `attend_tile` is one unit of work:
    a tile of queries for one KV head. The tiles write disjoint parts of out, in any order."""

    queries: np.ndarray   # [kv_heads, n * group, head_dim] scaled; KV head h's row i * group + g is
    # query i's head h * group + g, so a tile of queries is a run of rows
    keys: np.ndarray      # [kv_heads, context, head_dim] (queries @ keys[h].T reads them transposed
    values: np.ndarray    # [kv_heads, context, head_dim]    in place: BLAS's transpose flag)
    mask: np.ndarray      # [tile * group, tile] the diagonal block's bias (_diagonal_bias)
    first: int            # row of q and out of the chunk's first query
    num_queries: int
    num_computed: int     # tokens of the sequence before the chunk
    group: int            # query heads per KV head
    tile: int             # queries a tile (at most num_queries)
    key_start: int = 0    # position of keys[h, 0]: the first block edge the window reaches (0 without)
    sliding_window: int | None = None   # a query at p sees keys p - w + 1 .. p (None: 0 .. p)
    softcap: float | None = None        # scores -> softcap * tanh(scores / softcap)

    @property
    def num_pairs(self) -> int:
        """The (query, key) pairs it attends, per query head: the work, whatever the tiles."""
        if self.sliding_window is not None:
            seen = np.arange(self.num_computed, self.num_computed + self.num_queries) + 1   # keys 0 .. p
            return int(np.minimum(seen, self.sliding_window).sum())
        return self.num_queries * self.num_computed + self.num_queries * (self.num_queries + 1) // 2

    @property
    def tiles(self) -> list[tuple[int, int]]:
        """(KV head, first query) of every tile, tile by tile."""
        return [(h, t0) for t0 in range(0, self.num_queries, self.tile) for h in range(self.queries.shape[0])]

    def attend_tile(self, h: int, t0: int, out: np.ndarray) -> None:
        """Queries t0 .. t1 - 1 (at most `tile`) over keys first_key .. num_computed + t1 - 1, the
        keys they can see (first_key: 0, or where query t0's window starts), for the query heads of
        KV head h: out[first + t0 .. first + t1, those heads]."""
        group = self.group
        t1 = min(self.num_queries, t0 + self.tile)
        first_key = 0 if self.sliding_window is None else max(0, self.num_computed + t0 - self.sliding_window + 1)
        rows, end, diagonal = (t1 - t0) * group, self.num_computed + t1, self.num_computed + t0
        keys = self.keys[h, first_key - self.key_start:end - self.key_start]                # [num_keys, head_dim]
        scores = self.queries[h, t0 * group:t1 * group] @ keys.T                             # [rows, num_keys]
        if self.softcap is not None:
            scores /= self.softcap
            np.tanh(scores, out=scores)
            scores *= self.softcap
        if self.sliding_window is None:
            scores[:, diagonal:] += self.mask[:rows, :t1 - t0]
        else:   # causal and window masks from positions: the band of keys each query sees
            query_pos = (diagonal + np.arange(rows) // group)[:, None]                       # [rows, 1]
            key_pos = np.arange(first_key, end)                                              # [num_keys]
            scores[(key_pos > query_pos) | (key_pos <= query_pos - self.sliding_window)] = -np.inf
        scores -= scores.max(axis=1, keepdims=True)
        np.exp(scores, out=scores)
        total = scores.sum(axis=1, keepdims=True)                                        # [rows, 1]
        ctx = scores @ self.values[h, first_key - self.key_start:end - self.key_start]      # [rows, head_dim]
        ctx /= total   # normalizing the head_dim outputs, not the num_keys probabilities
        out[self.first + t0:self.first + t1, h * group:(h + 1) * group] = ctx.reshape(t1 - t0, group, -1)


def prepare_chunk(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, meta: AttentionMetadata, seq: int,
                  tile: int = TILE_QUERIES, *, scale: float | None = None, sliding_window: int | None = None,
                  softcap: float | None = None) -> Chunk:
    """Sequence `seq`'s queries and context as `Chunk` needs them. Its n queries are rows
    query_start[seq] .. + n of q, at positions s .. s + n - 1 where s = seq_lens[seq] - n tokens
    were computed before this step. Queries t0 .. t1 - 1 (one tile) see keys 0 .. s + t1 - 1 and
    nothing further: only the last t1 - t0 of those keys (the diagonal block) need a mask.
    Example: s 100, n 300, tile 256 -> tile 0 attends queries 0..255 to keys 0..355, tile 1
    queries 256..299 to keys 0..399. With a sliding window w (reference.paged_attention's options)
    only the blocks from the one holding key s - w + 1 on are gathered; with w 50 and blocks of 16,
    keys 48.. (tile 1: 307..399)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    first, end = int(meta.query_start[seq]), int(meta.query_start[seq + 1])
    n = end - first
    num_computed = int(meta.seq_lens[seq]) - n
    first_block = 0 if sliding_window is None else max(0, num_computed - sliding_window + 1) // meta.block_size
    keys, values = _gather_context(k_cache, v_cache, meta, seq, first_block, q.dtype)     # [kv, ctx, d] each
    # Scaled here, so the scores need no pass of their own.
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)   # a Python float keeps float32 float32 (NEP 50)
    queries = (q[first:end] * scale).reshape(n, num_kv_heads, group, head_dim)
    queries = np.ascontiguousarray(queries.transpose(1, 0, 2, 3)).reshape(num_kv_heads, n * group, head_dim)
    tile = min(tile, n)
    return Chunk(queries, keys, values, _diagonal_bias(meta, tile, group, q.dtype), first, n, num_computed, group,
                 tile, first_block * meta.block_size, sliding_window, None if softcap is None else float(softcap))


def attend_chunk(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, meta: AttentionMetadata, seq: int,
                 out: np.ndarray, tile: int = TILE_QUERIES, **options) -> None:
    """paged_attention (see reference.py, also for `options`) for sequence `seq` of the step
    alone, into its rows of out, one tile after another (see prepare_chunk)."""
    chunk = prepare_chunk(q, k_cache, v_cache, meta, seq, tile, **options)
    for h, t0 in chunk.tiles:
        chunk.attend_tile(h, t0, out)


def _gather_context(k_cache: np.ndarray, v_cache: np.ndarray, meta: AttentionMetadata, seq: int,
                    first_block: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """The sequence's keys and values from block `first_block` of its table to its seq_lens[seq]
    tokens, each [kv, ctx, d] and contiguous per head (ctx rounded to whole blocks; the keys past
    seq_lens[seq] are never used). O(context), once per
    layer call, into buffers the step's first layer allocates and every layer reuses: fresh ones
    each call cost more in page faults than the copy (2048 tokens of SmolLM2's context: 4 ms a
    layer so, 0.55 ms into reused buffers)."""
    bs = meta.block_size
    num_slots, num_kv_heads, head_dim = k_cache.shape
    block_ids = meta.block_tables[seq, first_block:-(-int(meta.seq_lens[seq]) // bs)]
    shape = (len(block_ids), bs, num_kv_heads, head_dim)
    key = f"context {seq} {len(block_ids)} {np.dtype(dtype).name}"   # layers with and without a window
    buffers = meta.kernel_cache.get(key)
    if buffers is None:   # the blocks as stored (widened if packed), then keys and values per head
        buffers = meta.kernel_cache[key] = tuple(np.empty(shape, dtype) for _ in range(3))
    blocks, keys, values = buffers
    for cache, gathered in ((k_cache, keys), (v_cache, values)):
        if isinstance(cache, kv_dtype.PackedKV):   # kv_cache_dtype fp16, bf16, int8: widened to q's dtype
            blocks[...] = kv_dtype.gather_blocks(cache, block_ids, bs, blocks.dtype)
        else:
            np.take(cache.reshape(num_slots // bs, bs, num_kv_heads, head_dim), block_ids, axis=0, out=blocks)
        np.copyto(gathered.reshape(num_kv_heads, *shape[:2], head_dim), blocks.transpose(2, 0, 1, 3))
    return keys.reshape(num_kv_heads, -1, head_dim), values.reshape(num_kv_heads, -1, head_dim)


def _diagonal_bias(meta: AttentionMetadata, tile: int, group: int, dtype: np.dtype) -> np.ndarray:
    """[tile * group, tile]: 0 where row r's query (r // group) may see the diagonal block's key c
    (c <= r // group), -inf above. The top-left corner serves a shorter last tile. Built by the
    first layer of a step, reused by the others."""
    key = f"diagonal_bias {tile} {group} {np.dtype(dtype).name}"
    bias = meta.kernel_cache.get(key)
    if bias is None:
        above = np.triu(np.ones((tile, tile), dtype=bool), k=1)                 # [tile, tile]
        bias = np.repeat(np.where(above, -np.inf, 0).astype(dtype), group, axis=0)
        meta.kernel_cache[key] = bias
    return bias
