"""Integer dot products on quantized weights: the numpy definition (kernels/int_dot.py) and the numba
kernels that meet it (kernels/numba/int_linear.py), reached through `linear(..., int_dot=True)`."""

from __future__ import annotations

import collections
import functools
import importlib
import re

import numba
import numpy as np
import pytest

from vllmlite.kernels.int_dot import int_dot_linear, quantize_activations, weight_integers
from vllmlite.kernels.numba import byte_dots, int_linear, linear
from vllmlite.kernels.quant import BLOCK, TILE, BlockRows, QuantizedMatrix, dequantize, quantize, tile, untile

EPS = np.finfo(np.float32).eps
FORMATS = ("int8 symmetric", "int8 affine", "int4")
linear_module = importlib.import_module("vllmlite.kernels.numba.linear")   # the package exports its function


def make_weight(fmt: str, rows: int, cols: int, rng: np.random.Generator) -> QuantizedMatrix:
    if fmt == "int8 symmetric":   # as a Q8_0 GGUF stores it: no mins
        blocks = rng.standard_normal((rows, cols // BLOCK, BLOCK), dtype=np.float32)
        scales = np.abs(blocks).max(axis=-1) / np.float32(127)
        q = np.clip(np.rint(blocks / scales[..., None]), -127, 127).astype(np.int8)
        return tile(BlockRows("int8", q, scales, None))
    if fmt == "int8 affine":      # weights all of one sign: the affine grid fits every block better
        m = quantize(rng.random((rows, cols), dtype=np.float32) + 0.5, "int8")
        assert (untile(m).mins != 0).all()
        return m
    return quantize(rng.standard_normal((rows, cols), dtype=np.float32), "int4")


def exact_and_magnitude(x: np.ndarray, weight: QuantizedMatrix) -> tuple[np.ndarray, np.ndarray]:
    """The contract in float64 from exact integer sums, and sum over blocks of |each term|: both
    float32 forms are within (blocks + 3) * eps * magnitude of it (a product of three float32
    factors rounds twice, plus one rounding per addition, in any order)."""
    q_x, d_x = quantize_activations(x)
    q_x = q_x.reshape(x.shape[0], -1, BLOCK).astype(np.int64)                 # [tokens, blocks, 32]
    rows = untile(weight)
    dots = np.einsum("rbj,tbj->trb", weight_integers(weight).astype(np.int64), q_x)   # [tokens, rows, blocks]
    terms = rows.scales[None].astype(np.float64) * d_x[:, None, :] * dots
    if rows.mins is not None:
        terms = terms + rows.mins[None] * (d_x * q_x.sum(axis=-1))[:, None, :]
    return terms.sum(axis=-1), np.abs(terms).sum(axis=-1)


def elementwise_magnitude(x: np.ndarray, weight: QuantizedMatrix) -> np.ndarray:
    """sum over every element of |d_w * q_w * x_rounded| + |m_w * x_rounded|: [tokens, rows]."""
    q_x, d_x = quantize_activations(x)
    x_rounded = q_x.reshape(x.shape[0], -1, BLOCK) * d_x[..., None].astype(np.float64)   # [tokens, blocks, 32]
    rows = untile(weight)
    w = np.abs(weight_integers(weight) * rows.scales[..., None].astype(np.float64))      # [rows, blocks, 32]
    if rows.mins is not None:
        w += np.abs(rows.mins[..., None])
    return np.einsum("rbj,tbj->tr", w, np.abs(x_rounded))


def run_numba(x: np.ndarray, weight: QuantizedMatrix) -> np.ndarray:
    out = np.full((x.shape[0], weight.num_rows), np.nan, np.float32)
    linear(x, weight, out, int_dot=True)
    return out


def test_quantized_activations_round_each_block_to_127_levels_of_its_largest_value():
    x = np.zeros((2, 64), np.float32)
    x[0, :32] = np.linspace(-2, 1, 32)
    x[1, 32:] = 0.25                                    # block 0 of token 1 stays zero: scale 0, q 0
    q, d = quantize_activations(x)
    assert d.tolist() == [[np.float32(2) / 127, 0], [0, np.float32(0.25) / 127]]
    assert q[0, 0] == -127 and q[0, 31] == 64 and (q[0, 32:] == 0).all() and (q[1, 32:] == 127).all()
    assert np.abs(q[0, :32] * d[0, 0] - x[0, :32]).max() <= d[0, 0] / 2


@pytest.mark.parametrize("num_tokens", [1, 5, 40])
def test_compiled_activation_rounding_is_numpys_exactly(num_tokens):
    rng = np.random.default_rng(num_tokens)
    x = rng.standard_normal((num_tokens, 128), dtype=np.float32) * np.float32(3)
    x[0, :32] = 0                                       # an all-zero block
    x[-1, 32:64] = np.arange(32, dtype=np.float32) - 15.5   # halves: ties round to even
    want_q, want_d = quantize_activations(x)
    q = np.empty((num_tokens, 4, BLOCK), np.int8)
    d = np.empty((num_tokens, 4), np.float32)
    sums = np.empty((num_tokens, 4), np.int32)
    int_linear._quantize_activations(x, q, d, sums)
    np.testing.assert_array_equal(q.reshape(num_tokens, -1), want_q)
    np.testing.assert_array_equal(d, want_d)
    np.testing.assert_array_equal(sums, want_q.reshape(num_tokens, 4, BLOCK).sum(axis=-1, dtype=np.int32))


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_definition_is_the_float_product_up_to_rounding_the_activations(fmt):
    """|int_dot - x . w| <= sum over blocks of |w_block| * d_x / 2: x moved by at most half a step."""
    rng = np.random.default_rng(0)
    weight, x = make_weight(fmt, 70, 96, rng), rng.standard_normal((3, 96), dtype=np.float32)
    w = dequantize(weight).astype(np.float64)
    _, d_x = quantize_activations(x)
    bound = np.einsum("rbj,tb->tr", np.abs(w).reshape(70, 3, BLOCK), d_x / 2) * (1 + 1e-5)
    exact, magnitude = exact_and_magnitude(x, weight)
    got = int_dot_linear(x, weight)
    assert (np.abs(got - exact) <= 6 * EPS * magnitude).all()
    assert (np.abs(exact - x.astype(np.float64) @ w.T) <= bound).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_no_tokens_give_no_rows(fmt):
    """A step whose chunk ends mid-prompt wants no logits: the LM head's product over 0 tokens (the
    numpy engine with int_dot once failed there, reshaping an empty array by -1)."""
    weight = make_weight(fmt, TILE + 1, 64, np.random.default_rng(0))
    x = np.zeros((0, 64), np.float32)
    assert int_dot_linear(x, weight).shape == (0, TILE + 1)
    got = run_numba(x, weight)
    assert got.shape == (0, TILE + 1)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("num_rows", [1, TILE + 1, 3 * TILE - 5])
@pytest.mark.parametrize("num_tokens", [1, 3, 16, 33])
def test_compiled_int_dot_matches_the_definition(fmt, num_rows, num_tokens):
    rng = np.random.default_rng(num_rows * 100 + num_tokens)
    cols = 160
    weight = make_weight(fmt, num_rows, cols, rng)
    x = rng.standard_normal((cols, num_tokens), dtype=np.float32).T     # feature-major, as the model passes it
    got = run_numba(x, weight)
    exact, magnitude = exact_and_magnitude(x, weight)
    tolerance = (cols // BLOCK + 3) * EPS * magnitude
    assert (np.abs(int_dot_linear(x, weight) - exact) <= tolerance).all()
    rounded = np.empty_like(got)     # the rounded floats through today's kernels: each block's sum in float32 too
    linear(int_linear.rounded_activations(x), weight, rounded)
    rounded_tolerance = 2 * (BLOCK + cols // BLOCK + 3) * EPS * elementwise_magnitude(x, weight)
    assert (np.abs(rounded - exact) <= rounded_tolerance).all()
    if num_tokens < linear_module.INT_DOT_MIN_ROWS:
        tolerance = rounded_tolerance
    assert (np.abs(got - exact) <= tolerance).all()


@pytest.mark.parametrize("fmt", ["int8 symmetric", "int4"])
@pytest.mark.parametrize("num_tokens", [1, 17])   # the rounded floats' path and the integer kernel
def test_integer_weights_and_activations_give_exact_integer_sums(fmt, num_tokens):
    """Scales of 1 and activations whose blocks reach +-127: every term is an integer below 2^24,
    so any summation order gives x @ w.T exactly."""
    rng = np.random.default_rng(1)
    rows, cols = 75, 128
    if fmt == "int4":
        q = rng.integers(0, 16, (rows, cols // BLOCK, BLOCK), dtype=np.uint8)
        ones = np.ones((rows, cols // BLOCK), np.float32)
        weight = tile(BlockRows("int4", q[..., :16] | (q[..., 16:] << 4), ones, -8 * ones))
    else:
        q = rng.integers(-127, 128, (rows, cols // BLOCK, BLOCK), dtype=np.int8)
        weight = tile(BlockRows("int8", q, np.ones((rows, cols // BLOCK), np.float32), None))
    x = rng.integers(-126, 127, (num_tokens, cols)).astype(np.float32)
    x[:, ::BLOCK] = 127                                 # each block's largest: d_x = 1, q_x = x
    want = x.astype(np.float64) @ dequantize(weight).astype(np.float64).T
    np.testing.assert_array_equal(run_numba(x, weight), want)
    np.testing.assert_array_equal(int_dot_linear(x, weight), want)


def test_int_dot_leaves_float_weights_and_the_default_path_alone():
    rng = np.random.default_rng(2)
    w, x = rng.standard_normal((70, 64), dtype=np.float32), rng.standard_normal((5, 64), dtype=np.float32)
    default, switched = np.empty((5, 70), np.float32), np.empty((5, 70), np.float32)
    linear(x, w, default)
    linear(x, w, switched, int_dot=True)
    np.testing.assert_array_equal(switched, default)
    weight = quantize(w, "int4")
    linear(x, weight, default)
    linear(x, weight, switched, int_dot=False)
    np.testing.assert_array_equal(switched, default)
    assert not np.array_equal(run_numba(x, weight), default)   # the switch does change the quantized path


def test_the_integer_kernel_runs_from_one_token_with_byte_products_and_from_nine_without():
    assert linear_module.INT_DOT_MIN_ROWS == (1 if int_linear.BYTES else 9)


@pytest.mark.parametrize("num_tokens, integer_kernel", [(1, False), (8, False), (9, True), (48, True)])
def test_int_dot_runs_the_integer_kernel_from_int_dot_min_rows_tokens(monkeypatch, num_tokens, integer_kernel):
    """Below INT_DOT_MIN_ROWS tokens (9 here, as without byte products) the rounded activations go through
    the float kernels; from it on, the integer kernel."""
    calls = []
    monkeypatch.setattr(linear_module, "INT_DOT_MIN_ROWS", 9)
    monkeypatch.setattr(linear_module, "int_dot_linear", lambda *args: calls.append(args))
    rng = np.random.default_rng(3)
    weight, x = make_weight("int4", 40, 64, rng), rng.standard_normal((num_tokens, 64), dtype=np.float32)
    out, rounded = np.full((num_tokens, 40), np.nan, np.float32), np.empty((num_tokens, 40), np.float32)
    linear(x, weight, out, int_dot=True)
    assert len(calls) == integer_kernel
    if not integer_kernel:
        linear(int_linear.rounded_activations(x), weight, rounded)
        np.testing.assert_array_equal(out, rounded)


def test_rounded_activations_are_the_8_bit_integers_times_their_scales():
    x = np.random.default_rng(4).standard_normal((3, 96), dtype=np.float32)
    q, d = quantize_activations(x)
    want = q.reshape(3, 3, BLOCK) * d[..., None]                                # [tokens, blocks, 32]
    np.testing.assert_array_equal(int_linear.rounded_activations(x), want.reshape(3, 96))


needs_bytes = pytest.mark.skipif(byte_dots.ISA is None, reason="the CPU has neither AVX-512 VNNI nor AVX2")


# The byte products this machine runs, and VNNI's written out in plain IR (any CPU runs those).
ISAS = [isa for isa in (byte_dots.ISA, "emulated-vnni") if isa]


@functools.cache
def _all_blocks_folded(isa, is_int4):
    """A compiled run(grouped, words, scales, mins, d_x, s_x, several_at_a_time) -> acc float32
    [tiles, tokens * TILE]: every block of each tile folded in by `isa`'s products, one token per
    call, or (several_at_a_time) the first TOKENS[isa] tokens in one call and the rest one by one."""
    group = byte_dots.TOKENS[isa]
    one, several = byte_dots.block_fold(is_int4, 1, isa), byte_dots.block_fold(is_int4, group, isa)

    @numba.njit
    def run(grouped, words, scales, mins, d_x, s_x, several_at_a_time):
        tiles, blocks, groups = grouped.shape[:3]
        num_tokens, stride = words.shape[0] // (blocks * 8), blocks * 8
        block_bytes = groups * TILE * 4
        acc = np.zeros((tiles, num_tokens * TILE), np.float32)
        for t in range(tiles):
            w, out = grouped[t].reshape(blocks * block_bytes), acc[t]
            for b in range(blocks):
                rows, first = (t * blocks + b) * TILE, 0
                if several_at_a_time:
                    several(w, b * block_bytes, words, b * 8, stride, scales, mins, rows, d_x, s_x, b, blocks, out, 0)
                    first = group
                for r in range(first, num_tokens):
                    one(w, b * block_bytes, words, r * stride + b * 8, 0, scales, mins, rows, d_x, s_x, r * blocks + b,
                        0, out, r * TILE)
        return acc
    return run


def _integer_blocks(fmt, rng, rows, blocks, num_tokens):
    """(q_w [rows, blocks, 32], its weight with unit scales and mins, q_x [tokens, blocks, 32]):
    every byte value, extremes included: q_w in [-128, 127] (int8; stored + 128) or [0, 15] (int4),
    q_x in [-127, 127]."""
    ones = np.ones((rows, blocks), np.float32)
    if fmt == "int4":
        q = rng.integers(0, 16, (rows, blocks, BLOCK), dtype=np.uint8)
        q[0, 0] = 15
        weight = tile(BlockRows("int4", q[..., :16] | (q[..., 16:] << 4), ones, ones))
    else:
        q = rng.integers(-128, 128, (rows, blocks, BLOCK), dtype=np.int8)
        q[0, 0] = -128
        weight = tile(BlockRows("int8", q, ones, None))
    q_x = rng.integers(-127, 128, (num_tokens, blocks, BLOCK), dtype=np.int8)
    q_x[0, 0] = -127                                       # with q = -128: the largest product
    return q, weight, q_x


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("several_at_a_time", [False, True])
def test_byte_block_products_are_the_exact_integer_sums(isa, fmt, several_at_a_time):
    """With unit scales and no mins, the folded accumulators are the integer sums over the blocks,
    exact in float32 (< 2^24): nothing lost to int16 lanes, VNNI's + 128 taken off."""
    rng = np.random.default_rng(6)
    rows, blocks, num_tokens = 2 * TILE, 3, 5
    q, weight, q_x = _integer_blocks(fmt, rng, rows, blocks, num_tokens)
    ones = np.ones((num_tokens, blocks), np.float32)
    acc = _all_blocks_folded(isa, fmt == "int4")(weight.grouped_qs, q_x.reshape(-1).view(np.int32), weight.scales,
                                                 None, ones, q_x.sum(axis=-1, dtype=np.int32), several_at_a_time)
    want = np.einsum("rbj,tbj->tr", q.astype(np.int64), q_x.astype(np.int64))   # [tokens, rows]
    got = acc.reshape(2, num_tokens, TILE).transpose(1, 0, 2).reshape(num_tokens, rows)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("several_at_a_time", [False, True])
def test_byte_block_products_fold_the_scales_as_the_float32_expression(isa, fmt, several_at_a_time):
    """acc += scale * (d_x * dot) + min * (d_x * sum(q_x)), block after block, each product and sum
    rounded to float32 in that order (no fused multiply-add): numpy's float32 arithmetic, bit for bit."""
    rng = np.random.default_rng(7)
    num_tokens = 6
    weight = make_weight(fmt, TILE, 4 * BLOCK, rng)
    q_x = rng.integers(-127, 128, (num_tokens, 4, BLOCK), dtype=np.int8)
    d_x = rng.uniform(0.001, 0.1, (num_tokens, 4)).astype(np.float32)
    s_x = q_x.sum(axis=-1, dtype=np.int32)
    acc = _all_blocks_folded(isa, fmt == "int4")(weight.grouped_qs, q_x.reshape(-1).view(np.int32), weight.scales,
                                                 weight.mins, d_x, s_x, several_at_a_time)
    q_w = weight_integers(weight).astype(np.int64)                         # [rows, blocks, 32]
    dots = np.einsum("rbj,tbj->trb", q_w, q_x.astype(np.int64)).astype(np.float32)
    want = np.zeros((num_tokens, TILE), np.float32)
    for b in range(4):
        term = weight.scales[0, b] * (d_x[:, b, None] * dots[:, :, b])
        if weight.mins is not None:
            term = term + weight.mins[0, b] * (d_x[:, b, None] * s_x[:, b, None].astype(np.float32))
        want = want + term
    np.testing.assert_array_equal(acc.reshape(num_tokens, TILE), want)


@needs_bytes
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("num_tokens", [1, 5, 6, 9, 48])   # calls of 2 or 4 tokens, and the rest one by one
def test_byte_kernel_and_int16_kernel_agree(fmt, num_tokens):
    """The same exact integer sums, the same float32 expressions for the scales (LLVM may fuse
    them differently: a few ulps)."""
    rng = np.random.default_rng(num_tokens)
    weight = make_weight(fmt, 2 * TILE + 7, 192, rng)
    x = rng.standard_normal((192, num_tokens), dtype=np.float32).T
    with_bytes, portable = (np.full((num_tokens, weight.num_rows), np.nan, np.float32) for _ in range(2))
    int_linear.int_dot_linear(x, weight, with_bytes)
    int_linear.int_dot_linear(x, weight, portable, portable=True)
    _, magnitude = exact_and_magnitude(x, weight)
    assert (np.abs(with_bytes - portable) <= 2 * (192 // BLOCK + 3) * EPS * magnitude).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_grouped_bytes_put_four_elements_of_one_row_in_each_32_bit_lane(fmt):
    weight = make_weight(fmt, TILE, 64, np.random.default_rng(5))
    grouped = weight.grouped_qs                                    # [tiles, blocks, groups, TILE, 4]
    q = untile(weight).qs                                          # [rows, blocks, 32 or 16 bytes]
    row, block, element = 5, 1, 6                                  # group 1, byte 2
    byte = q[row, block, element].view(np.uint8)
    assert grouped[0, block, element // 4, row, element % 4] == (byte if fmt == "int4" else byte ^ 128)


@needs_bytes
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_the_block_product_compiles_to_the_byte_instructions(fmt):
    """A block of 64 rows (32 bytes of a row: int8; 16: int4) times each token: VNNI, 64 byte
    products a vpdpbusd; AVX2, 32 a vpmaddubsw, whose int16 pairs vpmaddwd widens (int8: every
    group; int4: once a block), and no int16 multiplies (vpmullw: the portable kernel's)."""
    product = byte_dots.int4_block_fold_n if fmt == "int4" else byte_dots.int8_block_fold_n

    @numba.njit
    def block(w, x, scales, d_x, s_x, acc):
        product(w, 0, x, 0, 8, scales, None, 0, d_x, s_x, 0, 1, acc, 0)
    tokens = byte_dots.TOKENS_PER_CALL
    block(np.zeros(64 * BLOCK, np.uint8), np.zeros(8 * tokens, np.int32), np.ones(TILE, np.float32),
          np.ones(tokens, np.float32), np.zeros(tokens, np.int32), np.zeros(tokens * TILE, np.float32))
    found = collections.Counter(re.findall(r"^\s*(vpdpbusd|vpmullw|vpmaddubsw|vpmaddwd)\s",
                                           block.inspect_asm(block.signatures[0]), re.M))
    products = TILE * BLOCK * tokens               # byte products of the call
    if byte_dots.ISA == "vnni":
        assert found == {"vpdpbusd": products // 64}
    else:
        registers = TILE // 8 * tokens                 # 8 rows in a 256-bit register
        assert found == {"vpmaddubsw": products // 32, "vpmaddwd": registers * (BLOCK // 4 if fmt == "int8" else 1)}


@pytest.mark.parametrize("portable", [pytest.param(False, marks=needs_bytes), True])
@pytest.mark.parametrize("num_tokens", [1, 5, 40])
def test_the_kernels_round_activations_exactly_as_the_definition(portable, num_tokens):
    """Through an identity weight (int8, scale 1), out[r, i] = d_x * q_x[r, i]: any rounding that
    is not numpy's (a division turned into a reciprocal's product, another tie rule) shows."""
    rng = np.random.default_rng(num_tokens)
    cols = 128
    identity = tile(BlockRows("int8", np.eye(cols, dtype=np.int8).reshape(cols, cols // BLOCK, BLOCK),
                              np.ones((cols, cols // BLOCK), np.float32), None))
    x = rng.standard_normal((cols, num_tokens), dtype=np.float32).T * np.float32(3)
    x[:, 32:64] = np.arange(32, dtype=np.float32) - 15.5     # halves of the step: ties round to even
    q, d = quantize_activations(x)
    out = np.empty((num_tokens, cols), np.float32)
    int_linear.int_dot_linear(x, identity, out, portable=portable)
    np.testing.assert_array_equal(out, q * np.repeat(d, BLOCK, axis=1))
