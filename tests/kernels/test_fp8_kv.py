"""kv_cache_dtype fp8 on the torch kernels (vllmlite/kernels/kv_dtype.py): the KV write rounds to the
nearest e4m3 value and clips at +-448 (the Triton kernel and the torch operations byte for byte),
paged attention over an fp8 cache equals the numpy reference over the same values widened (Triton
and torch paths; decodes, chunks over cached context, split contexts), and block copies and swaps
move the bytes. Without a GPU the Triton kernels run in their interpreter; `cuda` cases compile them."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch_facade import triton_interpreted_without_a_gpu  # noqa: E402

if not triton_interpreted_without_a_gpu():
    pytest.skip("triton is not installed", allow_module_level=True)

from test_triton_attention import scattered_tables  # noqa: E402

from vllmlite.kernels import kv_dtype, reference  # noqa: E402
from vllmlite.kernels.attention_metadata import build_metadata  # noqa: E402
from vllmlite.kernels.torch import FP8, TorchKernels  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
# Every finite e4m3 value, ascending (the 256 bytes read as float8 e4m3fn, NaNs dropped).
E4M3 = np.unique(torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float().numpy())
E4M3 = E4M3[np.isfinite(E4M3)]


def backend_on(device: str, triton: bool, dtype: str = "float32") -> TorchKernels:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return TorchKernels(device, dtype, triton=triton)


def nearest_e4m3(x: np.ndarray) -> np.ndarray:
    """x clipped to +-448 and rounded to the nearest e4m3 value (ties: the one with an even last
    bit, which this table's order alternates), from the table of all values: no cast involved."""
    x = np.clip(x, -kv_dtype.FP8_MAX, kv_dtype.FP8_MAX)
    above = np.clip(np.searchsorted(E4M3, x), 1, len(E4M3) - 1)
    low, high = E4M3[above - 1], E4M3[above]
    return np.where(x - low < high - x, low, high)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("triton", [False, True])
def test_the_write_rounds_to_the_nearest_e4m3_value_and_clips(device, triton):
    rng = np.random.default_rng(0)
    k = (rng.standard_normal((40, 2, 64)) * rng.choice([0.01, 1, 50, 900], (40, 2, 1))).astype(np.float32)
    v = -k[::-1].copy()
    backend = backend_on(device, triton)
    k_cache, v_cache = (backend.zeros((64, 2, 64), "fp8") for _ in "kv")
    slots = rng.permutation(64)[:40]
    backend.write_kv(k_cache, v_cache, backend.to_device(k), backend.to_device(v), backend.to_device(slots))
    for cache, x in ((k_cache, k), (v_cache, v)):
        assert cache.dtype == FP8
        got = cache.float().cpu().numpy()
        np.testing.assert_array_equal(got[slots], nearest_e4m3(x))
        assert (got[np.setdiff1d(np.arange(64), slots)] == 0).all()   # no other slot touched
    assert np.abs(k).max() > kv_dtype.FP8_MAX and np.abs(got).max() == kv_dtype.FP8_MAX   # clipped, never NaN


def attention_case(device: str, triton: bool, query_lens, seq_lens, dtype="float32", num_sms=None, **options):
    """(relative error against the reference over the widened fp8 cache, output): K/V written
    through the backend's write_kv into fp8 caches whose unowned slots hold garbage."""
    rng = np.random.default_rng(sum(seq_lens))
    heads, kv_heads, head_dim, block_size = 8, 2, 64, 16
    tables, num_blocks = scattered_tables(seq_lens, block_size, rng)
    meta = build_metadata(query_lens, seq_lens, tables, block_size)
    q = rng.standard_normal((sum(query_lens), heads, head_dim)).astype(np.float32)
    backend = backend_on(device, triton, dtype)
    num_slots = num_blocks * block_size
    k_cache, v_cache = (backend.zeros((num_slots, kv_heads, head_dim), "fp8") for _ in "kv")
    garbage = backend.to_device(rng.uniform(-300, 300, (num_slots, kv_heads, head_dim)), torch.float32)
    k_cache.copy_(garbage.to(FP8))
    v_cache.copy_((-garbage).to(FP8))
    for s, (n, table) in enumerate(zip(seq_lens, tables)):   # each sequence's K/V through write_kv
        positions = np.arange(n)
        slots = np.asarray(table)[positions // block_size] * block_size + positions % block_size
        k, v = (rng.standard_normal((n, kv_heads, head_dim)).astype(np.float32) * 3 for _ in "kv")
        backend.write_kv(k_cache, v_cache, backend.to_device(k), backend.to_device(v), backend.to_device(slots))
    if num_sms is not None:
        backend.num_sms = num_sms
    out = backend.zeros(q.shape).fill_(float("nan"))
    backend.paged_attention(backend.to_device(q), k_cache, v_cache, meta, out, **options)
    expected = np.zeros_like(q)
    widened = [c.float().cpu().numpy() for c in (k_cache, v_cache)]
    reference.paged_attention(q, *widened, meta, expected, **options)
    got = backend.to_numpy(out)
    return np.linalg.norm(got - expected) / np.linalg.norm(expected), got


CASES = {
    "decodes": ([1, 1, 1, 1], [1, 17, 64, 130]),
    "chunks over cached context": ([5, 1, 30, 77, 40], [40, 3, 90, 200, 40]),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("triton", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_attention_over_fp8_equals_the_reference_over_its_values(device, triton, case):
    error, got = attention_case(device, triton, *CASES[case])
    assert not np.isnan(got).any() and error < 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_split_contexts_and_windows_over_fp8(device):
    error, got = attention_case(device, True, [1, 1, 4], [1100, 260, 1030], num_sms=64, sliding_window=300)
    assert not np.isnan(got).any() and error < 1e-5


@pytest.mark.cuda
def test_bfloat16_queries_over_fp8_within_bf16_precision():
    error, got = attention_case("cuda", True, [1] * 32 + [40], [int(n) for n in np.linspace(1, 2000, 33)],
                                dtype="bfloat16")
    assert not np.isnan(got).any() and error < 1e-2   # bf16 operands' precision, as test_triton_attention's


@pytest.mark.parametrize("device", DEVICES)
def test_block_copies_and_swaps_move_the_bytes(device):
    backend = backend_on(device, True)
    rng = np.random.default_rng(3)
    src = backend.to_device(rng.standard_normal((32, 2, 8)) * 10).to(FP8)
    for dst in (backend.zeros((32, 2, 8), "fp8"), backend.host_zeros((32, 2, 8), "fp8")):   # CoW, swap out
        backend.copy_slots(src, dst, np.array([3, 4, 9]), np.array([0, 7, 8]))
        assert dst.dtype == FP8
        np.testing.assert_array_equal(dst[[0, 7, 8]].float().cpu().numpy(), src[[3, 4, 9]].float().cpu().numpy())
        assert (dst.float()[[1, 2, 3]] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_rope_and_write_kv_stores_what_rope_then_write_kv_store(device):
    """The fused kernel into fp8 caches (clipped, rounded to nearest even, as write_kv's), in bfloat16
    and float32: the same bytes and the same rotated queries as the two kernels one after the other."""
    rng = np.random.default_rng(8)
    for dtype in ("float32", "bfloat16"):
        backend = backend_on(device, triton=True, dtype=dtype)
        qk = backend.to_device(300 * rng.standard_normal((5, 6, 64)).astype(np.float32))   # some clip at 448
        value = backend.to_device(300 * rng.standard_normal((5, 2, 64)).astype(np.float32))
        angles = rng.uniform(0, 100, (50, 32))
        cos, sin = (backend.to_device(f(angles).astype(np.float32)) for f in (np.cos, np.sin))
        positions, slots = backend.to_device(np.array([3, 49, 0, 7, 7])), backend.to_device(np.array([9, 0, 31, 4, 12]))
        caches = []
        for fused in (True, False):
            x = qk.clone()
            k_cache, v_cache = (backend.zeros((32, 2, 64), "fp8") for _ in "kv")
            if fused:
                backend.rope_and_write_kv(x, value, positions, cos, sin, k_cache, v_cache, slots)
            else:
                backend.rope(x, positions, cos, sin)
                backend.write_kv(k_cache, v_cache, x[:, 4:], value, slots)
            caches.append([t.view(torch.uint8).cpu() if t.dtype == torch.float8_e4m3fn else t.cpu()
                           for t in (x, k_cache, v_cache)])
        for fused, separate in zip(*caches):
            assert torch.equal(fused, separate)
        assert caches[0][1].any()


def test_fp8_costs_one_byte_an_element():
    assert kv_dtype.kv_bytes_per_token(30, 3, 64, "fp8", 4) == 2 * 30 * 3 * 64
    assert kv_dtype.kv_bytes_per_token(30, 3, 64, "fp8", 2) * 2 == kv_dtype.kv_bytes_per_token(30, 3, 64, "auto", 2)
