"""Paged attention: write each new token's K/V into its slot, attend through block tables.

Owns the index arithmetic from (block table, position) to slot; knows nothing of requests or
scheduling. slot = block_id * block_size + offset. GQA is computed by grouping query heads per
KV head, never by repeating KV heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from vllmlite.config import ceil_div

# Sequences with at most this many query tokens (decodes, speculative verification) are attended
# together in one padded batch; longer prefill chunks are attended one sequence at a time, where
# padding every decode up to the chunk length would cost more than the Python loop.
MAX_BATCHED_QUERY_LEN = 16


@dataclass
class AttentionGroup:
    """Sequences attended together, padded to the group's longest query and context.

    Row b of every array is one sequence; padding is masked, never read as real data.
    """

    query_rows: np.ndarray    # [num_seqs, max_query_len] rows of the flattened batch (0 where padded)
    query_valid: np.ndarray   # [num_seqs, max_query_len] bool
    block_ids: np.ndarray     # [num_seqs, max_blocks] block tables padded with block 0
    bias: np.ndarray          # [num_seqs, 1, max_query_len, max_blocks * block_size] float32, added to
    # the scores: 0 where a query may attend, -inf where it may not. Padded query rows get 0 (a
    # harmless uniform row instead of NaN; their output is never read). Built once per step.

    @property
    def mask(self) -> np.ndarray:
        """[num_seqs, 1, max_query_len, context] bool: which keys each real query attends to."""
        return (self.bias == 0) & self.query_valid[:, None, :, None]


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step, shared by all layers. Built by `build_metadata`."""

    positions: np.ndarray     # [num_tokens] position of each scheduled token in its sequence
    query_start: np.ndarray   # [num_seqs + 1] sequence i owns rows query_start[i]:query_start[i+1]
    slot_mapping: np.ndarray  # [num_tokens] slot where each scheduled token's K/V is written
    groups: list[AttentionGroup]
    block_size: int


def build_metadata(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                   block_size: int) -> AttentionMetadata:
    """Index arrays for a flattened batch of sequences.

    Sequence i owns rows query_start[i]:query_start[i+1] of the batch, which are the tokens at
    positions seq_lens[i] - query_lens[i] .. seq_lens[i] - 1 of that sequence.
    Example: query_lens [2, 3], seq_lens [5, 3], block_size 4, block_tables [[7, 2], [5]]
      -> query_start [0, 2, 5]; positions [3, 4, 0, 1, 2];
         slots [7*4+3, 2*4+0, 5*4+0, 5*4+1, 5*4+2] = [31, 8, 20, 21, 22].
    """
    query_start = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int64)  # [num_seqs + 1]
    position_parts, slot_parts = [], []
    for n, seq_len, table in zip(query_lens, seq_lens, block_tables):
        positions = np.arange(seq_len - n, seq_len)                       # [n]
        blocks = np.asarray(table, dtype=np.int64)[positions // block_size]
        position_parts.append(positions)
        slot_parts.append(blocks * block_size + positions % block_size)
    positions = np.concatenate(position_parts) if position_parts else np.zeros(0, np.int64)  # [num_tokens]
    slot_mapping = np.concatenate(slot_parts) if slot_parts else np.zeros(0, np.int64)      # [num_tokens]
    short = [i for i, n in enumerate(query_lens) if n <= MAX_BATCHED_QUERY_LEN]
    long = [i for i, n in enumerate(query_lens) if n > MAX_BATCHED_QUERY_LEN]
    groups = [_group(s, query_start, query_lens, seq_lens, block_tables, block_size)
              for s in ([short] if short else []) + [[i] for i in long]]
    return AttentionMetadata(positions, query_start, slot_mapping, groups, block_size)


def _group(seqs: list[int], query_start: np.ndarray, query_lens: list[int], seq_lens: list[int],
           block_tables: list[list[int]], block_size: int) -> AttentionGroup:
    lens = np.array([query_lens[i] for i in seqs])                 # [B]
    ctx = np.array([seq_lens[i] for i in seqs])                    # [B]
    max_q = int(lens.max())
    max_blocks = max(ceil_div(int(c), block_size) for c in ctx)
    offsets = np.arange(max_q)                                     # [max_q]
    query_valid = offsets[None, :] < lens[:, None]                 # [B, max_q]
    query_rows = np.where(query_valid, query_start[seqs][:, None] + offsets[None, :], 0)
    block_ids = np.zeros((len(seqs), max_blocks), dtype=np.int64)  # [B, max_blocks]
    for b, i in enumerate(seqs):
        table = block_tables[i][:max_blocks]
        block_ids[b, :len(table)] = table
    # Query j of sequence b sits at position ctx - len + j and sees keys at positions <= it.
    query_pos = ctx[:, None] - lens[:, None] + offsets[None, :]    # [B, max_q]
    key_pos = np.arange(max_blocks * block_size)                   # [max_blocks * block_size]
    allowed = (key_pos[None, None, :] <= query_pos[:, :, None]) | ~query_valid[:, :, None]
    bias = np.where(allowed, np.float32(0.0), np.float32(-np.inf))  # [B, max_q, ctx]
    return AttentionGroup(query_rows, query_valid, block_ids, bias[:, None])


def write_kv(k_cache: np.ndarray, v_cache: np.ndarray, k: np.ndarray, v: np.ndarray,
             slot_mapping: np.ndarray) -> None:
    """Store this step's keys and values: caches [num_slots, kv_heads, head_dim], k/v [tokens, ...]."""
    k_cache[slot_mapping] = k
    v_cache[slot_mapping] = v


def paged_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                    meta: AttentionMetadata) -> np.ndarray:
    """Attend each query token to its own sequence's cached context (which includes this step's K/V).

    q [num_tokens, num_heads, head_dim]; caches [num_slots, num_kv_heads, head_dim].
    Returns [num_tokens, num_heads, head_dim].
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group_size = num_heads // num_kv_heads
    bs = meta.block_size
    k_blocks = k_cache.reshape(-1, bs, num_kv_heads, head_dim)    # [num_blocks, bs, kv_heads, head_dim]
    v_blocks = v_cache.reshape(-1, bs, num_kv_heads, head_dim)
    scale = 1.0 / math.sqrt(head_dim)  # a Python float keeps float32 scores float32 (NEP 50)
    out = np.empty_like(q)                                          # [num_tokens, heads, head_dim]
    for g in meta.groups:
        num_seqs, max_q = g.query_rows.shape
        ctx_len = g.block_ids.shape[1] * bs
        # [B, max_q, kv, group, d] -> [B, kv, group * max_q, d]: each KV head serves its query heads.
        qg = q[g.query_rows].reshape(num_seqs, max_q, num_kv_heads, group_size, head_dim)
        qg = qg.transpose(0, 2, 3, 1, 4).reshape(num_seqs, num_kv_heads, group_size * max_q, head_dim)
        keys = k_blocks[g.block_ids].reshape(num_seqs, ctx_len, num_kv_heads, head_dim)
        values = v_blocks[g.block_ids].reshape(num_seqs, ctx_len, num_kv_heads, head_dim)
        scores = qg @ keys.transpose(0, 2, 3, 1)                    # [B, kv, group * max_q, ctx]
        scores = scores.reshape(num_seqs, num_kv_heads, group_size, max_q, ctx_len) * scale
        scores += g.bias[:, :, None]                                # bias [B, 1, 1, max_q, ctx]
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        probs = probs.reshape(num_seqs, num_kv_heads, group_size * max_q, ctx_len)
        ctx = probs @ values.transpose(0, 2, 1, 3)                  # [B, kv, group * max_q, d]
        ctx = ctx.reshape(num_seqs, num_kv_heads, group_size, max_q, head_dim).transpose(0, 3, 1, 2, 4)
        ctx = ctx.reshape(num_seqs, max_q, num_heads, head_dim)     # [B, max_q, heads, d]
        out[g.query_rows[g.query_valid]] = ctx[g.query_valid]
    return out
