"""How the numba backend compiles: the decorators every kernel uses, cached on disk and releasing the GIL.

Knows nothing of any operation.
"""

from numba import njit

# Floating-point reassociation lets LLVM vectorize the dot products and sums; no "ninf"/"nnan",
# because the online softmax starts from -inf on purpose.
FASTMATH = {"reassoc", "contract", "arcp", "nsz"}

serial = njit(cache=True, nogil=True, fastmath=FASTMATH)
parallel = njit(cache=True, nogil=True, fastmath=FASTMATH, parallel=True)
# No fast-math at all: for kernels whose results must be numpy's bit for bit (divisions, rounding).
exact = njit(cache=True, nogil=True)
