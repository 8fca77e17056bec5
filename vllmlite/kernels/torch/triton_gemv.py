"""One row times a weight matrix (a decode of one sequence: out = x @ weight.T with x [1, K]) in
Triton: a matrix-vector product bound by reading the weight once.

Why not cuBLAS there: at one row its kernels read an H200's weights at about 70% of the copy
bandwidth (Llama-3.2-1B's shapes: the products of one token took 0.85 ms in a CUDA graph against
0.59 ms of bytes at copy speed), and a stream of one request is all weight reads. Each program
here owns BLOCK_N output features and walks the whole of K in BLOCK_K steps, multiplying in
float32: no split of K, so no second pass and no atomics, and the sum's order is fixed by the
shape (the same result every run). `plan` picks the tile from the shape; bench/gpu_gemv.py sweeps
the tiles against torch.mm at the model shapes.

Runs on CUDA, and on the CPU under TRITON_INTERPRET=1 (the tests' way to check it without a GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllmlite.kernels.torch import pdl


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, N, K, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = n < N
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    rows = w_ptr + n.to(tl.int64)[:, None] * stride_w
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptr + k0 + k)
            w = tl.load(rows + (k0 + k)[None, :], mask=n_valid[:, None], other=0.0)
        else:
            k_valid = k0 + k < K
            x = tl.load(x_ptr + k0 + k, mask=k_valid, other=0.0)
            w = tl.load(rows + (k0 + k)[None, :], mask=n_valid[:, None] & k_valid[None, :], other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(out_ptr + n, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=n_valid)


def plan(num_out: int, num_in: int) -> dict:
    """The tile for a [num_out, num_in] weight, from bench/gpu_gemv.py's sweep on an H200 over the
    Qwen3-0.6B, Llama-3.2-1B and Llama-3.1-8B shapes (results/gpu_gemv.json; each pick within 3% of
    the sweep's best there): the LM head in tiles of 16 x 256, wide gate/up matrices 32 x 256; narrow
    matrices with rows of 2,048 or more in steps of 1,024 with 8 warps and 4 to 16 rows a program, so
    they still make hundreds of programs; the rest 8 x 512."""
    if num_out >= 65536:
        return dict(block_n=16, block_k=256, num_warps=4, num_stages=2)
    if num_out >= 12288:
        return dict(block_n=32, block_k=256, num_warps=4, num_stages=2)
    if num_in >= 2048 and num_out <= 4096:
        block_n = 16 if num_in >= 8192 and num_out >= 4096 else 8 if num_out > 2048 else 4
        return dict(block_n=block_n, block_k=1024, num_warps=8, num_stages=2)
    return dict(block_n=8, block_k=512, num_warps=4, num_stages=2)


def gemv(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, block_n: int | None = None,
         block_k: int | None = None, num_warps: int | None = None, num_stages: int | None = None) -> None:
    """out[0] = weight @ x[0], in place: x [1, K] and out [1, N] contiguous rows, weight [N, K] with
    unit stride along K (nn.Linear's layout). The tile is `plan`'s unless given."""
    num_out, num_in = weight.shape
    tile = plan(num_out, num_in)
    block_n, block_k = block_n or tile["block_n"], block_k or tile["block_k"]
    num_warps, num_stages = num_warps or tile["num_warps"], num_stages or tile["num_stages"]
    _gemv_kernel[(triton.cdiv(num_out, block_n),)](
        x, weight, out, num_out, num_in, weight.stride(0), BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_K=num_in % block_k == 0, **pdl.options(x), num_warps=num_warps,
        num_stages=num_stages)
