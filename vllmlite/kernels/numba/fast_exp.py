"""exp over a row of floats in loops LLVM vectorizes (numba's math.exp is a scalar libm call per
value): for the softmax of the attention kernels and SiLU's sigmoid. Knows nothing of what the values are.

float32: Cephes' expf (2^n times a degree-7 polynomial of the remainder, within 1-2 ulp of the
true exp); 2^n is built from its bits in an int32 scratch row and applied in a second pass.
Arguments below -87 (where float32's exp leaves the normal range) give 0, as do -inf. float64
rows take math.exp, so float64 results stay as exact as before.

Numba's disk cache keys a kernel on its own file only: after editing this one, delete the cached
kernels that call it (vllmlite/kernels/numba/__pycache__/attention.*.nb* and elementwise.*.nb*).
"""

from __future__ import annotations

import math

import numpy as np
from numba import types
from numba.extending import overload

_LOG2E = np.float32(1.44269504088896341)
_LN2_HI = np.float32(0.693359375)          # ln 2 = _LN2_HI + _LN2_LO, _LN2_HI exact in 9 bits
_LN2_LO = np.float32(-2.12194440e-4)
_LOWEST = np.float32(-87.0)                # below: 0 (exp(-87) is 1.6e-38, float32's smallest normal 1.2e-38)
_C = [np.float32(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
                              1.6666665459e-1, 5.0000001201e-1)]
_C0, _C1, _C2, _C3, _C4, _C5 = _C


def exp_shifted(x, top, num, powers):
    """x[:num] = exp(x[:num] - top), in place; powers is an int32 scratch row of at least num.
    Compiled only (the overload below)."""
    raise NotImplementedError("compiled only")


def _exp_float32(x, top, num, powers):  # pragma: no cover - compiled
    for t in range(num):
        shifted = x[t] - top
        v = max(shifted, _LOWEST)
        n = np.floor(v * _LOG2E + np.float32(0.5))
        r = v - n * _LN2_HI - n * _LN2_LO                       # |r| <= ln(2) / 2
        p = ((((_C0 * r + _C1) * r + _C2) * r + _C3) * r + _C4) * r + _C5
        x[t] = p * r * r + r + np.float32(1)                      # exp(r)
        powers[t] = (np.int32(n) + np.int32(127)) << np.int32(23) if shifted >= _LOWEST else np.int32(0)
    scales = powers.view(np.float32)                              # 2^n, or 0 below _LOWEST
    for t in range(num):
        x[t] *= scales[t]


def _exp_float64(x, top, num, powers):  # pragma: no cover - compiled
    for t in range(num):
        x[t] = math.exp(x[t] - top)


@overload(exp_shifted, jit_options={"fastmath": {"contract", "arcp", "nsz"}})
def _exp_shifted(x, top, num, powers):
    return _exp_float32 if x.dtype == types.float32 else _exp_float64
