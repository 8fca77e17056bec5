"""The Triton paged-attention kernel (vllmlite/kernels/torch/triton_attention.py) against the numpy
reference: decodes, speculative multi-token queries, prefill chunks over cached context and mixed
batches, over scattered block tables, block sizes that do and do not divide the kernel's tile,
every grouped-query shape the models use, and contexts split across programs. Without a GPU it runs in Triton's interpreter (TRITON_INTERPRET=1, set here before the kernel
is defined); the `cuda` cases run the compiled kernel, in float32 and bfloat16."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch_facade import triton_interpreted_without_a_gpu  # noqa: E402

if not triton_interpreted_without_a_gpu():
    pytest.skip("triton is not installed", allow_module_level=True)

from vllmlite.kernels import reference  # noqa: E402
from vllmlite.kernels.attention_metadata import build_metadata  # noqa: E402
from vllmlite.kernels.torch import TorchKernels  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def scattered_tables(seq_lens: list[int], block_size: int, rng: np.random.Generator) -> tuple[list[list[int]], int]:
    """Block tables whose blocks are a random permutation of the pool (no sequence's blocks adjacent)."""
    counts = [-(-n // block_size) for n in seq_lens]
    pool = rng.permutation(sum(counts) + 3)
    tables, start = [], 0
    for count in counts:
        tables.append([int(b) for b in pool[start:start + count]])
        start += count
    return tables, len(pool)


def run(device: str, query_lens, seq_lens, block_size, heads, kv_heads, head_dim, dtype="float32", seed=0,
        strided=False, num_sms=None, **options):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    rng = np.random.default_rng(seed)
    tables, num_blocks = scattered_tables(seq_lens, block_size, rng)
    meta = build_metadata(query_lens, seq_lens, tables, block_size)
    num_tokens = sum(query_lens)
    q = rng.standard_normal((num_tokens, heads, head_dim)).astype(np.float32)
    k_cache, v_cache = (rng.standard_normal((num_blocks * block_size, kv_heads, head_dim)).astype(np.float32)
                        for _ in range(2))
    expected = np.zeros_like(q)
    reference.paged_attention(q, k_cache, v_cache, meta, expected, **options)
    backend = TorchKernels(device, dtype, triton=True)
    if num_sms is not None:   # as many multiprocessors as to make the kernel split the context, or not
        backend.num_sms = num_sms
    out = backend.zeros(q.shape[::-1]).permute(2, 1, 0) if strided else backend.zeros(q.shape)
    out.fill_(float("nan"))                      # every element must be written
    q_device = backend.to_device(q)
    if strided:  # as a feature-major workspace hands them out: no dimension contiguous but the tokens
        q_device = q_device.permute(2, 1, 0).contiguous().permute(2, 1, 0)
    backend.paged_attention(q_device, *(backend.to_device(a) for a in (k_cache, v_cache)), meta, out, **options)
    got = backend.to_numpy(out)
    return np.linalg.norm(got - expected) / np.linalg.norm(expected), got


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (9, 3, 64), (8, 2, 64), (32, 8, 128)])
@pytest.mark.parametrize("block_size", [1, 16, 48])
def test_decodes_match_the_reference(device, heads, kv_heads, head_dim, block_size):
    error, got = run(device, [1, 1, 1, 1], [1, 17, 64, 130], block_size, heads, kv_heads, head_dim)
    assert not np.isnan(got).any() and error < 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [8, 80])
def test_head_sizes_below_16_or_not_a_power_of_two_and_strided_operands(device, head_dim):
    """Head sizes the tile pads (8: under tl.dot's minimum; 80: not a power of 2), with q and out in
    the feature-major layout of the CPU backends' workspace."""
    error, got = run(device, [1, 1, 3], [5, 40, 20], 16, 6, 2, head_dim, strided=True)
    assert not np.isnan(got).any() and error < 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (9, 3), (16, 16)])
def test_multi_token_queries_and_prefill_chunks_are_causal(device, heads, kv_heads):
    """Speculative verification (2-8 queries: each sees only the keys up to its own position),
    beside prefill chunks of 30 and 77 tokens over cached context and a whole 40-token prompt (the
    long tiles: several rows each, the last one ragged)."""
    error, got = run(device, [5, 1, 8, 30, 2, 77, 40], [40, 3, 8, 90, 70, 200, 40], 16, heads, kv_heads, 64)
    assert not np.isnan(got).any() and error < 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("query_lens,seq_lens", [([1], [1100]), ([1, 1, 3], [1, 1030, 129]), ([1, 20], [2000, 30])])
def test_contexts_split_across_programs_combine_to_the_same_attention(device, query_lens, seq_lens):
    """Few sequences on a device of many multiprocessors: the context is cut into splits whose
    partial softmax states a second kernel combines (some splits hold no key of a short sequence)."""
    error, got = run(device, query_lens, seq_lens, 16, 8, 2, 64, num_sms=64)
    assert not np.isnan(got).any() and error < 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("options", [dict(sliding_window=300), dict(sliding_window=700, softcap=5.0, scale=0.2),
                                     dict(sliding_window=40)])
def test_split_contexts_with_a_window_and_softcap(device, options):
    """A plan made for the whole context (as CUDA graphs capture it) serves a windowed layer: its
    splits start at each tile's first key, the ones past the window do nothing; a window inside
    one split and across two; decodes and a multi-row tile."""
    error, got = run(device, [1, 1, 4], [1100, 260, 1030], 16, 8, 2, 64, num_sms=64, **options)
    assert not np.isnan(got).any() and error < 1e-5


def test_the_split_plan_splits_only_a_starved_device():
    from vllmlite.kernels.torch.triton_attention import BLOCK_N, split_plan
    assert split_plan(num_programs=2048, max_context=4096, num_sms=132) == (1, 0)     # a full batch: no split
    assert split_plan(num_programs=8, max_context=1000, num_sms=132) == (1, 0)       # too short to split
    splits, length = split_plan(num_programs=8, max_context=4096, num_sms=132)
    assert splits == 8 and length % BLOCK_N == 0 and splits * length >= 4096   # 512 keys each


def test_tiles_cut_each_sequence_into_runs_of_rows():
    from vllmlite.kernels.torch.triton_attention import make_tiles
    tiles = make_tiles(np.array([0, 1, 6]), np.array([9, 0, 1, 2, 3, 4]), np.array([0, 1]), 4)
    assert tiles.tolist() == [[0, 1, 0, 9], [1, 4, 1, 0], [5, 1, 1, 4]]


@pytest.mark.cuda
def test_bfloat16_matches_the_float32_reference_within_its_precision():
    error, _ = run("cuda", [1] * 64 + [4] * 8, [int(n) for n in np.linspace(1, 3000, 72)], 16, 32, 8, 128,
                   dtype="bfloat16")
    assert error < 1e-2   # bf16 operands: a relative error between 1e-3 and 1e-2 is their precision
