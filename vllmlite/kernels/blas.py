"""numpy's own OpenBLAS `sgemm`, callable from compiled kernels, and a switch for its threads.

The quantized product for many tokens (`numba/linear._quantized_gemm`) runs as one parallel
region in which every worker dequantizes its own tiles and multiplies them by the activations
with a one-thread sgemm, instead of handing each batch of tiles from numba's threads to
OpenBLAS's and back. This module finds the sgemm that numpy's wheels ship (scipy-openblas, with
64-bit integers) and registers its address with LLVM under a fixed name, so the kernels calling it
are compiled once and cached on disk like the others. With any other BLAS, AVAILABLE is False and
the kernels dequantize a few tiles at a time for np.matmul instead.
"""

from __future__ import annotations

import ctypes
import glob
import os
from collections.abc import Iterator
from contextlib import contextmanager

import llvmlite.binding as llvm
import numpy as np
from numba import types

SYMBOL = "vllmlite_cblas_sgemm"   # the name compiled code calls it by
ROW_MAJOR, COL_MAJOR, NO_TRANS, TRANS = 101, 102, 111, 112   # CBLAS enum values

# cblas_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc); the
# pointers are passed as integers (arr.ctypes.data), the same register as a pointer.
sgemm = types.ExternalFunction(SYMBOL, types.void(
    types.int32, types.int32, types.int32, types.int64, types.int64, types.int64, types.float32,
    types.intp, types.int64, types.intp, types.int64, types.float32, types.intp, types.int64))


_SYMBOLS = ("scipy_cblas_sgemm64_", "scipy_openblas_set_num_threads64_", "scipy_openblas_get_num_threads64_")


def _numpy_openblas() -> ctypes.CDLL | None:
    """The OpenBLAS numpy loaded (the same library, so the same thread settings), if it is
    scipy-openblas64 with the symbols used here."""
    package = os.path.dirname(np.__file__)
    for path in glob.glob(os.path.join(package, "..", "numpy.libs", "*openblas*")) + \
            glob.glob(os.path.join(package, ".dylibs", "*openblas*")):
        try:
            lib = ctypes.CDLL(path)
            for name in _SYMBOLS:
                getattr(lib, name)
        except (OSError, AttributeError):
            continue
        return lib
    return None


_lib = _numpy_openblas()
AVAILABLE = _lib is not None
if _lib is not None:
    llvm.add_symbol(SYMBOL, ctypes.cast(_lib.scipy_cblas_sgemm64_, ctypes.c_void_p).value)
    _set_threads = _lib.scipy_openblas_set_num_threads64_
    _set_threads.argtypes, _set_threads.restype = (ctypes.c_int,), None
    _get_threads = _lib.scipy_openblas_get_num_threads64_
    _get_threads.argtypes, _get_threads.restype = (), ctypes.c_int


@contextmanager
def one_thread() -> Iterator[None]:
    """OpenBLAS on one thread meanwhile: each caller's sgemm runs on its own thread. (OpenBLAS's
    thread count is global, not per thread; only the engine's thread runs kernels.) Nothing
    changes with another BLAS, whose threads this module cannot set."""
    if not AVAILABLE:
        yield
        return
    before = _get_threads()
    _set_threads(1)
    try:
        yield
    finally:
        _set_threads(before)
