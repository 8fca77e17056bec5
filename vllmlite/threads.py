"""The thread pools' environment, set when vllmlite is imported (before numpy, to take effect).

Two thread pools share the cores: OpenBLAS's (batched linear layers) and numba's (the compiled
kernels). By default each pool's idle workers spin after a call (OpenBLAS for ~2^28 cycles),
stealing the core the other pool needs next: a decode step ran 2.4x slower for it on 2 cores. With these, idle
workers sleep at once. The libraries read them when they load, so they only take effect if
vllmlite is imported before numpy; a value the user set is kept.
"""

import os
import sys

THREAD_ENV = {"OPENBLAS_THREAD_TIMEOUT": "4", "OMP_WAIT_POLICY": "PASSIVE"}

# False when numpy (so OpenBLAS) loaded first and the user had not set these: the engine warns.
THREAD_ENV_APPLIED = "numpy" not in sys.modules or all(name in os.environ for name in THREAD_ENV)

for _name, _value in THREAD_ENV.items():
    os.environ.setdefault(_name, _value)
