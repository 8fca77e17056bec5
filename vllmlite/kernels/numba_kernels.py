"""The compiled kernels (numba, cached on disk): the same operations as `reference.py`, same
arguments, same results within float rounding. The default backend.

Every function is compiled for float32 and float64 arrays on first call (`LlamaModel.warm_up` makes that happen at start-up) and the
machine code is cached next to this file (or in NUMBA_CACHE_DIR), so a second start does not
recompile. Loops release the GIL (`nogil`), so the HTTP thread keeps running while they do.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from vllmlite.attention import MAX_BATCHED_QUERY_LEN, AttentionMetadata
from vllmlite.kernels import reference

# Floating-point reassociation lets LLVM vectorize the dot products and sums; no "ninf"/"nnan",
# because the online softmax starts from -inf on purpose.
FASTMATH = {"reassoc", "contract", "arcp", "nsz"}

_serial = njit(cache=True, nogil=True, fastmath=FASTMATH)
_parallel = njit(cache=True, nogil=True, fastmath=FASTMATH, parallel=True)


# The model's activations are feature-major views (see model.Workspace): x[i, j] and x[i + 1, j]
# are neighbours in memory. So the elementwise kernels below walk tokens in the inner loop.


@_serial
def _rms_norm(x, weight, eps, out):  # pragma: no cover - compiled
    num_tokens, hidden = x.shape
    total = np.zeros(num_tokens)                     # float64: 576+ squares summed without drift
    for j in range(hidden):
        for i in range(num_tokens):
            total[i] += x[i, j] * x[i, j]
    for i in range(num_tokens):
        total[i] = 1 / math.sqrt(total[i] / hidden + eps)
    for j in range(hidden):
        for i in range(num_tokens):
            out[i, j] = x[i, j] * total[i] * weight[j]


@_serial
def _add_rms_norm(x, residual, weight, eps, out):  # pragma: no cover - compiled
    num_tokens, hidden = x.shape
    for j in range(hidden):
        for i in range(num_tokens):
            residual[i, j] += x[i, j]
    _rms_norm(residual, weight, eps, out)


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
def _silu_and_mul(gate_up, out):  # pragma: no cover - compiled
    num_tokens, inter = out.shape
    for j in range(inter):
        for i in range(num_tokens):
            g = gate_up[i, j]
            out[i, j] = g / (1 + math.exp(-g)) * gate_up[i, j + inter]   # exp(-g) = inf gives -0


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

    Every head of a slot is read together (one slot's K is [kv_heads, head_dim], contiguous), so
    a block is one contiguous run of memory. Its own function (not inlined in the prange body)
    so that LLVM vectorizes its loops.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // k_cache.shape[1]
    num_rows = num_queries * num_heads                 # row r: query r // num_heads, head r % num_heads
    qt = np.empty((num_rows, head_dim), dtype=k_cache.dtype)             # [rows, head_dim] scaled queries
    for r in range(num_rows):
        for d in range(head_dim):
            qt[r, d] = q[row0 + r // num_heads, r % num_heads, d] * scale
    acc = np.zeros((num_rows, head_dim), dtype=k_cache.dtype)            # [rows, head_dim] sum of p * v
    total = np.zeros(num_rows, dtype=k_cache.dtype)                      # [rows] sum of p
    best = np.full(num_rows, -np.inf, dtype=k_cache.dtype)               # [rows] running max score
    probs = np.empty((num_rows, block_size), dtype=k_cache.dtype)        # [rows, block_size] this block's
    last_pos = pos0 + num_queries - 1
    for b in range(last_pos // block_size + 1):
        base = block_table[b] * block_size                              # the block's first slot
        first_pos = b * block_size
        num_keys = min(block_size, last_pos - first_pos + 1)
        # Key t of the block is seen by the rows of queries at or after its position (causal);
        # the rows before them get -inf, so exp gives them 0.
        for t in range(num_keys):
            first_row = min(max(0, first_pos + t - pos0) * num_heads, num_rows)
            for r in range(first_row):
                probs[r, t] = -np.inf
            for r in range(first_row, num_rows):
                kv_head = (r % num_heads) // group
                dot = qt[r, 0] * k_cache[base + t, kv_head, 0]
                for d in range(1, head_dim):
                    dot += qt[r, d] * k_cache[base + t, kv_head, d]
                probs[r, t] = dot
        for r in range(num_rows):
            top = best[r]
            for t in range(num_keys):
                top = max(top, probs[r, t])
            rescale = math.exp(best[r] - top)                            # 0 on the first block
            best[r] = top
            row_total = total[r] * rescale
            for t in range(num_keys):
                p = math.exp(probs[r, t] - top)
                probs[r, t] = p
                row_total += p
            total[r] = row_total
            for d in range(head_dim):
                acc[r, d] *= rescale
        for t in range(num_keys):
            for r in range(min(max(0, first_pos + t - pos0) * num_heads, num_rows), num_rows):
                kv_head = (r % num_heads) // group
                p = probs[r, t]
                for d in range(head_dim):
                    acc[r, d] += p * v_cache[base + t, kv_head, d]
    for r in range(num_rows):
        inv = 1 / total[r]
        for d in range(head_dim):
            out[row0 + r // num_heads, r % num_heads, d] = acc[r, d] * inv


@_parallel
def _paged_attention(q, k_cache, v_cache, query_start, seq_lens, block_tables, block_size, max_queries, scale,
                     out):  # pragma: no cover - compiled
    """One work item per sequence, spread over threads. Sequences with more than `max_queries`
    queries are left to the caller."""
    for s in prange(seq_lens.shape[0]):
        num_queries = query_start[s + 1] - query_start[s]
        if num_queries <= max_queries:
            _attend_tile(q, k_cache, v_cache, block_tables[s], block_size, query_start[s], num_queries,
                         seq_lens[s] - num_queries, scale, out)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray) -> None:
    _rms_norm(x, weight, eps, out)


def add_rms_norm(x: np.ndarray, residual: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray) -> None:
    _add_rms_norm(x, residual, weight, eps, out)


def rope(x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> None:
    _rope(x, positions, cos, sin)


def silu_and_mul(gate_up: np.ndarray, out: np.ndarray) -> None:
    _silu_and_mul(gate_up, out)


def write_kv(k_cache: np.ndarray, v_cache: np.ndarray, k: np.ndarray, v: np.ndarray,
             slot_mapping: np.ndarray) -> None:
    _write_kv(k_cache, v_cache, k, v, slot_mapping)


def paged_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, meta: AttentionMetadata,
                    out: np.ndarray) -> None:
    """Decodes and short queries (speculative verification, short chunks) in the compiled kernel;
    each long prefill chunk through BLAS as the reference does, since the kernel's inner loops ran
    there at about half BLAS speed (48 vs 24 ms a layer for a 512-token prompt). A long chunk's
    work grows with its queries times its context, the gathered copy only with its context."""
    scale = q.dtype.type(1.0 / math.sqrt(q.shape[-1]))
    _paged_attention(q, k_cache, v_cache, meta.query_start, meta.seq_lens, meta.block_tables,
                     meta.block_size, MAX_BATCHED_QUERY_LEN, scale, out)
    for group in meta.long_groups:
        reference.attend_group(q, k_cache, v_cache, group, meta.block_size, out)
