"""The tiled attention of long prefill chunks (vllmlite/kernels/prefill_attention.py) against the
dense reference (reference.attend_group): tiles smaller than the chunk and not dividing it, chunks
after earlier ones, contexts ending mid-block, GQA, a block table padded in a batch."""

from __future__ import annotations

import json

import numba
import numpy as np
import pytest

from bench import prefill_attention
from vllmlite.kernels import numba as numba_kernels
from vllmlite.kernels import reference
from vllmlite.kernels.attention_metadata import build_metadata
from vllmlite.kernels.numba import attention as numba_attention
from vllmlite.kernels.prefill_attention import attend_chunk

HEAD_DIM = 16
TOLERANCE = {np.float32: 1e-5, np.float64: 1e-12}


# (queries, tokens computed before, block size, heads, KV heads, tile)
CASES = [
    (300, 0, 16, 9, 3, 128),    # a first chunk: three tiles, the last one ragged
    (300, 100, 16, 9, 3, 128),  # a chunk after one of 100 tokens, mid-block
    (17, 0, 4, 4, 2, 5),        # the shortest long chunk, tiles of 5
    (40, 23, 7, 6, 2, 16),      # block size 7: nothing on a block edge
    (64, 500, 16, 2, 2, 64),    # one tile exactly, after a long context, no GQA
    (33, 1, 1, 8, 2, 8),        # block size 1
    (100, 28, 16, 9, 3, 256),   # a tile longer than the chunk
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("num_queries, computed, bs, num_heads, num_kv_heads, tile", CASES)
def test_tiled_attention_matches_the_dense_reference(num_queries, computed, bs, num_heads, num_kv_heads,
                                                     tile, dtype):
    """The chunk is the middle sequence of a step between a decode with a longer block table (so
    the chunk's table is padded with block 0) and a short query; the cache outside its context
    is large garbage, which would show if it were read. Only the chunk's rows are written."""
    rng = np.random.default_rng(num_queries * 1000 + computed)
    seq_len = computed + num_queries
    shapes = [(1, seq_len + 3 * bs), (num_queries, seq_len), (3, 9)]   # (queries, sequence length)
    needed = [-(-length // bs) for _, length in shapes]
    num_blocks = sum(needed) + 4
    pool = (1 + rng.permutation(num_blocks - 1)).tolist()               # block 0 belongs to no one
    tables = []
    for n in needed:
        tables.append(pool[:n])
        pool = pool[n:]
    k_cache = (1e4 * rng.uniform(-1, 1, (num_blocks * bs, num_kv_heads, HEAD_DIM))).astype(dtype)
    v_cache = (1e4 * rng.uniform(-1, 1, (num_blocks * bs, num_kv_heads, HEAD_DIM))).astype(dtype)
    meta = build_metadata([q for q, _ in shapes], [s for _, s in shapes], tables, bs)
    context = np.arange(seq_len)
    slots = np.asarray(tables[1])[context // bs] * bs + context % bs
    k_cache[slots] = rng.standard_normal((seq_len, num_kv_heads, HEAD_DIM))
    v_cache[slots] = rng.standard_normal((seq_len, num_kv_heads, HEAD_DIM))
    q = rng.standard_normal((int(meta.query_start[-1]), num_heads, HEAD_DIM)).astype(dtype)
    assert meta.long_seqs.tolist() == [1] and len(tables[1]) < meta.block_tables.shape[1]

    expected = np.full_like(q, np.nan)
    reference.attend_group(q, k_cache, v_cache, meta.long_groups[0], bs, expected)
    out = np.full_like(q, np.nan)
    attend_chunk(q, k_cache, v_cache, meta, 1, out, tile)
    rows = slice(meta.query_start[1], meta.query_start[2])
    np.testing.assert_allclose(out[rows], expected[rows], rtol=0, atol=TOLERANCE[dtype])
    assert np.isnan(out[:rows.start]).all() and np.isnan(out[rows.stop:]).all()


def test_each_query_sees_exactly_the_keys_up_to_its_own_position():
    """Values that are one-hot in their position and equal keys: query j's output is uniform
    over positions 0 .. computed + j and zero past it, wherever j falls in its tile."""
    bs, computed, num_queries, tile = 4, 6, 21, 8
    seq_len = computed + num_queries
    meta = build_metadata([num_queries], [seq_len], [list(range(-(-seq_len // bs)))], bs)
    num_slots = meta.block_tables.shape[1] * bs
    k_cache = np.zeros((num_slots, 1, seq_len))
    v_cache = np.zeros((num_slots, 1, seq_len))
    v_cache[np.arange(seq_len), 0, np.arange(seq_len)] = 1.0              # value p: one-hot at p
    q = np.zeros((num_queries, 2, seq_len))
    out = np.full_like(q, np.nan)
    attend_chunk(q, k_cache, v_cache, meta, 0, out, tile)
    positions = computed + np.arange(num_queries)
    expected = (np.arange(seq_len)[None, :] <= positions[:, None]) / (positions[:, None] + 1.0)
    np.testing.assert_allclose(out[:, 0], expected, atol=1e-15)
    np.testing.assert_allclose(out[:, 1], expected, atol=1e-15)


def test_benchmark_quick_run_records_both_variants_agreeing(tmp_path):
    """`python -m bench.prefill_attention --quick`: both prefill variants pick the same greedy
    token, and every variant of every length is timed."""
    out = tmp_path / "prefill.json"
    prefill_attention.main(["--quick", "--out", str(out)])
    report = json.loads(out.read_text())
    assert "-m bench.prefill_attention --quick" in report["command"]
    for row in report["prefill"]:
        assert row["same_greedy_token"] and row["max_abs_logit_diff"] < 1e-3
        assert row["dense"]["median_ms"] > 0 and row["tiled"]["median_ms"] > 0
    assert [row["num_tokens"] for row in report["attention_one_layer"]] == [64, 128]
    assert set(report["attention_one_layer"][0]) >= {"dense", "tile_32", "tile_64"}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_numba_backend_on_several_threads_matches_the_reference(monkeypatch, dtype):
    """A step of three long chunks (a first one, two after earlier chunks) among decodes, their
    tiles dealt to several threads (the work threshold lowered to 0): the reference's output."""
    if numba.get_num_threads() < 2:
        pytest.skip("one numba thread: the tiles run on this one")
    monkeypatch.setattr(numba_attention, "PARALLEL_MIN_TILE_PAIRS", 0)
    rng = np.random.default_rng(3)
    bs, num_kv_heads, num_heads = 16, 3, 9
    shapes = [(1, 70), (150, 150), (1, 33), (90, 290), (130, 131)]     # (queries, sequence length)
    needed = [-(-length // bs) for _, length in shapes]
    pool = rng.permutation(sum(needed) + 2).tolist()
    tables = []
    for n in needed:
        tables.append(pool[:n])
        pool = pool[n:]
    k_cache = rng.standard_normal(((sum(needed) + 2) * bs, num_kv_heads, HEAD_DIM)).astype(dtype)
    v_cache = rng.standard_normal(k_cache.shape).astype(dtype)
    meta = build_metadata([q for q, _ in shapes], [s for _, s in shapes], tables, bs)
    q = rng.standard_normal((int(meta.query_start[-1]), num_heads, HEAD_DIM)).astype(dtype)
    expected, out = np.empty_like(q), np.full_like(q, np.nan)
    reference.paged_attention(q, k_cache, v_cache, meta, expected)
    numba_kernels.paged_attention(q, k_cache, v_cache, meta, out)
    np.testing.assert_allclose(out, expected, rtol=0, atol=TOLERANCE[dtype])


def test_layers_of_one_step_each_attend_their_own_context():
    """The gathered context's buffers belong to the step and are reused by every layer: two
    layers' caches attended in turn with the same metadata each match the reference, and the
    second layer's output does not depend on the first having run."""
    rng = np.random.default_rng(11)
    bs, num_kv_heads, num_heads = 4, 2, 4
    shapes = [(1, 40), (20, 60), (12, 30)]     # (queries, sequence length): a decode, two long chunks
    needed = [-(-length // bs) for _, length in shapes]
    tables = np.split(rng.permutation(sum(needed)), np.cumsum(needed)[:-1])
    meta = build_metadata([q for q, _ in shapes], [s for _, s in shapes], [t.tolist() for t in tables], bs)
    assert meta.long_seqs.tolist() == [1, 2]
    q = rng.standard_normal((int(meta.query_start[-1]), num_heads, HEAD_DIM))
    layers = [tuple(rng.standard_normal((sum(needed) * bs, num_kv_heads, HEAD_DIM)) for _ in range(2))
              for _ in range(2)]
    outputs = []
    for k_cache, v_cache in layers:
        expected, out = np.empty_like(q), np.full_like(q, np.nan)
        reference.paged_attention(q, k_cache, v_cache, meta, expected)
        numba_kernels.paged_attention(q, k_cache, v_cache, meta, out)
        np.testing.assert_allclose(out, expected, rtol=0, atol=1e-12)
        outputs.append(out)
    assert not np.allclose(outputs[0], outputs[1])
