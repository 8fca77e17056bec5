"""The numba decode kernel's explicit-vector products (kernels/numba/key_products.py) against
numpy: KEYS scores of one query head, each in its own lane, and a weighted sum of KEYS values,
at offsets and strides like a block of a cache with several KV heads. They run at the width of
the machine's registers (WIDTH); on an AVX-512 machine the last test runs them again compiled for
AVX2."""

from __future__ import annotations

import numpy as np
import pytest
from numba import njit
from numba.core.errors import TypingError

from vllmlite.kernels.numba import key_products
from vllmlite.kernels.numba.key_products import KEYS, LANES

# Intrinsics are called from compiled code only.
dot_keys = njit(lambda *args: key_products.dot_keys(*args))
add_weighted_values = njit(lambda *args: key_products.add_weighted_values(*args))


@pytest.mark.parametrize("head_dim", [LANES, 64, 80, 128])
@pytest.mark.parametrize("num_kv_heads, kv", [(1, 0), (3, 2)])
def test_dot_keys_puts_each_keys_score_in_its_lane(head_dim, num_kv_heads, kv):
    rng = np.random.default_rng(head_dim + kv)
    keys = rng.standard_normal((KEYS + 3, num_kv_heads, head_dim)).astype(np.float32)
    q = rng.standard_normal((4, head_dim)).astype(np.float32)
    scores = np.full((4, 40), np.nan, np.float32)
    first, h, t0 = 2, 3, 5                       # keys 2 .. 17 of the block, query head 3, scores from 5
    dot_keys(q, h * head_dim, keys, (first * num_kv_heads + kv) * head_dim, num_kv_heads * head_dim,
             head_dim // LANES, scores, h * scores.shape[1] + t0)
    expected = keys[first:first + KEYS, kv].astype(np.float64) @ q[h].astype(np.float64)
    np.testing.assert_allclose(scores[h, t0:t0 + KEYS], expected, rtol=1e-5, atol=1e-5 * np.sqrt(head_dim))
    untouched = np.ones(scores.shape, bool)
    untouched[h, t0:t0 + KEYS] = False
    assert np.isnan(scores[untouched]).all()


@pytest.mark.parametrize("head_dim", [LANES, 64, 128])
def test_add_weighted_values_adds_the_weighted_sum_to_acc(head_dim):
    rng = np.random.default_rng(head_dim)
    num_kv_heads, kv, first, h, t0 = 2, 1, 1, 2, 7
    values = rng.standard_normal((KEYS + 1, num_kv_heads, head_dim)).astype(np.float32)
    p = rng.uniform(0, 1, (3, 30)).astype(np.float32)
    acc = rng.standard_normal((3, head_dim)).astype(np.float32)
    expected = acc.astype(np.float64)
    expected[h] += p[h, t0:t0 + KEYS].astype(np.float64) @ values[first:first + KEYS, kv].astype(np.float64)
    add_weighted_values(p, h * p.shape[1] + t0, values, (first * num_kv_heads + kv) * head_dim,
                        num_kv_heads * head_dim, head_dim // LANES, acc, h * head_dim)
    np.testing.assert_allclose(acc, expected, rtol=1e-5, atol=1e-5)


def test_products_take_only_float32():
    """float64 rows go the decode kernel's plain loops: the products refuse them at compile time."""
    with pytest.raises(TypingError):
        dot_keys(np.zeros(LANES), 0, np.zeros((KEYS, LANES)), 0, LANES, 1, np.zeros(KEYS), 0)


def int8_rows(rng, num, num_kv_heads, head_dim):
    """int8 values [num, num_kv_heads, head_dim] with a float32 scale per group of LANES, and what
    they read as (kv_dtype's widening: value times scale, in float32)."""
    data = rng.integers(-127, 128, (num, num_kv_heads, head_dim), dtype=np.int8)
    scales = rng.uniform(0.001, 0.05, (num, num_kv_heads, head_dim // LANES)).astype(np.float32)
    return data, scales, data.astype(np.float32) * np.repeat(scales, LANES, axis=2)


@pytest.mark.parametrize("heads", [1, 2, 3])
@pytest.mark.parametrize("head_dim", [LANES, 64, 128])
def test_int8_dot_keys_scores_each_head_of_the_pass_from_the_packed_keys(heads, head_dim):
    rng = np.random.default_rng(heads * head_dim)
    keys = key_products.KEYS if heads == 1 else key_products.INT8_SCORE_KEYS
    num_kv_heads, kv, first, h0, t0 = 3, 1, 2, 1, 5
    data, scales, widened = int8_rows(rng, keys + 4, num_kv_heads, head_dim)
    q = rng.standard_normal((5, head_dim)).astype(np.float32)
    scores = np.full((5, 40), np.nan, np.float32)
    product = getattr(key_products, f"int8_dot_keys_{heads}")
    dot = njit(lambda *args: product(*args))
    chunks = head_dim // LANES
    dot(q, h0 * head_dim, data, scales, (first * num_kv_heads + kv) * head_dim, num_kv_heads * head_dim,
        (first * num_kv_heads + kv) * chunks, num_kv_heads * chunks, chunks, scores, h0 * scores.shape[1] + t0,
        scores.shape[1])
    for h in range(h0, h0 + heads):
        expected = widened[first:first + keys, kv].astype(np.float64) @ q[h].astype(np.float64)
        np.testing.assert_allclose(scores[h, t0:t0 + keys], expected, rtol=1e-5, atol=1e-5 * np.sqrt(head_dim))
    untouched = np.ones(scores.shape, bool)
    untouched[h0:h0 + heads, t0:t0 + keys] = False
    assert np.isnan(scores[untouched]).all()


@pytest.mark.parametrize("heads", [1, 2, 3])
@pytest.mark.parametrize("head_dim", [LANES, 64, 128])
def test_int8_add_values_adds_each_heads_weighted_sum_of_the_packed_values(heads, head_dim):
    rng = np.random.default_rng(heads + head_dim)
    num_kv_heads, kv, first, h0, t0 = 2, 1, 1, 1, 7
    data, scales, widened = int8_rows(rng, KEYS + 3, num_kv_heads, head_dim)
    p = rng.uniform(0, 1, (5, 30)).astype(np.float32)
    acc = rng.standard_normal((5, head_dim)).astype(np.float32)
    expected = acc.astype(np.float64)
    for h in range(h0, h0 + heads):
        expected[h] += p[h, t0:t0 + KEYS].astype(np.float64) @ widened[first:first + KEYS, kv].astype(np.float64)
    product = getattr(key_products, f"int8_add_values_{heads}")
    add = njit(lambda *args: product(*args))
    chunks = head_dim // LANES
    add(p, h0 * p.shape[1] + t0, p.shape[1], data, scales, (first * num_kv_heads + kv) * head_dim,
        num_kv_heads * head_dim, (first * num_kv_heads + kv) * chunks, num_kv_heads * chunks, chunks, acc,
        h0 * head_dim)
    np.testing.assert_allclose(acc, expected, rtol=1e-5, atol=1e-5)   # the heads outside the pass unchanged too
