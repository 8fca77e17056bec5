"""How the numba backend compiles: the decorators every kernel uses, cached on disk and releasing the GIL.

Knows nothing of any operation. Numba's disk cache keys a kernel on its own file only: after
editing the options here, delete the cached kernels (vllmlite/kernels/numba/__pycache__/*.nb*, and
.numba_cache/ for the tests' workers), or they keep the code compiled with the old ones.
"""

import llvmlite.binding as llvm
import numba
from numba import njit

# Floating-point reassociation lets LLVM vectorize the dot products and sums; no "ninf"/"nnan",
# because the online softmax starts from -inf on purpose.
FASTMATH = {"reassoc", "contract", "arcp", "nsz"}
# Division as numpy divides (x / 0 is inf or nan, no exception): numba's default ("python") tests
# every divisor for zero to raise ZeroDivisionError, and that branch keeps LLVM from vectorizing
# any loop that divides (SiLU's g / (1 + e) ran scalar, 6x slower).
ERRORS = "numpy"

serial = njit(cache=True, nogil=True, fastmath=FASTMATH, error_model=ERRORS)
parallel = njit(cache=True, nogil=True, fastmath=FASTMATH, parallel=True, error_model=ERRORS)
# No fast-math at all: for kernels whose results must be numpy's bit for bit (divisions, rounding).
exact = njit(cache=True, nogil=True, error_model=ERRORS)
exact_parallel = njit(cache=True, nogil=True, parallel=True, error_model=ERRORS)


def cpu_features() -> frozenset[str]:
    """The CPU features numba compiles for (e.g. "avx2", "avx512vnni"): its NUMBA_CPU_FEATURES if
    set, none for another NUMBA_CPU_NAME without them, else the host's. For kernels that pick their
    instructions or vector widths by what the compiled code may use."""
    if numba.config.CPU_FEATURES:
        return frozenset(f[1:] for f in numba.config.CPU_FEATURES.split(",") if f.startswith("+"))
    if numba.config.CPU_NAME not in (None, "host"):
        return frozenset()
    return frozenset(name for name, on in llvm.get_host_cpu_features().items() if on)
