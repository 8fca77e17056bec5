"""The split Triton argmax (vllmlite/kernels/torch/triton_argmax.py) against numpy's: each row's
first maximum, across the parts the row is split into. Without a GPU the kernels run in Triton's
interpreter (TRITON_INTERPRET=1, set before they are defined); the `cuda` cases run them compiled."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch_facade import triton_interpreted_without_a_gpu  # noqa: E402

if not triton_interpreted_without_a_gpu():
    pytest.skip("triton is not installed", allow_module_level=True)

from vllmlite.kernels.torch import TorchKernels  # noqa: E402
from vllmlite.kernels.torch.triton_argmax import CHUNK, argmax  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def device_or_skip(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")


def rows_with_ties(num_rows: int, n: int, seed: int) -> np.ndarray:
    """Random rows whose maximum sits at two or three places: in two parts, and twice in one part."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((num_rows, n)).astype(np.float32)
    for r in range(num_rows):
        places = rng.choice(n, size=min(n, 3), replace=False)
        x[r, places] = 9.0 + r   # exactly representable in bf16 too
    return x


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows, n", [(1, 5), (3, CHUNK), (2, 2 * CHUNK + 17), (4, 3 * CHUNK - 1)])
def test_argmax_is_each_rows_first_maximum(device, dtype, num_rows, n):
    device_or_skip(device)
    x = rows_with_ties(num_rows, n, seed=n)
    logits = torch.from_numpy(x).to(device=device, dtype=dtype)
    out = torch.full((num_rows,), -1, dtype=torch.int64, device=device)
    argmax(logits, out)
    expected = logits.float().cpu().numpy().argmax(axis=1)
    assert out.cpu().numpy().tolist() == expected.tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_argmax_of_rows_of_minus_infinity_equal_values_and_nan(device):
    """A row of -inf only (every token masked) and a row of equal values give 0, as numpy does; a NaN
    is the largest value (numpy's and torch's reading too), in the second part of its row and in the
    first, before a larger number."""
    device_or_skip(device)
    n = CHUNK + 100
    x = np.zeros((4, n), np.float32)
    x[0] = -np.inf
    x[2, CHUNK + 7], x[2, 5] = np.nan, 1e30
    x[3, 7], x[3, CHUNK + 3] = np.nan, 1e30
    out = torch.empty(4, dtype=torch.int64, device=device)
    argmax(torch.from_numpy(x).to(device), out)
    assert out.cpu().numpy().tolist() == [0, 0, CHUNK + 7, 7] == np.argmax(x, axis=1).tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_the_torch_backend_takes_the_split_argmax_with_triton_and_torchs_without(device):
    device_or_skip(device)
    x = rows_with_ties(2, 2 * CHUNK + 3, seed=1)
    for triton in (True, False):
        backend = TorchKernels(device, "float32", triton=triton)
        logits = backend.to_device(x)
        assert backend.argmax(logits).tolist() == x.argmax(axis=1).tolist()
        # a view whose rows are not contiguous takes torch's argmax
        assert backend.argmax(logits.T.contiguous().T).tolist() == x.argmax(axis=1).tolist()
