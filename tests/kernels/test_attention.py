"""Paged attention against the dense reference: scattered block tables, GQA, every block size,
batches mixing decodes, short queries (the padded batched path) and long prefill chunks (the
per-sequence path); build_metadata's worked example; causality; unused cache slots never read."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from tests.reference import dense_attention
from vllmlite.kernels import Kernels
from vllmlite.kernels.attention_metadata import MAX_BATCHED_QUERY_LEN, build_metadata

HEAD_DIM = 8
GARBAGE = 1e4  # finite, and large enough that reading one such key or value would show


@dataclass
class Seq:
    """One sequence of a step: `query_len` new tokens ending at position `seq_len - 1`."""

    query_len: int
    seq_len: int
    block_table: list[int]
    q: np.ndarray  # [query_len, num_heads, head_dim]
    k: np.ndarray  # [seq_len, num_kv_heads, head_dim] keys at positions 0 .. seq_len - 1
    v: np.ndarray  # [seq_len, num_kv_heads, head_dim]


def batch_shapes(bs: int) -> list[tuple[int, int]]:
    """(query_len, seq_len) pairs, long and short interleaved so output rows are scattered:
    decodes ending mid-block and on a block edge, short queries (<= 16), the largest batched query,
    the smallest per-sequence one, a first prefill chunk, later chunks ending mid-block and on an edge."""
    def on_edge(query_len: int, extra_blocks: int) -> int:
        """The first block edge at or past `query_len`, plus `extra_blocks` blocks of context."""
        return (-(-query_len // bs) + extra_blocks) * bs

    long_len = MAX_BATCHED_QUERY_LEN + 1
    return [
        (1, 3 * bs),                                  # decode, context ends on a block edge
        (23, 2 * bs + 23),                            # long later chunk, mid-block unless bs | 23
        (1, 2 * bs + 1),                              # decode, one token into a new block
        (long_len, on_edge(long_len, 1)),             # the shortest per-sequence query, on an edge
        (5, bs + 7),                                  # short multi-token query
        (MAX_BATCHED_QUERY_LEN, MAX_BATCHED_QUERY_LEN),  # the longest batched query, whole prompt
        (40, 40),                                     # a first prefill chunk (> 16), from position 0
        (3, on_edge(3, 1)),                           # short query ending exactly on a block edge
        (2, 2),                                       # a two-token prompt
    ]


def make_batch(shapes: list[tuple[int, int]], num_heads: int, num_kv_heads: int, bs: int,
               dtype: np.dtype, rng: np.random.Generator, head_dim: int = HEAD_DIM) -> tuple[list[Seq], int]:
    """Sequences with block tables drawn from a random permutation of a pool with spare blocks.
    Block 0, which pads short block tables, is always a spare: padding reads only garbage."""
    needed = [-(-seq_len // bs) for _, seq_len in shapes]
    num_blocks = sum(needed) + 5                             # blocks 0 and 4 others nobody owns
    pool = (1 + rng.permutation(num_blocks - 1)).tolist()
    seqs = []
    for (query_len, seq_len), n in zip(shapes, needed):
        assert query_len <= seq_len
        table, pool = pool[:n], pool[n:]
        seqs.append(Seq(query_len, seq_len, table,
                        rng.standard_normal((query_len, num_heads, head_dim)).astype(dtype),
                        rng.standard_normal((seq_len, num_kv_heads, head_dim)).astype(dtype),
                        rng.standard_normal((seq_len, num_kv_heads, head_dim)).astype(dtype)))
    return seqs, num_blocks


def garbage_cache(num_slots: int, num_kv_heads: int, dtype: np.dtype, rng: np.random.Generator,
                  head_dim: int = HEAD_DIM) -> np.ndarray:
    return (GARBAGE * rng.uniform(-1, 1, (num_slots, num_kv_heads, head_dim))).astype(dtype)


def slots_of(table: list[int], positions: np.ndarray, bs: int) -> np.ndarray:
    return np.asarray(table)[positions // bs] * bs + positions % bs


def run_step(kernels: Kernels, seqs: list[Seq], k_cache: np.ndarray, v_cache: np.ndarray, bs: int) -> np.ndarray:
    """Write the already-computed context as earlier steps would have, then run this step."""
    for s in seqs:
        earlier = np.arange(s.seq_len - s.query_len)
        kernels.write_kv(k_cache, v_cache, s.k[earlier], s.v[earlier], slots_of(s.block_table, earlier, bs))
    meta = build_metadata([s.query_len for s in seqs], [s.seq_len for s in seqs],
                          [s.block_table for s in seqs], bs)
    new = [np.arange(s.seq_len - s.query_len, s.seq_len) for s in seqs]
    kernels.write_kv(k_cache, v_cache, np.concatenate([s.k[p] for s, p in zip(seqs, new)]),
                     np.concatenate([s.v[p] for s, p in zip(seqs, new)]), meta.slot_mapping)
    q = np.concatenate([s.q for s in seqs])                  # [num_tokens, num_heads, head_dim]
    return attend(kernels, q, k_cache, v_cache, meta)


def attend(kernels: Kernels, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, meta) -> np.ndarray:
    out = np.full_like(q, np.nan)
    kernels.paged_attention(q, k_cache, v_cache, meta, out)
    return out


def dense_outputs(seqs: list[Seq]) -> np.ndarray:
    return np.concatenate([dense_attention(s.q.astype(np.float64), s.k.astype(np.float64),
                                           s.v.astype(np.float64),
                                           np.arange(s.seq_len - s.query_len, s.seq_len)) for s in seqs])


@pytest.mark.parametrize("dtype, tolerance", [(np.float32, 1e-5), (np.float64, 1e-10)])
@pytest.mark.parametrize("bs", [1, 4, 16])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(2, 2), (6, 2), (8, 2)])
def test_paged_attention_matches_dense_on_scattered_mixed_batch(kernels, num_heads, num_kv_heads, bs, dtype,
                                                                tolerance):
    rng = np.random.default_rng(bs * 100 + num_heads)
    seqs, num_blocks = make_batch(batch_shapes(bs), num_heads, num_kv_heads, bs, dtype, rng)
    k_cache = garbage_cache(num_blocks * bs, num_kv_heads, dtype, rng)
    v_cache = garbage_cache(num_blocks * bs, num_kv_heads, dtype, rng)
    out = run_step(kernels, seqs, k_cache, v_cache, bs)
    assert out.dtype == dtype and out.shape == (sum(s.query_len for s in seqs), num_heads, HEAD_DIM)
    np.testing.assert_allclose(out, dense_outputs(seqs), rtol=0, atol=tolerance)


@pytest.mark.parametrize("head_dim", [64, 40])   # whole vectors (numba: key_products.py) or not (its loops)
@pytest.mark.parametrize("bs", [8, 16, 32])
def test_long_decodes_match_dense_at_model_head_dims(kernels, bs, head_dim):
    """Decodes whose contexts end mid-block and on an edge, over one and several decode parts,
    with GQA, at the head sizes of real models: the products a whole run of keys at a time."""
    rng = np.random.default_rng(bs + head_dim)
    shapes = [(1, 5), (1, 17), (1, 16 * 20), (1, 16 * 20 + 9), (1, 700)]
    seqs, num_blocks = make_batch(shapes, 6, 2, bs, np.float32, rng, head_dim)
    k_cache = garbage_cache(num_blocks * bs, 2, np.float32, rng, head_dim)
    v_cache = garbage_cache(num_blocks * bs, 2, np.float32, rng, head_dim)
    out = run_step(kernels, seqs, k_cache, v_cache, bs)
    np.testing.assert_allclose(out, dense_outputs(seqs), rtol=0, atol=1e-5)


@pytest.mark.parametrize("bs", [1, 4, 16])
def test_slots_outside_each_context_are_never_read(kernels, bs):
    """Two runs whose caches differ only where no sequence's context lives (unowned blocks, the
    tail of each last block, block 0 used as padding) give bit-identical outputs."""
    rng = np.random.default_rng(7)
    seqs, num_blocks = make_batch(batch_shapes(bs), 8, 2, bs, np.float64, rng)
    outputs = []
    for seed in (1, 2):
        garbage = np.random.default_rng(seed)
        k_cache = garbage_cache(num_blocks * bs, 2, np.float64, garbage)
        v_cache = garbage_cache(num_blocks * bs, 2, np.float64, garbage)
        outputs.append(run_step(kernels, seqs, k_cache, v_cache, bs))
    np.testing.assert_array_equal(outputs[0], outputs[1])


def test_build_metadata_docstring_example():
    meta = build_metadata([2, 3], [5, 3], [[7, 2], [5]], block_size=4)
    np.testing.assert_array_equal(meta.slot_mapping, [31, 8, 20, 21, 22])
    np.testing.assert_array_equal(meta.positions, [3, 4, 0, 1, 2])
    np.testing.assert_array_equal(meta.query_start, [0, 2, 5])
    assert meta.block_size == 4
    [group] = meta.groups  # both queries are short: one padded group
    np.testing.assert_array_equal(group.query_rows, [[0, 1, 0], [2, 3, 4]])
    np.testing.assert_array_equal(group.query_valid, [[True, True, False], [True, True, True]])
    np.testing.assert_array_equal(group.block_ids, [[7, 2], [5, 0]])
    # Sequence 0's queries sit at positions 3 and 4, sequence 1's at 0, 1 and 2.
    np.testing.assert_array_equal(group.mask[:, 0].sum(axis=-1), [[4, 5, 0], [1, 2, 3]])


def test_build_metadata_gives_each_long_query_its_own_group():
    long_len = MAX_BATCHED_QUERY_LEN + 1
    meta = build_metadata([1, long_len, 2, long_len], [9, long_len, 4, 30],
                          [[3, 1, 4], [0, 6, 8, 9, 10], [2], [11, 12, 13, 14, 15, 16, 17, 18]], 4)
    assert [g.query_rows[g.query_valid].tolist() for g in meta.groups] == [
        [0, long_len + 1, long_len + 2],
        list(range(1, long_len + 1)),
        list(range(long_len + 3, 2 * long_len + 3)),
    ]
    # Decode at position 8: block 4 (the table's third entry), offset 0.
    assert meta.slot_mapping[0] == 4 * 4 + 0


@pytest.mark.parametrize("query_len", [6, MAX_BATCHED_QUERY_LEN + 4])
def test_queries_never_attend_to_later_positions(kernels, query_len):
    """Changing the key and value at position p changes no output before p, and does change p's."""
    bs = 4
    rng = np.random.default_rng(query_len)
    seqs, num_blocks = make_batch([(query_len, query_len), (1, 6)], 6, 2, bs, np.float64, rng)
    k_cache = garbage_cache(num_blocks * bs, 2, np.float64, rng)
    v_cache = garbage_cache(num_blocks * bs, 2, np.float64, rng)
    meta = build_metadata([s.query_len for s in seqs], [s.seq_len for s in seqs],
                          [s.block_table for s in seqs], bs)
    before = run_step(kernels, seqs, k_cache, v_cache, bs)
    q = np.concatenate([s.q for s in seqs])
    for p in (1, query_len // 2, query_len - 1):
        perturbed_k, perturbed_v = k_cache.copy(), v_cache.copy()
        slot = meta.slot_mapping[p]
        perturbed_k[slot] += 5.0
        perturbed_v[slot] += 100.0
        after = attend(kernels, q, perturbed_k, perturbed_v, meta)
        np.testing.assert_array_equal(after[:p], before[:p])
        np.testing.assert_array_equal(after[query_len:], before[query_len:])  # the other sequence
        assert np.abs(after[p] - before[p]).max() > 1e-3


def test_write_kv_touches_only_the_given_slots(kernels):
    rng = np.random.default_rng(0)
    k_cache, v_cache = rng.standard_normal((2, 12, 2, HEAD_DIM))
    k_before, v_before = k_cache.copy(), v_cache.copy()
    k, v = rng.standard_normal((2, 3, 2, HEAD_DIM))
    slots = np.array([9, 2, 5])
    kernels.write_kv(k_cache, v_cache, k, v, slots)
    np.testing.assert_array_equal(k_cache[slots], k)
    np.testing.assert_array_equal(v_cache[slots], v)
    others = np.setdiff1d(np.arange(12), slots)
    np.testing.assert_array_equal(k_cache[others], k_before[others])
    np.testing.assert_array_equal(v_cache[others], v_before[others])
