"""paged_attention's options (scale, sliding window, logit soft-cap) on every backend: the numpy
reference against a dense brute force that masks a full score matrix, every backend against the
reference (decodes, decodes split into parts, short queries, prefill chunks over cached context,
GQA), blocks wholly before the window never read, and unsupported values refused."""

from __future__ import annotations

import numpy as np
import pytest

from vllmlite.kernels import reference
from vllmlite.kernels.attention_metadata import build_metadata
from vllmlite.kernels.numba.attention import DECODE_PART

HEAD_DIM = 8
OPTIONS = [  # (scale, sliding_window, softcap)
    (None, None, None),
    (0.3, None, None),
    (None, 5, None),
    (None, None, 2.0),
    (0.7, 16, 1.5),
    (None, 1, None),       # a query sees only itself
    (None, 33, 3.0),       # a window ending inside a block
    (None, 300, None),     # a decode window of two DECODE_PART parts
    (None, 10_000, None),  # wider than every context: the causal mask alone
]
# (queries, sequence length): decodes short and long (several DECODE_PART parts), short queries,
# prefill chunks over cached context and from position 0.
SHAPES = [(1, 3), (1, 40), (1, DECODE_PART + 37), (1, 3 * DECODE_PART), (5, 60), (8, 8), (2, 17), (30, 90), (13, 13), (40, 75)]


def brute_force(q, k, v, q_positions, scale, sliding_window, softcap):
    """One sequence: q [n, heads, d] at q_positions over k, v [ctx, kv_heads, d] at 0 .. ctx - 1,
    through the full [heads, n, ctx] score matrix and a dense mask (transformers' sliding-window
    mask: key > query - window)."""
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)           # [ctx, heads, d]
    scores = np.einsum("nhd,lhd->hnl", q, k) * (1 / np.sqrt(q.shape[-1]) if scale is None else scale)
    if softcap is not None:
        scores = softcap * np.tanh(scores / softcap)
    key, query = np.arange(k.shape[0])[None, :], q_positions[:, None]
    allowed = key <= query                                                     # [n, ctx]
    if sliding_window is not None:
        allowed &= key > query - sliding_window
    scores = np.where(allowed[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    return np.einsum("hnl,lhd->nhd", probs, v)                                 # [n, heads, d]


def make_step(shapes, num_heads, num_kv_heads, bs, dtype, seed):
    """A step over `shapes` with scattered block tables (block 0 and two others owned by no one),
    its K/V written in the cache. Returns (meta, q, k_cache, v_cache, per-sequence (k, v))."""
    rng = np.random.default_rng(seed)
    needed = [-(-seq_len // bs) for _, seq_len in shapes]
    num_blocks = sum(needed) + 3
    pool = (1 + rng.permutation(num_blocks - 1)).tolist()
    tables, contexts = [], []
    k_cache = rng.uniform(-1e4, 1e4, (num_blocks * bs, num_kv_heads, HEAD_DIM)).astype(dtype)
    v_cache = rng.uniform(-1e4, 1e4, (num_blocks * bs, num_kv_heads, HEAD_DIM)).astype(dtype)
    for (_, seq_len), n in zip(shapes, needed):
        table, pool = pool[:n], pool[n:]
        k, v = rng.standard_normal((2, seq_len, num_kv_heads, HEAD_DIM)).astype(dtype)
        positions = np.arange(seq_len)
        slots = np.asarray(table)[positions // bs] * bs + positions % bs
        k_cache[slots], v_cache[slots] = k, v
        tables.append(table)
        contexts.append((k, v))
    meta = build_metadata([q for q, _ in shapes], [s for _, s in shapes], tables, bs)
    q = rng.standard_normal((int(meta.query_start[-1]), num_heads, HEAD_DIM)).astype(dtype)
    return meta, q, k_cache, v_cache, contexts


def attend(kernels, q, k_cache, v_cache, meta, **options):
    out = np.full_like(q, np.nan)
    kernels.paged_attention(q, k_cache, v_cache, meta, out, **options)
    return out


def options_id(option):
    return "scale={}-window={}-softcap={}".format(*option)


@pytest.mark.parametrize("option", OPTIONS, ids=options_id)
@pytest.mark.parametrize("bs", [1, 4, 16])
def test_the_reference_matches_a_dense_masked_brute_force(option, bs):
    scale, sliding_window, softcap = option
    meta, q, k_cache, v_cache, contexts = make_step(SHAPES, 6, 2, bs, np.float64, seed=bs)
    out = attend(reference, q, k_cache, v_cache, meta, scale=scale, sliding_window=sliding_window, softcap=softcap)
    expected = np.concatenate([
        brute_force(q[meta.query_start[i]:meta.query_start[i + 1]], k, v,
                    meta.positions[meta.query_start[i]:meta.query_start[i + 1]], *option)
        for i, (k, v) in enumerate(contexts)])
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("option", OPTIONS, ids=options_id)
@pytest.mark.parametrize("dtype, tolerance", [(np.float32, 1e-5), (np.float64, 1e-12)])
@pytest.mark.parametrize("heads, kv_heads, bs", [(6, 2, 16), (4, 4, 1), (8, 2, 7)])
def test_every_backend_matches_the_reference_with_options(kernels, option, dtype, tolerance, heads, kv_heads, bs):
    scale, sliding_window, softcap = option
    options = dict(scale=scale, sliding_window=sliding_window, softcap=softcap)
    meta, q, k_cache, v_cache, _ = make_step(SHAPES, heads, kv_heads, bs, dtype, seed=heads + bs)
    expected = attend(reference, q, k_cache, v_cache, meta, **options)
    np.testing.assert_allclose(attend(kernels, q, k_cache, v_cache, meta, **options), expected, rtol=0, atol=tolerance)


@pytest.mark.parametrize("placeholder", [False, True], ids=["nan_blocks", "placeholder_ids"])
@pytest.mark.parametrize("sliding_window", [1, 4, 9, 300])
def test_blocks_wholly_before_the_window_are_never_read(kernels, sliding_window, placeholder):
    """NaN in every block that lies wholly before the window of a sequence's first query (or those
    table entries pointing at one NaN block owned by no one, as after the block manager frees
    them): the output is bit-identical to that over the intact cache. (Not block 0: the reference
    reads it as padding.)"""
    bs = 4
    meta, q, k_cache, v_cache, _ = make_step(SHAPES, 6, 2, bs, np.float32, seed=sliding_window)
    expected = attend(kernels, q, k_cache, v_cache, meta, sliding_window=sliding_window)
    placeholder_block = int(np.setdiff1d(np.arange(1, len(k_cache) // bs), meta.block_tables)[0])
    num_hidden = 0
    for i in range(len(meta.seq_lens)):
        first_query = int(meta.positions[meta.query_start[i]])
        unseen = meta.block_tables[i, :max(0, first_query - sliding_window + 1) // bs]   # wholly before
        num_hidden += len(unseen)
        k_cache[unseen * bs] = np.nan              # a block's first and last slot: enough to show a read
        v_cache[unseen * bs + bs - 1] = np.nan
        if placeholder:
            meta.block_tables[i, :len(unseen)] = placeholder_block
    k_cache[placeholder_block * bs:(placeholder_block + 1) * bs] = np.nan
    v_cache[placeholder_block * bs:(placeholder_block + 1) * bs] = np.nan
    assert num_hidden > 0
    got = attend(kernels, q, k_cache, v_cache, meta, sliding_window=sliding_window)
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("options, message", [
    (dict(sliding_window=0), "sliding_window must be an int >= 1"),
    (dict(sliding_window=2.5), "sliding_window must be an int >= 1"),
    (dict(softcap=0.0), "softcap must be a finite float > 0"),
    (dict(softcap=-1.0), "softcap must be a finite float > 0"),
    (dict(scale=float("nan")), "scale must be a finite float"),
])
def test_unsupported_options_are_refused(kernels, options, message):
    meta, q, k_cache, v_cache, _ = make_step([(1, 5)], 2, 2, 4, np.float32, seed=0)
    with pytest.raises(ValueError, match=message):
        attend(kernels, q, k_cache, v_cache, meta, **options)


def test_a_window_bounds_the_work_of_the_compiled_paths():
    """The numba backend's decode parts cover only a decode's window (O(window), not O(context)),
    and a long chunk gathers only the blocks from the one holding its first query's first key."""
    from vllmlite.kernels.numba.attention import _decode_parts
    from vllmlite.kernels.prefill_attention import prepare_chunk
    first_item, _ = _decode_parts(np.array([0, 1, 2, 42]), np.array([5000, 100, 90]), 600)
    assert np.diff(first_item).tolist() == [3, 1, 1]           # ceil(600 / 256), the short context, a chunk
    meta, q, k_cache, v_cache, _ = make_step([(40, 1000)], 2, 2, 16, np.float32, seed=0)
    chunk = prepare_chunk(q, k_cache, v_cache, meta, 0, sliding_window=100)
    assert chunk.key_start == (960 - 100 + 1) // 16 * 16 and chunk.keys.shape[1] == -(-1000 // 16) * 16 - chunk.key_start
