"""The Triton GEMV (vllmlite/kernels/torch/triton_gemv.py) against numpy, and TorchKernels.linear
taking it for one bf16 row on a GPU. Without a GPU the kernel runs in Triton's interpreter
(TRITON_INTERPRET=1, set before it is defined); the `cuda` cases run it compiled."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch_facade import triton_interpreted_without_a_gpu  # noqa: E402

if not triton_interpreted_without_a_gpu():
    pytest.skip("triton is not installed", allow_module_level=True)

from vllmlite.kernels.torch import TorchKernels  # noqa: E402
from vllmlite.kernels.torch.triton_gemv import gemv  # noqa: E402


def device_or_skip(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("n, k, block_n, block_k", [
    (64, 256, 16, 128),     # tiles divide both
    (37, 300, 16, 128),     # neither divides: masked rows and a masked last step of K
    (5, 64, 8, 256),        # one program, K shorter than a step
])
def test_gemv_matches_numpy(device, n, k, block_n, block_k):
    device_or_skip(device)
    rng = np.random.default_rng(n + k)
    x, w = rng.standard_normal((1, k)).astype(np.float32), rng.standard_normal((n, k)).astype(np.float32)
    out = torch.full((1, n), float("nan"), device=device)
    gemv(torch.from_numpy(x).to(device), torch.from_numpy(w).to(device), out, block_n=block_n, block_k=block_k)
    expected = x.astype(np.float64) @ w.T.astype(np.float64)
    np.testing.assert_allclose(out.cpu().numpy(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.cuda
def test_linear_takes_the_gemv_for_one_bf16_row_and_matches_cublas():
    device_or_skip("cuda")
    backend = TorchKernels("cuda", "bfloat16", triton=True)
    w = torch.randn((3000, 2048), dtype=torch.bfloat16, device="cuda") * 0.02
    for rows in (1, 3):   # one row: the GEMV; more: cuBLAS
        x = torch.randn((rows, 2048), dtype=torch.bfloat16, device="cuda")
        out = torch.empty((rows, 3000), dtype=torch.bfloat16, device="cuda")
        backend.linear(x, w, out)
        expected = x.float() @ w.float().T
        assert ((out.float() - expected).abs().max() / expected.abs().max()).item() < 1e-2


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_programmatic_dependent_launch_only_where_the_gpu_has_it(device):
    """The Triton kernels launch with PDL (kernels/torch/pdl.py) on a CUDA device of compute
    capability 9.0 or more, an H200's, and never on the CPU, where Triton's interpreter runs them."""
    device_or_skip(device)
    from vllmlite.kernels.torch import pdl
    expected = device == "cuda" and pdl.gdc_wait is not None and torch.cuda.get_device_capability()[0] >= 9
    assert pdl.enabled(torch.zeros(1, device=device)) == expected
