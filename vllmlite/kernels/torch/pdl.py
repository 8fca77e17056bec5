"""Programmatic dependent launch (PDL) for the Triton kernels on Hopper and later GPUs.

A one-stream decode step is about 150 kernels, each a few microseconds, and between two of them
the GPU sat idle for about 1.3 us while the next one launched (results/gpu_runs/run23_launch_floor.json).
Launched with PDL, a kernel may start while the one before it is still running: each of ours first
waits (`griddepcontrol.wait`) until everything before it in the stream has finished and its writes
are visible, so it reads exactly what it read before, and then lets the kernel after it start
launching (`griddepcontrol.launch_dependents`), so that launch overlaps its own work. A kernel
that comes after a non-PDL one (a torch operation, a copy) waits for it as usual.

Off where it cannot run: on the CPU (Triton's interpreter knows no inline assembly), before
compute capability 9.0, and with a Triton that lacks the instructions.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:   # a Triton without grid dependency control: PDL stays off
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def start(PDL: tl.constexpr):
    """A kernel's first statement: with PDL, wait for the kernels before it, then let the next launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@functools.cache
def _supported(device_index: int) -> bool:
    return gdc_wait is not None and torch.cuda.get_device_capability(device_index)[0] >= 9


def enabled(x: torch.Tensor) -> bool:
    """Whether kernels on x's device launch with PDL."""
    return x.is_cuda and _supported(x.device.index if x.device.index is not None else torch.cuda.current_device())


def options(x: torch.Tensor) -> dict:
    """A launch's PDL arguments for kernels on x's device: the kernel's `PDL` (for `start`) and
    Triton's `launch_pdl`."""
    on = enabled(x)
    return {"PDL": on, "launch_pdl": on}
