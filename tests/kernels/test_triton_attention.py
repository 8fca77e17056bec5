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
from vllmlite.kernels.torch import TorchKernels, paged_attention_kernel  # noqa: E402

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
    partial softmax states the last split combines (some splits hold no key of a short sequence)."""
    error, got = run(device, query_lens, seq_lens, 16, 8, 2, 64, num_sms=64)
    assert not np.isnan(got).any() and error < 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("options", [dict(sliding_window=300), dict(sliding_window=700, softcap=5.0, scale=0.2),
                                     dict(sliding_window=40)])
def test_split_contexts_with_a_window_and_softcap(device, options):
    """A plan made for the whole context (as CUDA graphs capture it) serves a windowed layer: each
    tile's splits cut only the keys its window sees; a window narrower and wider than a split's
    tile of keys; decodes and a multi-row tile."""
    error, got = run(device, [1, 1, 4], [1100, 260, 1030], 16, 8, 2, 64, num_sms=64, **options)
    assert not np.isnan(got).any() and error < 1e-5


def test_the_split_plan_splits_only_a_starved_device():
    split_plan = paged_attention_kernel().split_plan
    assert split_plan(num_programs=2048, max_context=4096, num_sms=132) == 1     # a full batch: no split
    assert split_plan(num_programs=8, max_context=100, num_sms=132) == 1         # under MIN_SPLIT_KEYS: no split
    assert split_plan(num_programs=8, max_context=512, num_sms=132) == 4         # 128 keys each
    assert split_plan(num_programs=8, max_context=1000, num_sms=132) == 8
    assert split_plan(num_programs=8, max_context=40960, num_sms=132) == 16      # at most 16
    assert split_plan(num_programs=64, max_context=40960, num_sms=132) == 5      # two programs per multiprocessor
    assert split_plan(num_programs=8, max_context=4096, num_sms=0) == 1          # the CPU: never


def run_splits(device, query_lens, seq_lens, num_splits, heads=4, kv_heads=2, head_dim=16, block_size=16,
               seed=0, block_n=None, **options):
    """The kernel launched straight with `num_splits` (short-query tiles, as decodes get them)
    against the reference; returns the relative error and the output."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    ta = paged_attention_kernel()
    rng = np.random.default_rng(seed)
    tables, num_blocks = scattered_tables(seq_lens, block_size, rng)
    meta = build_metadata(query_lens, seq_lens, tables, block_size)
    q = rng.standard_normal((sum(query_lens), heads, head_dim)).astype(np.float32)
    k_cache, v_cache = (rng.standard_normal((num_blocks * block_size, kv_heads, head_dim)).astype(np.float32)
                        for _ in range(2))
    expected = np.zeros_like(q)
    reference.paged_attention(q, k_cache, v_cache, meta, expected, **options)
    rows = ta.tile_rows(heads, kv_heads, long=False)
    tiles = ta.make_tiles(meta.query_start, meta.positions, np.arange(len(query_lens)), rows)
    dev = [torch.from_numpy(np.ascontiguousarray(a)).to(device)
           for a in (q, k_cache, v_cache, tiles, np.asarray(meta.block_tables, np.int64))]
    out = torch.full(q.shape, float("nan"), device=device)    # every element must be written
    ta.paged_attention_tiles(*dev[:4], rows, dev[4], block_size, out, num_splits, block_n or ta.BLOCK_N, **options)
    got = out.cpu().numpy()
    return np.linalg.norm(got - expected) / np.linalg.norm(expected), got


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits", [1, 2, 5, 16])
@pytest.mark.parametrize("window", [None, 100])
def test_any_number_of_splits_matches_the_reference(device, num_splits, window):
    """Contexts shorter than (down to fewer keys than splits), equal to and longer than num_splits
    tiles of BLOCK_N keys, as decodes and one multi-row tile (5 rows), with and without a window:
    splits left with no keys must weigh nothing in the combine."""
    span = num_splits * paged_attention_kernel().BLOCK_N
    seq_lens = [3, span - 37 if span > 64 else 27, span, span + 50, span + 9]
    error, got = run_splits(device, [1, 1, 1, 1, 5], seq_lens, num_splits, sliding_window=window)
    assert not np.isnan(got).any() and error < 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits,window", [(1, None), (3, None), (2, 40)])
def test_32_keys_a_tile_match_the_reference(device, num_splits, window):
    """Tiles of 32 keys (the plan gives BLOCK_N; bench/gpu_attention.py sweeps others): contexts
    around multiples of 32 keys, split or not, windowed or not, at head_dim 128."""
    error, got = run_splits(device, [1, 1, 1, 1], [5, 32, 95, 161], num_splits, head_dim=128, block_n=32,
                            sliding_window=window)
    assert not np.isnan(got).any() and error < 1e-5


def test_eight_warps_only_for_launches_of_few_programs():
    ta = paged_attention_kernel()
    assert ta.warps_for(num_programs=80, num_sms=132) == 8       # one decode, 8 KV heads, 10 splits
    assert ta.warps_for(num_programs=396, num_sms=132) == 8      # up to 3 a multiprocessor
    assert ta.warps_for(num_programs=397, num_sms=132) == 4
    assert ta.warps_for(num_programs=8, num_sms=0) == 4          # the CPU
    assert ta.short_query_plan(8, 1168, 132) == (10, 64, 8)  # a graph's plan for one Llama-3.2-1B decode
    assert ta.short_query_plan(2048, 1168, 132) == (1, 64, 4)   # 256 decodes, 8 KV heads


@pytest.mark.parametrize("device", DEVICES)
def test_a_plan_for_a_long_context_spreads_a_short_one_over_its_splits(device, monkeypatch):
    """The CUDA-graph case: splits planned for max_model_len on a much shorter context give the
    reference's output, and the context's keys are spread over the splits (one BLOCK_N tile each),
    not all left to the first: a 512-key decode over 16 splits keeps 8 busy, the rest hold the
    neutral state (max -inf, sum 0, accumulator 0)."""
    ta = paged_attention_kernel()
    num_splits = ta.split_plan(num_programs=2, max_context=32768, num_sms=132)
    assert num_splits == 16
    states, split_buffers = [], ta.split_buffers
    def keep(num_rows, head_pad, device):
        states.append(split_buffers(num_rows, head_pad, device))
        return states[-1]
    monkeypatch.setattr(ta, "split_buffers", keep)
    error, got = run_splits(device, [1], [512], num_splits)
    assert not np.isnan(got).any() and error < 1e-5
    part, state = (t.cpu() for t in states[0])
    state = state.view(1, 2, num_splits, -1, 2)[:, :, :, 0]                 # the first (row, head) of each split
    part = part.view(1, 2, num_splits, -1, part.shape[-1])[:, :, :, 0]
    busy = 512 // ta.BLOCK_N
    assert (state[:, :, :busy, 1] > 0).all() and torch.isfinite(state[:, :, :busy, 0]).all()
    assert (state[:, :, busy:, 0] == float("-inf")).all() and (state[:, :, busy:, 1] == 0).all()
    assert (part[:, :, busy:] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_the_last_split_combines_and_leaves_the_counters_at_zero(device):
    """No second kernel combines the splits: the split that finishes last does, found by an atomic
    count per (tile, KV head) that it sets back to zero, so the same launch again (a CUDA graph's
    next replay) combines again, to the same output."""
    first = run_splits(device, [1, 1, 5], [700, 3, 260], 6)
    assert (paged_attention_kernel().split_counters(1, device) == 0).all()
    again = run_splits(device, [1, 1, 5], [700, 3, 260], 6)
    assert first[0] < 1e-5 and np.array_equal(first[1], again[1])


@pytest.mark.parametrize("device", DEVICES)
def test_64_bit_offsets_into_a_large_cache_match_the_reference(device, monkeypatch):
    """Caches past NARROW_CACHE elements are read through 64-bit offsets (a smaller limit here makes
    these small ones take that path): decodes, a split context and a prefill chunk over cached context."""
    monkeypatch.setattr(paged_attention_kernel(), "NARROW_CACHE", 1000)
    error, _ = run(device, [1, 1, 40], [900, 37, 300], 16, 8, 2, 64, num_sms=64)
    assert error < 1e-5


def test_more_splits_than_the_combine_unrolls_are_refused():
    with pytest.raises(ValueError, match="num_splits must be in"):
        run_splits("cpu", [1], [512], paged_attention_kernel().MAX_SPLITS + 1)


def test_tiles_cut_each_sequence_into_runs_of_rows_longest_context_first():
    from vllmlite.kernels.torch.triton_attention import make_tiles
    tiles = make_tiles(np.array([0, 1, 6]), np.array([9, 0, 1, 2, 3, 4]), np.array([0, 1]), 4)
    assert tiles.tolist() == [[0, 1, 0, 9], [5, 1, 1, 4], [1, 4, 1, 0]]


@pytest.mark.cuda
def test_bfloat16_matches_the_float32_reference_within_its_precision():
    error, _ = run("cuda", [1] * 64 + [4] * 8, [int(n) for n in np.linspace(1, 3000, 72)], 16, 32, 8, 128,
                   dtype="bfloat16")
    assert error < 1e-2   # bf16 operands: a relative error between 1e-3 and 1e-2 is their precision
