"""The numba backend's vectorizable exp (kernels/numba/fast_exp.py) against numpy's: float32 within
2 ulp of the true value over the softmax's whole range, 0 below it and for -inf; float64 unchanged."""

from __future__ import annotations

import math

import numpy as np
import pytest
from numba import njit

from vllmlite.kernels.numba.fast_exp import exp_shifted


@njit
def shifted_exp(x, top):
    out = x.copy()
    exp_shifted(out, top, out.shape[0], np.empty(out.shape[0], np.int32))
    return out


@pytest.mark.parametrize("top", [0.0, 3.5, -20.0])
def test_float32_exp_is_within_two_ulp_of_the_true_exp(top):
    x = np.concatenate([np.linspace(top - 87, top, 20001), top - np.geomspace(1e-8, 1, 101)]).astype(np.float32)
    got = shifted_exp(x, np.float32(top))
    true = np.exp((x - np.float32(top)).astype(np.float64))   # of the float32 difference, as the kernel takes it
    assert got.dtype == np.float32
    assert (np.abs(got - true) <= 2 * np.spacing(true.astype(np.float32))).all()
    assert (got[x == np.float32(top)] == 1).all()


def test_float32_exp_is_zero_below_the_normal_range_and_for_minus_inf():
    x = np.array([-87.5, -100, -1e30, -np.inf, -86.9, 0], np.float32)
    np.testing.assert_array_equal(shifted_exp(x, np.float32(0))[:4], 0)
    assert shifted_exp(x, np.float32(0))[4] > 0 and shifted_exp(x, np.float32(0))[5] == 1


def test_float64_rows_take_the_exact_exp():
    x = np.random.default_rng(0).uniform(-50, 0, 1000)
    np.testing.assert_array_equal(shifted_exp(x, 0.0), [math.exp(v) for v in x])   # libm's, as before
