"""vllmlite: a readable LLM inference server in Python and numpy."""

import os

# Two thread pools share the cores: OpenBLAS's (the linear layers) and numba's (attention). By
# default each pool's idle workers spin after a call (OpenBLAS for ~2^28 cycles), stealing the
# core the other pool needs next: a decode step ran 2.4x slower for it on 2 cores. Idle workers
# sleep at once with these. Read when the libraries load, so they only take effect if vllmlite is
# imported before numpy; a value the user set is kept.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


from vllmlite.engine import LLMEngine
from vllmlite.llm import LLM
from vllmlite.outputs import CompletionOutput, RequestOutput
from vllmlite.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]
