"""Paged attention's metadata: where each scheduled token's K/V goes and what it may attend to.

Owns the index arithmetic from (block table, position) to slot, built once per step and shared by
every layer; the kernels (vllmlite/kernels) read it. Knows nothing of requests or scheduling.
slot = block_id * block_size + offset.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

# Sequences with at most this many query tokens (decodes, speculative verification of up to 7
# tokens) are attended together in one padded batch; longer prefill chunks are attended one
# sequence at a time, where padding every decode up to the chunk length would cost more than the
# Python loop, and the compiled backend's BLAS tiles beat its batched kernel. One SmolLM2 layer,
# one thread, batched kernel vs tiles (gather + products): 8 queries after 2000 tokens 4.3 vs 1.6
# ms, 16 queries 8.0 vs 2.5; after 100 tokens 8 queries 0.25 vs 0.19, 4 queries 0.13 vs 0.13,
# 2 queries 0.09 vs 0.17. The model's forward pass for a 16-token chunk after 2000 tokens: 264 ms
# at 16 here, 132 at 8.
MAX_BATCHED_QUERY_LEN = 8


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


class AttentionMetadata:
    """Everything attention needs for one step, shared by all layers. Built by `build_metadata`.

    positions     [num_tokens] position of each scheduled token in its sequence
    query_start   [num_seqs + 1] sequence i owns rows query_start[i]:query_start[i+1]
    seq_lens      [num_seqs] tokens of sequence i with K/V after this step (context + queries)
    slot_mapping  [num_tokens] slot where each scheduled token's K/V is written
    block_tables  [num_seqs, max_blocks] int32, padded with block 0 (never read past seq_lens)
    """

    def __init__(self, positions: np.ndarray, query_start: np.ndarray, seq_lens: np.ndarray,
                 slot_mapping: np.ndarray, block_tables: np.ndarray, block_size: int) -> None:
        self.positions = positions
        self.query_start = query_start
        self.seq_lens = seq_lens
        self.slot_mapping = slot_mapping
        self.block_tables = block_tables
        self.block_size = block_size
        # [num_long] the sequences with more than MAX_BATCHED_QUERY_LEN queries (long prefill chunks)
        self.long_seqs = np.flatnonzero(np.diff(query_start) > MAX_BATCHED_QUERY_LEN)
        self._groups: dict[int | None, list[AttentionGroup]] = {}   # by sliding window (window_groups)
        # What a kernel backend derives from these arrays, built by the first layer of the step
        # and reused by the others.
        self.kernel_cache: dict[str, object] = {}

    @property
    def groups(self) -> list[AttentionGroup]:
        """Padded groups for the numpy reference, built on first use and reused by every layer.

        Sequences with at most MAX_BATCHED_QUERY_LEN queries share one group; each longer
        prefill chunk gets its own (padding every decode to the chunk length would cost more)."""
        return self.window_groups(None)

    @property
    def long_groups(self) -> list[AttentionGroup]:
        """The one-sequence groups of chunks with more than MAX_BATCHED_QUERY_LEN queries."""
        groups = self.window_groups(None)
        return groups[len(groups) - len(self.long_seqs):]   # after the short queries' group

    def window_groups(self, sliding_window: int | None) -> list[AttentionGroup]:
        """`groups` for queries that see only the last `sliding_window` keys up to their own
        position (None: every key up to it), built on first use per window and reused by every
        layer with that window. Each sequence's blocks start at the first block its first query
        sees, so blocks wholly before the window are never gathered."""
        groups = self._groups.get(sliding_window)
        if groups is None:
            short = np.flatnonzero(np.diff(self.query_start) <= MAX_BATCHED_QUERY_LEN)
            groups = [_group(short, self, sliding_window)] if len(short) else []
            groups += [_group([i], self, sliding_window) for i in self.long_seqs]
            self._groups[sliding_window] = groups
        return groups


def check_attention_options(scale: float | None, sliding_window: int | None, softcap: float | None) -> None:
    """paged_attention's options, or a ValueError saying what is accepted."""
    if scale is not None and not (isinstance(scale, (int, float, np.floating)) and math.isfinite(scale)):
        raise ValueError(f"scale must be a finite float or None (1/sqrt(head_dim)), got {scale!r}")
    if sliding_window is not None and not (isinstance(sliding_window, (int, np.integer)) and sliding_window >= 1):
        raise ValueError(f"sliding_window must be an int >= 1 or None (no window), got {sliding_window!r}")
    if softcap is not None and not (isinstance(softcap, (int, float, np.floating)) and softcap > 0
                                    and math.isfinite(softcap)):
        raise ValueError(f"softcap must be a finite float > 0 or None (no cap), got {softcap!r}")


def build_metadata(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                   block_size: int) -> AttentionMetadata:
    """Index arrays for a flattened batch of sequences.

    Sequence i owns rows query_start[i]:query_start[i+1] of the batch, which are the tokens at
    positions seq_lens[i] - query_lens[i] .. seq_lens[i] - 1 of that sequence.
    Example: query_lens [2, 3], seq_lens [5, 3], block_size 4, block_tables [[7, 2], [5]]
      -> query_start [0, 2, 5]; positions [3, 4, 0, 1, 2];
         slots [7*4+3, 2*4+0, 5*4+0, 5*4+1, 5*4+2] = [31, 8, 20, 21, 22].
    """
    num_seqs = len(query_lens)
    lens = np.asarray(query_lens, dtype=np.int64)                          # [num_seqs]
    ctx = np.asarray(seq_lens, dtype=np.int64)                             # [num_seqs]
    query_start = np.zeros(num_seqs + 1, dtype=np.int64)                   # [num_seqs + 1]
    np.cumsum(lens, out=query_start[1:])
    num_tokens = int(query_start[-1])
    # Row r belongs to sequence seq_of_row[r]; its position counts back from that sequence's end.
    seq_of_row = np.repeat(np.arange(num_seqs), lens)                      # [num_tokens]
    positions = np.arange(num_tokens) - query_start[seq_of_row] + (ctx - lens)[seq_of_row]
    num_blocks = np.fromiter(map(len, block_tables), dtype=np.int64, count=num_seqs)  # [num_seqs]
    max_blocks = int(num_blocks.max(initial=0))
    tables = np.zeros((num_seqs, max(max_blocks, 1)), dtype=np.int32)     # [num_seqs, max_blocks]
    # Row i's first num_blocks[i] entries, filled in row-major order from the tables laid end to end.
    tables[np.arange(tables.shape[1]) < num_blocks[:, None]] = np.fromiter(
        itertools.chain.from_iterable(block_tables), dtype=np.int32, count=int(num_blocks.sum()))
    slot_mapping = tables[seq_of_row, positions // block_size].astype(np.int64) * block_size \
        + positions % block_size                                            # [num_tokens]
    return AttentionMetadata(positions, query_start, ctx, slot_mapping, tables, block_size)


def _group(seqs, meta: AttentionMetadata, sliding_window: int | None) -> AttentionGroup:
    """The padded group of sequences `seqs`. Example: a decode at position 9, block size 4,
    window 3 sees keys 7..9, so its blocks start at table entry 7 // 4 = 1 (key positions 4..11)."""
    seqs = np.asarray(seqs, dtype=np.int64)
    bs = meta.block_size
    lens = (meta.query_start[seqs + 1] - meta.query_start[seqs])   # [B]
    ctx = meta.seq_lens[seqs]                                      # [B]
    max_q = int(lens.max())
    offsets = np.arange(max_q)                                     # [max_q]
    query_valid = offsets[None, :] < lens[:, None]                 # [B, max_q]
    query_rows = np.where(query_valid, meta.query_start[seqs][:, None] + offsets[None, :], 0)
    # Query j of sequence b sits at position ctx - len + j and sees keys at positions <= it (and,
    # with a window w, > it - w): the first query's first key decides the first block gathered.
    query_pos = ctx[:, None] - lens[:, None] + offsets[None, :]    # [B, max_q]
    first_key = np.zeros_like(ctx) if sliding_window is None else np.maximum(0, ctx - lens - sliding_window + 1)
    first_block = first_key // bs                                  # [B]
    end_block = -(-ctx // bs)                                      # [B] past the last block
    max_blocks = int((end_block - first_block).max())
    table_index = first_block[:, None] + np.arange(max_blocks)     # [B, max_blocks]
    in_table = table_index < end_block[:, None]
    block_ids = np.where(in_table, meta.block_tables[seqs[:, None], np.minimum(table_index, end_block[:, None] - 1)],
                         0).astype(np.int64)                       # [B, max_blocks] padded with block 0
    key_pos = (table_index[:, :, None] * bs + np.arange(bs)).reshape(len(seqs), 1, -1)   # [B, 1, max_blocks * bs]
    allowed = key_pos <= query_pos[:, :, None]                     # [B, max_q, max_blocks * bs]
    if sliding_window is not None:
        allowed &= key_pos > query_pos[:, :, None] - sliding_window
    allowed |= ~query_valid[:, :, None]
    bias = np.where(allowed, np.float32(0.0), np.float32(-np.inf))  # [B, max_q, ctx]
    return AttentionGroup(query_rows, query_valid, block_ids, bias[:, None])
