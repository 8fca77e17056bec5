"""Packed KV caches (kv_cache_dtype fp16, bf16, int8: vllmlite/kernels/kv_dtype.py): the rounding's
bounds, numba's paged attention against the numpy reference on the same packed cache (decodes,
short queries, long prefill chunks after cached context, with and without a sliding window), and
block copies that carry int8's scales."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from tests.kernels.test_attention import HEAD_DIM, batch_shapes, make_batch, run_step, slots_of
from vllmlite.kernels import get_kernels, kv_dtype, reference
from vllmlite.kernels.attention_metadata import build_metadata
from vllmlite.kernels.kv_dtype import PackedKV

KINDS = ["fp16", "bf16", "int8"]


def packed_garbage(kind: str, num_slots: int, num_kv_heads: int, rng: np.random.Generator,
                   head_dim: int = HEAD_DIM) -> PackedKV:
    """A packed cache whose every slot holds large finite values: reading an unowned one would show."""
    cache = PackedKV(kind, (num_slots, num_kv_heads, head_dim))
    cache.store(np.arange(num_slots), 1e3 * rng.uniform(-1, 1, cache.shape).astype(np.float32))
    return cache


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_error_bounds(kind):
    """int8: |x - read| <= scale / 2 per element, scale = max |x| over the head / 127 (exactly 0 for a
    zero head); fp16 within 2^-11 relative (normal range), bf16 within 2^-8 relative."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((50, 3, HEAD_DIM)) * rng.uniform(0.01, 100, (50, 3, 1))).astype(np.float32)
    x[7, 1] = 0
    cache = PackedKV(kind, x.shape)
    slots = rng.permutation(50)
    cache.store(slots, x)
    read = cache.read(slots)
    assert read.dtype == np.float32
    error = np.abs(read - x)
    if kind == "int8":
        groups = kv_dtype.int8_groups(HEAD_DIM)
        scale = np.abs(x.reshape(50, 3, groups, -1)).max(axis=-1) / 127                  # [50, 3, groups]
        np.testing.assert_array_equal(cache.scales[slots], scale.astype(np.float32))
        assert (error.reshape(50, 3, groups, -1) <= scale[..., None] / 2 * (1 + 1e-6)).all()
        assert (read[7, 1] == 0).all() and (cache.scales[slots[7], 1] == 0).all()
        assert cache.nbytes == x.size + 4 * 50 * 3 * groups
    else:
        assert (error <= np.abs(x) * (2.0 ** -11 if kind == "fp16" else 2.0 ** -8)).all()
        assert cache.nbytes == 2 * x.size


def test_bf16_is_the_top_half_of_float32_rounded_to_nearest_even():
    x = np.array([1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, -2.5, 3.0e38], dtype=np.float32)
    data, _ = kv_dtype.encode("bf16", x)
    np.testing.assert_array_equal(data, [0x3F80, 0x3F80, 0x3F82, 0xC020, 0x7F62])   # ties to even
    np.testing.assert_array_equal(kv_dtype.decode("bf16", data, None)[[0, 3]], [1.0, -2.5])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bs, window", [(4, None), (16, None), (4, 21), (16, 37)])
def test_numba_matches_reference_on_packed_cache(kind, bs, window):
    """The same packed cache, written by each backend's write_kv: numba's decodes, short queries and
    long chunks (after cached context) agree with the reference's dense reading of it, and that
    reading is within the storage's rounding of the float32 cache's attention."""
    rng = np.random.default_rng(bs + (window or 0))
    num_heads, num_kv_heads = 6, 2
    seqs, num_blocks = make_batch(batch_shapes(bs), num_heads, num_kv_heads, bs, np.float32, rng)
    meta = build_metadata([s.query_len for s in seqs], [s.seq_len for s in seqs], [s.block_table for s in seqs], bs)
    q = np.concatenate([s.q for s in seqs])
    outputs = {}
    for name in ("numpy", "numba", "float32"):
        kernels = get_kernels("numba" if name == "numba" else "numpy")
        if name == "float32":
            k_cache, v_cache = (np.zeros((num_blocks * bs, num_kv_heads, HEAD_DIM), np.float32) for _ in "kv")
        else:
            k_cache, v_cache = (packed_garbage(kind, num_blocks * bs, num_kv_heads, np.random.default_rng(9))
                                for _ in "kv")
        for s in seqs:   # earlier steps' context, then this step's tokens through the step's slot mapping
            earlier = np.arange(s.seq_len - s.query_len)
            kernels.write_kv(k_cache, v_cache, s.k[earlier], s.v[earlier], slots_of(s.block_table, earlier, bs))
        new = [np.arange(s.seq_len - s.query_len, s.seq_len) for s in seqs]
        kernels.write_kv(k_cache, v_cache, np.concatenate([s.k[p] for s, p in zip(seqs, new)]),
                         np.concatenate([s.v[p] for s, p in zip(seqs, new)]), meta.slot_mapping)
        out = np.full_like(q, np.nan)
        kernels.paged_attention(q, k_cache, v_cache, meta, out, sliding_window=window)
        outputs[name] = out
    assert not np.isnan(outputs["numba"]).any()
    np.testing.assert_allclose(outputs["numba"], outputs["numpy"], rtol=0, atol=2e-5)
    # K/V are unit normals: int8's per-element error is <= max|x| / 254 (about 0.01 here), halves' smaller.
    atol = {"fp16": 2e-3, "bf16": 2e-2, "int8": 5e-2}[kind]
    np.testing.assert_allclose(outputs["numpy"], outputs["float32"], rtol=0, atol=atol)
    assert np.abs(outputs["numpy"] - outputs["float32"]).max() > 0   # the storage does round


@pytest.mark.parametrize("kind", KINDS)
def test_copy_slots_carries_scales_through_swap_and_copy_on_write(kind):
    """Blocks swapped out to a host cache, back in elsewhere, then copied (copy-on-write) read back
    exactly what was written: the data and, for int8, each token's scales."""
    rng = np.random.default_rng(3)
    bs, shape = 4, (8 * 4, 2, HEAD_DIM)
    device, host = PackedKV(kind, shape), PackedKV(kind, (3 * 4, 2, HEAD_DIM))
    x = (rng.standard_normal((8, 2, HEAD_DIM)) * rng.uniform(0.1, 10, (8, 2, 1))).astype(np.float32)
    block = np.arange(bs)
    device.store(np.concatenate([1 * bs + block, 5 * bs + block]), x)
    expected = device.read(np.concatenate([1 * bs + block, 5 * bs + block]))
    reference.copy_slots(device, host, np.concatenate([1 * bs + block, 5 * bs + block]),
                         np.concatenate([2 * bs + block, 0 * bs + block]))                      # swap out
    device.store(np.arange(shape[0]), np.zeros(shape, np.float32))                              # blocks reused
    reference.copy_slots(host, device, np.concatenate([2 * bs + block, 0 * bs + block]),
                         np.concatenate([6 * bs + block, 3 * bs + block]))                      # swap in
    reference.copy_slots(device, device, 3 * bs + block, 7 * bs + block)                        # copy-on-write
    np.testing.assert_array_equal(device.read(np.concatenate([6 * bs + block, 3 * bs + block])), expected)
    np.testing.assert_array_equal(device.read(7 * bs + block), expected[bs:])
    if kind == "int8":
        assert (device.scales[7 * bs + block] > 0).all()


def test_kv_bytes_per_token_counts_scales():
    assert kv_dtype.kv_bytes_per_token(2, 2, 64, "auto", 4) == 2 * 2 * 2 * 64 * 4
    assert kv_dtype.kv_bytes_per_token(2, 2, 64, "fp16", 4) == 2 * 2 * 2 * 64 * 2
    assert kv_dtype.kv_bytes_per_token(2, 2, 64, "bf16", 8) == 2 * 2 * 2 * 64 * 2
    assert kv_dtype.kv_bytes_per_token(2, 2, 64, "int8", 4) == 2 * 2 * 2 * (64 + 4 * 4)   # four groups of 16
    assert kv_dtype.kv_bytes_per_token(2, 2, 40, "int8", 4) == 2 * 2 * 2 * (40 + 4)       # 16 does not divide 40


def test_int8_scales_each_group_of_16_on_its_own():
    """A large value in one group of 16 leaves the other groups' steps as fine as their own values allow."""
    x = np.zeros((1, 1, 64), np.float32)
    x[0, 0, :16], x[0, 0, 16:] = 100.0, np.linspace(-1, 1, 48)
    cache = PackedKV("int8", x.shape)
    cache.store(np.array([0]), x)
    np.testing.assert_allclose(cache.scales[0, 0], np.abs(x[0, 0].reshape(4, 16)).max(axis=1) / 127, rtol=1e-6)
    assert cache.scales[0, 0, 0] == np.float32(100 / 127)
    assert np.abs(cache.read(np.array([0]))[0, 0, 16:] - x[0, 0, 16:]).max() <= 0.5 / 127 * (1 + 1e-6)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("head_dim", [HEAD_DIM, 64])   # int8: one scale a head, and four groups of 16
def test_compiled_block_reading_is_the_reference_widening_bit_for_bit(kind, dtype, head_dim):
    """numba's load_block (what the attention kernels read) against kv_dtype.decode, slot runs of every
    length and offset of a block; the values include fp16's subnormals, infinities, NaN and -0."""
    from numba import njit

    from vllmlite.kernels.numba.kv_read import block_scratch, cache_arrays, load_block

    @njit
    def read(data, scales, first, num, like):
        return load_block(data, scales, first, num, block_scratch(like, 4, data.shape[1])).copy()

    rng = np.random.default_rng(4)
    cache = packed_garbage(kind, 12 * 4, 3, rng, head_dim)
    cache.data[5] = 0   # a zero token (its int8 scale is 0)
    if kind == "fp16":   # every exponent, subnormals, +-inf, NaN, -0
        specials = np.array([0x0001, 0x03FF, 0x8001, 0x0400, 0x7BFF, 0x7C00, 0xFC00, 0x7E00, 0x8000, 0x3C00],
                            np.uint16).view(np.float16)
        cache.data[6:8] = rng.choice(np.concatenate([specials, cache.data[8:10].ravel()]), cache.data[6:8].shape)
    data, scales = cache_arrays(cache)
    like = np.zeros(head_dim, dtype)
    for first, num in [(0, 4), (4, 4), (5, 3), (6, 2), (7, 1), (8, 4), (44, 4)]:
        got = read(data, scales, first, num, like)
        expected = cache.read(np.arange(first, first + num), dtype)
        assert got.dtype == dtype and got.shape == (num, 3, head_dim)
        np.testing.assert_array_equal(got, expected)   # NaN where NaN, -0 as -0 is not checked by equality
        np.testing.assert_array_equal(np.signbit(got), np.signbit(expected))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("head_dim", [HEAD_DIM, 64])   # one scale a head, and four groups of 16
def test_compiled_int8_write_is_the_reference_encoding_bit_for_bit(dtype, head_dim):
    """numba's write_kv into an int8 cache stores kv_dtype.encode's bytes and scales exactly, ties of
    rint (x / scale exactly k + 1/2) and zero groups included, and touches only the given slots."""
    rng = np.random.default_rng(6)
    x = (rng.standard_normal((2, 7, 3, head_dim)) * rng.uniform(0.01, 100, (2, 7, 3, 1))).astype(dtype)
    x[0, 2, 1] = 0                                   # a zero head: scale 0, data 0
    x[1, 3, 0, :] = np.arange(head_dim) % 5 - 2.5    # levels at exact halves of the scale
    x[1, 3, 0, 0] = 127 * 0.5                        # scale 0.5: x / scale = 2 * x, .5 steps tie
    slots = np.array([9, 0, 4, 13, 2, 7, 11])
    caches = {name: [packed_garbage("int8", 16, 3, np.random.default_rng(1), head_dim) for _ in "kv"]
              for name in ("numpy", "numba")}
    for name, (k_cache, v_cache) in caches.items():
        get_kernels(name).write_kv(k_cache, v_cache, x[0], x[1], slots)
    for expected, got in zip(caches["numpy"], caches["numba"]):
        np.testing.assert_array_equal(got.data, expected.data)
        np.testing.assert_array_equal(got.scales, expected.scales)


@pytest.mark.parametrize("head_dim", [8, 64, 128, 48, 80, 96])
def test_the_int8_rotation_is_orthogonal_and_hadamard(head_dim):
    """R R^T = I, every entry of R's blocks +-1/sqrt(n), n the largest power of two dividing head_dim;
    an odd head_dim is stored unturned."""
    matrix = kv_dtype.rotation(head_dim)
    n = head_dim & -head_dim
    np.testing.assert_allclose(matrix @ matrix.T, np.eye(head_dim), atol=1e-6)
    blocks = [matrix[i:i + n, i:i + n] for i in range(0, head_dim, n)]
    assert all(np.allclose(np.abs(block), 1 / np.sqrt(n)) for block in blocks)
    assert np.count_nonzero(matrix) == head_dim * n
    assert kv_dtype.rotation(7) is None


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("head_dim", [8, 12, 64, 128, 80, 96, 7])
def test_the_turn_is_the_rotation_and_numba_turns_bit_for_bit_as_numpy(dtype, head_dim):
    """kv_dtype.turn (butterflies) is x @ rotation(head_dim) within rounding, and numba's turn_heads
    gives its bits exactly, from strided views (rows of head_dim apart, and feature-major as the
    model's workspace lays them out) into another array and in place (head_dims of whole
    8-element vectors take its vector path, the others its element loop)."""
    from vllmlite.kernels.numba.hadamard import turn_heads
    rng = np.random.default_rng(head_dim)
    wide = (rng.standard_normal((5, 4, head_dim + 3)) * rng.uniform(0.1, 50, (5, 4, 1))).astype(dtype)
    x = wide[:, 1:, 2:2 + head_dim]                       # strided along tokens and heads
    expected = kv_dtype.turn(x)
    matrix = kv_dtype.rotation(head_dim, dtype)
    if matrix is None:
        assert expected is x
    else:
        np.testing.assert_allclose(expected, x @ matrix, rtol=0, atol=np.abs(x).max() * head_dim * np.finfo(dtype).eps)
        assert not np.array_equal(expected, x)
    np.testing.assert_array_equal(turn_heads(x), expected)
    in_place = x.copy()
    turn_heads(in_place, in_place)
    np.testing.assert_array_equal(in_place, expected)
    feature_major = np.ascontiguousarray(x.transpose(2, 1, 0)).transpose(2, 1, 0)   # the workspace's views
    np.testing.assert_array_equal(turn_heads(feature_major), expected)


class Unturned:
    """A backend's write_kv and paged_attention without int8's rotation (unturned=True)."""

    def __init__(self, kernels) -> None:
        self.write_kv = functools.partial(kernels.write_kv, unturned=True)
        self.paged_attention = functools.partial(kernels.paged_attention, unturned=True)


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_int8_stores_keys_turned_and_the_rotation_shrinks_an_outlier_channels_error(backend):
    """write_kv stores k R in an int8 cache (the cache reads back k R within int8's rounding, not k),
    paged_attention turns its output back, and with one key channel 30x the others (as real models'
    K has) the attention error against float32 K/V is under half the unturned storage's."""
    rng = np.random.default_rng(5)
    bs, num_heads, num_kv_heads = 4, 6, 2
    seqs, num_blocks = make_batch(batch_shapes(bs), num_heads, num_kv_heads, bs, np.float32, rng)
    for s in seqs:
        s.k[..., 3] *= 30
    kernels = get_kernels(backend)
    outputs = {}
    for name, ops in (("float32", kernels), ("turned", kernels), ("unturned", Unturned(kernels))):
        shape = (num_blocks * bs, num_kv_heads, HEAD_DIM)
        k_cache, v_cache = ((np.zeros(shape, np.float32) for _ in "kv") if name == "float32"
                            else (PackedKV("int8", shape) for _ in "kv"))
        outputs[name] = run_step(ops, seqs, k_cache, v_cache, bs)
        if name == "turned":
            slots = slots_of(seqs[0].block_table, np.arange(seqs[0].seq_len), bs)
            stored, turned = k_cache.read(slots), seqs[0].k @ kv_dtype.rotation(HEAD_DIM)
            assert np.abs(stored - turned).max() <= np.abs(turned).max() / 254 * (1 + 1e-5)
            assert np.abs(stored - seqs[0].k).max() > 1
    turned_error = np.abs(outputs["turned"] - outputs["float32"]).max()
    unturned_error = np.abs(outputs["unturned"] - outputs["float32"]).max()
    assert turned_error < 0.5 * unturned_error, (turned_error, unturned_error)


# (query heads a KV head: the int8 products' passes of 1-3 heads; block size: runs shorter than a
# call's keys, one call, several; head_dim; query dtype: float64 widens a block at a time instead)
@pytest.mark.parametrize("group, bs, head_dim, dtype", [
    (1, 16, 64, np.float32), (2, 4, 64, np.float32), (3, 32, 64, np.float32), (4, 16, 64, np.float32),
    (5, 32, 128, np.float32), (7, 4, 64, np.float32), (3, 16, 128, np.float32), (3, 16, 64, np.float64)])
def test_numba_int8_decodes_read_in_place_match_the_reference(group, bs, head_dim, dtype):
    """Decodes over int8 K/V at model head sizes, where numba's products read the packed cache in
    place (block_products.packed_scores, float32 queries) or widen it a block at a time (float64):
    contexts ending mid-block and on an edge, over one and several decode parts, against the
    reference's dense reading of the same cache."""
    rng = np.random.default_rng(group * bs + head_dim)
    num_kv_heads = 2
    shapes = [(1, 5), (1, 17), (1, 16 * 20), (1, 16 * 20 + 9), (1, 700)]
    seqs, num_blocks = make_batch(shapes, group * num_kv_heads, num_kv_heads, bs, dtype, rng, head_dim)
    meta = build_metadata([1] * len(seqs), [s.seq_len for s in seqs], [s.block_table for s in seqs], bs)
    q = np.concatenate([s.q for s in seqs])
    k_cache, v_cache = (packed_garbage("int8", num_blocks * bs, num_kv_heads, rng, head_dim) for _ in "kv")
    for s in seqs:
        positions = np.arange(s.seq_len)
        reference.write_kv(k_cache, v_cache, s.k[positions], s.v[positions], slots_of(s.block_table, positions, bs))
    outputs = {}
    for name in ("numpy", "numba"):
        outputs[name] = np.full_like(q, np.nan)
        get_kernels(name).paged_attention(q, k_cache, v_cache, meta, outputs[name])
    np.testing.assert_allclose(outputs["numba"], outputs["numpy"], rtol=0, atol=2e-5)
