"""Integer dot products on quantized weights: the numpy definition (kernels/int_dot.py) and the numba
kernels that meet it (kernels/numba/int_linear.py), reached through `linear(..., int_dot=True)`."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from vllmlite.kernels.int_dot import int_dot_linear, quantize_activations, weight_integers
from vllmlite.kernels.numba import int_linear, linear
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
    if num_tokens < linear_module.INT_DOT_MIN_ROWS:   # the rounded floats: each block's sum in float32 too
        tolerance = 2 * (BLOCK + cols // BLOCK + 3) * EPS * elementwise_magnitude(x, weight)
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


@pytest.mark.parametrize("num_tokens, integer_kernel", [(1, False), (linear_module.INT_DOT_MIN_ROWS - 1, False),
                                                        (linear_module.INT_DOT_MIN_ROWS, True), (48, True)])
def test_int_dot_runs_the_integer_kernel_from_int_dot_min_rows_tokens(monkeypatch, num_tokens, integer_kernel):
    """Below INT_DOT_MIN_ROWS tokens the rounded activations go through the float kernels (faster
    there: results/int_dot.json); from it on, the integer kernel."""
    calls = []
    monkeypatch.setattr(linear_module, "int_dot_linear", lambda *args: calls.append(args))
    rng = np.random.default_rng(3)
    weight = make_weight("int4", 40, 64, rng)
    linear(rng.standard_normal((num_tokens, 64), dtype=np.float32), weight,
           np.empty((num_tokens, 40), np.float32), int_dot=True)
    assert len(calls) == integer_kernel


def test_rounded_activations_are_the_8_bit_integers_times_their_scales():
    x = np.random.default_rng(4).standard_normal((3, 96), dtype=np.float32)
    q, d = quantize_activations(x)
    want = q.reshape(3, 3, BLOCK) * d[..., None]                                # [tokens, blocks, 32]
    np.testing.assert_array_equal(int_linear.rounded_activations(x), want.reshape(3, 96))
