"""The hot operations of a forward pass behind one interface, with interchangeable backends.

A backend is a module that defines every function of `Kernels` with the same arguments, each
writing into `out` or in place (no allocation the caller does not see):

    numpy  reference.py      the readable definition and the test oracle
    numba  numba/            compiled, cached on disk, the default
    torch  torch/            torch tensors on the CPU or a CUDA device (an instance: device, dtype)

The model calls `kernels.<op>(...)` on whatever `get_kernels()` returned and never imports a
backend, so a new backend is one more module and one more line in BACKENDS.
The engine's `kernels` knob (EngineArgs, which also reads `VLLMLITE_KERNELS=numpy`) selects the
references; this module reads no environment.

A backend also owns where arrays live: the model allocates its workspace and the runner its KV
cache through `zeros`/`empty`, moves weights and each step's index arrays with `to_device`, and
reads logits back with `to_numpy`. For the numpy backends these are numpy itself.
"""

from __future__ import annotations

import importlib
import logging
from typing import Protocol

import numpy as np

from vllmlite.config import KERNEL_BACKENDS
from vllmlite.kernels.attention_metadata import AttentionMetadata
from vllmlite.kernels.quant import QuantizedMatrix

logger = logging.getLogger(__name__)

BACKENDS = {"numba": "vllmlite.kernels.numba", "numpy": "vllmlite.kernels.reference"}  # on numpy arrays
TORCH_BACKEND = "torch"
DEFAULT_BACKEND = KERNEL_BACKENDS[0]


class Kernels(Protocol):
    """What every backend module provides. Shapes: x/out [tokens, hidden]; q/out [tokens, heads,
    head_dim]; caches [slots, kv_heads, head_dim]; gate_up [tokens, 2 * inter] -> out [tokens, inter];
    linear: x [tokens, in], weight [out, in] (float, or quantized: vllmlite/kernels/quant.py) -> out [tokens, out]."""

    name: str            # "numpy", "numba" or "torch"
    feature_major: bool  # activations as transposed [features, tokens] arrays (else [tokens, features])

    def to_device(self, array: np.ndarray | QuantizedMatrix, dtype=None) -> np.ndarray | QuantizedMatrix: ...

    def zeros(self, shape: tuple[int, ...], dtype) -> np.ndarray: ...

    def empty(self, shape: tuple[int, ...], dtype) -> np.ndarray: ...

    def host_zeros(self, shape: tuple[int, ...], dtype) -> np.ndarray: ...

    def to_numpy(self, x: np.ndarray) -> np.ndarray: ...

    def argmax(self, logits: np.ndarray) -> np.ndarray: ...

    def copy_slots(self, src: np.ndarray, dst: np.ndarray, src_slots: np.ndarray, dst_slots: np.ndarray) -> None: ...

    def linear(self, x: np.ndarray, weight: np.ndarray | QuantizedMatrix, out: np.ndarray) -> None: ...

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray) -> None: ...

    def add_rms_norm(self, x: np.ndarray, residual: np.ndarray, weight: np.ndarray, eps: float,
                     out: np.ndarray) -> None: ...

    def rope(self, x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> None: ...

    def silu_and_mul(self, gate_up: np.ndarray, out: np.ndarray) -> None: ...

    def gelu_tanh_and_mul(self, gate_up: np.ndarray, out: np.ndarray) -> None: ...

    def softcap(self, x: np.ndarray, cap: float) -> None: ...

    def write_kv(self, k_cache: np.ndarray, v_cache: np.ndarray, k: np.ndarray, v: np.ndarray,
                 slot_mapping: np.ndarray) -> None: ...

    def rope_and_write_kv(self, qk: np.ndarray, value: np.ndarray, positions: np.ndarray, cos: np.ndarray,
                          sin: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, slot_mapping: np.ndarray) -> None:
        """rope over qk [tokens, heads + kv_heads, head_dim] (queries, then keys), then write_kv of its
        last kv_heads heads and value [tokens, kv_heads, head_dim]: one kernel where a backend fuses them."""

    def moe(self, x: np.ndarray, expert_ids: np.ndarray, expert_weights: np.ndarray, w_gate_up: np.ndarray,
            w_down: np.ndarray, out: np.ndarray, activation: str = "silu") -> None:
        """Routed experts (reference.moe): x, out [tokens, hidden]; expert_ids, expert_weights
        [tokens, top_k]; w_gate_up [experts, 2 * inter, hidden]; w_down [experts, hidden, inter]."""

    def paged_attention(self, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                        meta: AttentionMetadata, out: np.ndarray, *, scale: float | None = None,
                        sliding_window: int | None = None, softcap: float | None = None) -> None:
        """Options (reference.paged_attention): scale of q.k (None: 1/sqrt(head_dim)); a query at p
        sees keys p - sliding_window + 1 .. p only; scores -> softcap * tanh(scores / softcap)."""


def resolve_backend(name: str | None = None) -> str:
    """`name`, else the default; a clear error for an unknown one."""
    name = name or DEFAULT_BACKEND
    if name not in BACKENDS:
        raise ValueError(f"kernels must be one of {sorted(BACKENDS)}, got {name!r}")
    return name


def get_kernels(name: str | None = None, device: str = "cpu", dtype: str = "float32",
                int_dot: bool = False) -> Kernels:
    """The backend `name` (see resolve_backend); "torch" is an instance on `device` computing in `dtype`.
    With `int_dot`, the numpy-array backend whose `linear` multiplies quantized weights by
    activations rounded to 8 bits (kernels/int_dot.py; the engine's int_dot knob)."""
    if name == TORCH_BACKEND:
        from vllmlite.kernels.torch import TorchKernels  # torch is an optional extra: imported only here
        return TorchKernels(device, dtype)
    backend = importlib.import_module(BACKENDS[resolve_backend(name)])
    return IntDotKernels(backend) if int_dot else backend  # type: ignore[return-value]


class IntDotKernels:
    """A numpy-array backend (numpy or numba) with every quantized product through integer dot
    products: `linear(x, weight, out)` is the backend's `linear(..., int_dot=True)`; every other
    operation is the backend's own."""

    def __init__(self, backend) -> None:
        self.backend = backend

    def __getattr__(self, name: str):
        return getattr(self.backend, name)

    def linear(self, x: np.ndarray, weight: np.ndarray | QuantizedMatrix, out: np.ndarray) -> None:
        self.backend.linear(x, weight, out, int_dot=True)

