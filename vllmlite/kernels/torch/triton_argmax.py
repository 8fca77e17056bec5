"""Each row's first maximum (greedy decoding's token) in Triton, split over the row.

Why not torch.argmax: for a few rows it reduces each row in one block of threads, which walks all of
it alone: one row of Llama-3.2-1B's 128,256 logits took 36 us on an H200, 3.6% of a one-stream
decode step (results/gpu_runs/run42_b1_kernel_profile.json). Here a row is read in CHUNK-long
parts by programs of their own, each keeping its part's largest value and the first index of it;
a second kernel takes, per row, the part with the largest value (the first such part), so the
result is the row's first maximum, as numpy's and torch's argmax give it. NaN counts as the
largest value (as there), read as +inf: a row holding both +inf and NaN gives the first of either.

Runs on CUDA, and on the CPU under TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllmlite.kernels.torch import pdl

CHUNK = 4096   # logits a program of the first kernel reads: 32 parts of a 128k vocabulary


@triton.jit
def _part_max_kernel(x_ptr, stride_row, n, part_max_ptr, part_idx_ptr, num_parts, CHUNK: tl.constexpr,
                     PDL: tl.constexpr):
    pdl.start(PDL)
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    cols = part * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * stride_row + cols, mask=cols < n, other=-float("inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)   # NaN: the largest
    top, where = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(part_max_ptr + row * num_parts + part, top)
    tl.store(part_idx_ptr + row * num_parts + part, part * CHUNK + where)


@triton.jit
def _row_max_kernel(part_max_ptr, part_idx_ptr, num_parts, out_ptr, PARTS: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    row = tl.program_id(0).to(tl.int64)
    parts = tl.arange(0, PARTS)
    valid = parts < num_parts
    top = tl.load(part_max_ptr + row * num_parts + parts, mask=valid, other=-float("inf"))
    best = tl.argmax(top, axis=0, tie_break_left=True)
    index = tl.load(part_idx_ptr + row * num_parts + parts, mask=valid, other=0)
    tl.store(out_ptr + row, tl.sum(tl.where(parts == best, index, 0), axis=0).to(out_ptr.dtype.element_ty))


def argmax(logits: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[r] = the first index of logits[r]'s largest value, for logits [rows, n] with unit stride
    along n; out: [rows] integers on the same device. Returns out."""
    rows, n = logits.shape
    num_parts = triton.cdiv(n, CHUNK)
    part_max = torch.empty((rows, num_parts), dtype=torch.float32, device=logits.device)
    part_idx = torch.empty((rows, num_parts), dtype=torch.int32, device=logits.device)
    if rows:
        _part_max_kernel[(rows, num_parts)](logits, logits.stride(0), n, part_max, part_idx, num_parts,
                                            CHUNK=CHUNK, **pdl.options(logits))
        _row_max_kernel[(rows,)](part_max, part_idx, num_parts, out, PARTS=triton.next_power_of_2(num_parts),
                                 **pdl.options(logits))
    return out
