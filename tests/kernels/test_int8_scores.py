"""Integer scores over an int8 K cache (kv_dtype.round_queries; numba/key_products.py's VNNI
products): the compiled rounding of the queries is numpy's bit for bit, the products (vpdpwssd, or
the same in plain IR on any CPU) are the integer sums of the definition and compile to vpdpwssd
where the CPU has it, and both backends attend with the rounded queries.
(Numba's decodes against the reference over int8 caches: test_kv_cache_dtype.py.)"""

from __future__ import annotations

import re

import numba
import numpy as np
import pytest

from tests.kernels.test_attention import HEAD_DIM, batch_shapes, make_batch, run_step
from vllmlite.kernels import get_kernels, kv_dtype
from vllmlite.kernels.kv_dtype import PackedKV
from vllmlite.kernels.numba import block_products, key_products
from vllmlite.kernels.numba.elementwise import round_queries


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("head_dim", [HEAD_DIM, 64])
def test_compiled_query_rounding_is_the_reference_bit_for_bit(dtype, head_dim):
    """numba's round_queries gives kv_dtype.round_queries' integers and scales and
    rounded_queries' values exactly: ties of rint (q * QUERY_MAX / max |q| exactly k + 1/2) and zero heads
    included."""
    rng = np.random.default_rng(3)
    q = (rng.standard_normal((5, 6, head_dim)) * rng.uniform(0.01, 100, (5, 6, 1))).astype(dtype)
    q[0, 2] = 0                                          # a zero head: scale 0, integers 0
    q[1, 3] = (np.arange(head_dim) % 4 - 1.5) * 0.5      # odd quarters of a scale of 0.5 ...
    q[1, 3, 0] = kv_dtype.QUERY_MAX * 0.5                # ... so q / scale is +-0.5 or +-1.5: ties, to even
    expected_ints, expected_scales = kv_dtype.round_queries(q)
    rounded, (ints, scales) = round_queries(q)
    np.testing.assert_array_equal(ints, expected_ints)
    np.testing.assert_array_equal(scales, expected_scales)
    np.testing.assert_array_equal(rounded, kv_dtype.rounded_queries(q))
    assert rounded.dtype == dtype
    assert set(np.abs(ints[1, 3, 1:]).tolist()) == {0, 2}                                     # 0.5 -> 0, 1.5 -> 2
    assert not ints[0, 2].any() and scales[0, 2] == 0


def _score_products(emulated: bool):
    one, two, three = key_products.vnni_products(emulated)

    @numba.njit
    def scores_of(heads, q_words, q_scales, data, scales, slot, kv, scores):
        """The products of heads 0 .. heads - 1 with the keys from `slot` (one call: KEYS or
        VNNI_SCORE_KEYS of them), KV head kv of a [slots, kv_heads, head_dim] cache."""
        num_kv_heads, head_dim, groups = data.shape[1], data.shape[2], scales.shape[2]
        args = (q_words, 0, q_scales, data, scales, (slot * num_kv_heads + kv) * head_dim, num_kv_heads * head_dim,
                (slot * num_kv_heads + kv) * groups, num_kv_heads * groups, head_dim // key_products.QUAD, scores, 0,
                scores.shape[1])
        if heads == 3:
            three(*args)
        elif heads == 2:
            two(*args)
        else:
            one(*args)
    return scores_of


PRODUCTS = [pytest.param(False, marks=pytest.mark.skipif(not block_products.INTEGER_SCORES,
                                                         reason="the CPU has no AVX-512 VNNI")), True]


@pytest.mark.parametrize("emulated", PRODUCTS)
@pytest.mark.parametrize("heads", [1, 2, 3])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_integer_score_products_are_the_definitions_sums(emulated, heads, head_dim):
    """Each score is q_scale * sum over the groups of the key's scale times the integer sum of q's and
    the key's integers, with extreme bytes (-127, 127, and -128, which the cache never holds) times
    extreme 16-bit integers, the query laid out as block_products.integer_queries lays it."""
    rng = np.random.default_rng(heads * head_dim + emulated)
    keys = key_products.KEYS if heads == 1 else key_products.VNNI_SCORE_KEYS
    num_slots, num_kv_heads, groups = keys + 5, 2, head_dim // kv_dtype.INT8_GROUP
    data = rng.integers(-127, 128, (num_slots, num_kv_heads, head_dim), dtype=np.int8)
    data[3, 1, :4] = [-128, 127, -127, 0]
    scales = rng.uniform(0.001, 2, (num_slots, num_kv_heads, groups)).astype(np.float32)
    q_ints = rng.integers(-kv_dtype.QUERY_MAX, kv_dtype.QUERY_MAX + 1, (heads, head_dim), dtype=np.int16)
    q_ints[0, :8] = [kv_dtype.QUERY_MAX, -kv_dtype.QUERY_MAX] * 4      # against the key bytes above
    q_scales = rng.uniform(1e-5, 1e-3, heads).astype(np.float32)
    quads = q_ints.reshape(heads, -1, key_products.QUAD)                # each quad: its even elements, then odd
    words = np.concatenate([quads[..., 0::2], quads[..., 1::2]], axis=-1).reshape(-1).view(np.int32)
    scores = np.full((heads, keys + 3), np.nan, np.float32)
    _score_products(emulated)(heads, words, q_scales, data, scales, 2, 1, scores)
    keys_ints = data[2:2 + keys, 1].astype(np.int64).reshape(keys, groups, -1)               # [keys, groups, 16]
    group_sums = np.einsum("kgd,hgd->hkg", keys_ints, q_ints.astype(np.int64).reshape(heads, groups, -1))
    terms = q_scales[:, None, None] * group_sums * scales[2:2 + keys, 1][None]                # float64
    bound = 1e-6 * np.abs(terms).sum(axis=-1).max()      # float32 sums of terms of either sign
    np.testing.assert_allclose(scores[:, :keys], terms.sum(axis=-1), rtol=0, atol=bound)
    assert np.isnan(scores[:, keys:]).all()                                                   # nothing past its keys


@pytest.mark.skipif(not block_products.INTEGER_SCORES, reason="the CPU has no AVX-512 VNNI")
def test_the_integer_products_compile_to_vpdpwssd():
    """Two vpdpwssd a head, key and 64 bytes of head_dim (3 heads x VNNI_SCORE_KEYS keys x one quad
    in the 3-head call), and no key bytes widened to int32 for float products."""
    scores_of = _score_products(False)
    keys, head_dim = key_products.VNNI_SCORE_KEYS, 64
    scores_of(3, np.zeros(96, np.int32), np.ones(3, np.float32),
              np.zeros((keys, 1, head_dim), np.int8), np.ones((keys, 1, 4), np.float32), 0, 0,
              np.zeros((3, keys), np.float32))
    asm = "\n".join(scores_of.inspect_asm(signature) for signature in scores_of.signatures)
    found = len(re.findall(r"^\s*vpdpwssd\s", asm, re.M))
    calls = 2 * (key_products.KEYS + 2 * keys + 3 * keys)   # the function holds the 1-, 2- and 3-head calls
    assert found == calls, (found, calls)
    assert not re.search(r"^\s*vpmovsxbd\s", asm, re.M)   # no sign extension of key bytes to int32


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_attention_over_int8_keys_uses_the_rounded_queries(backend):
    """Over an int8 cache, attention with q is attention with kv_dtype.rounded_queries(q R) R^T, R the
    rotation the cache is stored under: passing the rounded queries instead gives the same output
    (rounding them again changes nothing but float rounding). A backend whose short queries and
    prefill tiles attended with q unrounded differed here by 4.7e-5."""
    rng = np.random.default_rng(8)
    bs, num_heads, num_kv_heads = 4, 6, 2
    seqs, num_blocks = make_batch(batch_shapes(bs), num_heads, num_kv_heads, bs, np.float32, rng)
    kernels = get_kernels(backend)
    shape = (num_blocks * bs, num_kv_heads, HEAD_DIM)
    first = run_step(kernels, seqs, *(PackedKV("int8", shape) for _ in "kv"), bs)
    for s in seqs:   # q already rounded (in the turned frame, turned as the kernels turn): on the integers' grid
        s.q = kv_dtype.turn(kv_dtype.rounded_queries(kv_dtype.turn(s.q)))   # R is its own inverse
    second = run_step(kernels, seqs, *(PackedKV("int8", shape) for _ in "kv"), bs)
    np.testing.assert_allclose(second, first, rtol=0, atol=5e-6)
