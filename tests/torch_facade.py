"""Test helper: the torch kernels behind the numpy-array interface the kernel tests speak.

Every numpy argument becomes a tensor (on the CPU the same memory, so in-place writes land in the
caller's arrays; on CUDA a copy, written back after the call), so tests/kernels hold the torch
backend to the numpy references with the very tests the numba backend passes.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import torch

from vllmlite.kernels.quant import QuantizedMatrix, dequantize
from vllmlite.kernels.torch import TorchKernels


def triton_interpreted_without_a_gpu() -> bool:
    """Whether Triton is installed; without a GPU, switch it to its interpreter (TRITON_INTERPRET=1,
    read when a kernel is defined, so call this before importing one)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return importlib.util.find_spec("triton") is not None


OPS = ("linear", "rms_norm", "add_rms_norm", "rope", "silu_and_mul", "gelu_tanh_and_mul", "softcap", "write_kv",
       "rope_and_write_kv", "paged_attention", "moe")


class NumpyFacade:
    def __init__(self, device: str = "cpu", triton: bool = False) -> None:
        self.device = device
        self.backend = TorchKernels(device, triton=triton)
        for op in OPS:
            setattr(self, op, self._wrap(getattr(self.backend, op)))

    def _wrap(self, fn):
        def call(*args, **options):   # options: plain values (paged_attention's scale, window, ...)
            pairs = [(a, self._tensor(a)) for a in args]
            fn(*(t for _, t in pairs), **options)
            if self.device != "cpu":   # written back: outputs and in-place arguments alike
                for array, tensor in pairs:
                    if isinstance(array, np.ndarray) and array.flags.writeable:
                        array[...] = tensor.cpu().numpy()
        return call

    def _tensor(self, value):
        if isinstance(value, QuantizedMatrix):
            value = dequantize(value)
        if not isinstance(value, np.ndarray):
            return value
        tensor = torch.from_numpy(value) if value.dtype != np.int32 else torch.from_numpy(value.astype(np.int64))
        return tensor if self.device == "cpu" else tensor.to(self.device)
