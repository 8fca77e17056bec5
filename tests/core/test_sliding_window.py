"""Sliding window: which blocks a window releases (exactly at the boundary), the peak a request holds,
and every block-manager operation over tables with placeholders (hits, copy-on-write, fork, trim,
swap, free)."""

import itertools

import numpy as np
import pytest

from vllmlite.config import ceil_div
from vllmlite.core.block_manager import BlockManager
from vllmlite.core.sliding_window import SlidingWindow
from vllmlite.kernels.attention_metadata import build_metadata

BS = 4  # block size used throughout
# w < bs, w = bs, w a multiple of bs, w not a multiple of bs (above and below one)
WINDOWS = [1, 3, BS, BS + 1, 2 * BS, 2 * BS + 3]


def _manager(window: int | None, num_blocks: int = 32, num_host_blocks: int = 0, caching: bool = True):
    return BlockManager(num_blocks, BS, caching, num_host_blocks, sliding_window=window)


def _visible_blocks(window: int, num_computed: int, num_tokens: int) -> set[int]:
    """Block indices some query at positions num_computed .. num_tokens - 1 reads, or a later one
    does: every position >= num_computed - window + 1 (the definition, not the formula under test)."""
    first = max(0, num_computed - window + 1)
    return {p // BS for p in range(first, max(num_tokens, num_computed + 1))}


def _compute(bm: BlockManager, request_id: str, tokens: list[int], computed: int, num_tokens: int) -> None:
    """One step: room for positions [computed, num_tokens), then publish and release as the scheduler does."""
    assert bm.allocate(request_id, computed, num_tokens)
    bm.take_copies()
    bm.publish_full_blocks(request_id, tokens, num_tokens)
    bm.remove_skipped_blocks(request_id, num_tokens)
    bm.check_invariants()


# --- the arithmetic --------------------------------------------------------------------------------


@pytest.mark.parametrize("window", WINDOWS)
def test_skipped_blocks_are_exactly_those_no_future_query_reads(window):
    sw = SlidingWindow(window, BS)
    for num_computed in range(6 * BS):
        visible = _visible_blocks(window, num_computed, num_computed + 1)
        # Every block before the first visible one is skipped; the first visible one is not.
        assert sw.num_skipped_blocks(num_computed) == min(visible)


def test_the_boundary_by_hand():
    # bs 4, w 4: the query at 8 sees 5..8, so block 0 (0..3) goes and block 1 (4..7) stays.
    sw = SlidingWindow(4, 4)
    assert [sw.num_skipped_blocks(n) for n in (6, 7, 8, 11, 12)] == [0, 1, 1, 2, 2]
    # w 1 < bs: only the query's own position, so a block goes as soon as the query leaves it.
    assert [SlidingWindow(1, 4).num_skipped_blocks(n) for n in (3, 4, 5, 8)] == [0, 1, 1, 2]
    assert SlidingWindow(None, 4).num_skipped_blocks(10_000) == 0


@pytest.mark.parametrize("window", [None, *WINDOWS])
@pytest.mark.parametrize("max_chunk", [1, 3, BS, 2 * BS + 1])
def test_peak_blocks_bounds_every_schedule_and_is_reached(window, max_chunk):
    """Over every start and chunk size, the blocks held during a step (those the step reads and
    writes, after the last step's release) never exceed peak_blocks, and some step needs them all."""
    sw = SlidingWindow(window, BS)
    num_tokens = 8 * BS
    worst = 0
    for start, chunk in itertools.product(range(num_tokens), range(1, max_chunk + 1)):
        end = min(start + chunk, num_tokens)
        worst = max(worst, sw.num_blocks_held(start, end))
        if window is not None:
            assert sw.num_blocks_held(start, end) == len(_visible_blocks(window, start, end))
    assert worst == sw.peak_blocks(num_tokens, max_chunk)


def test_bad_window_is_refused():
    with pytest.raises(ValueError):
        SlidingWindow(0, BS)


# --- release as computed tokens advance -------------------------------------------------------------


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("chunk", [1, 3, BS, 2 * BS + 1])
def test_prefill_in_chunks_then_decode_holds_only_visible_blocks(window, chunk):
    bm = _manager(window)
    tokens = list(range(1000, 1000 + 6 * BS))
    computed, max_held = 0, 0
    while computed < 10 * BS:
        if computed == len(tokens):
            tokens.append(7)  # decoding: one token a step
        end = min(computed + chunk, len(tokens))
        _compute(bm, "a", tokens, computed, end)
        computed = end
        table = bm.block_table("a")
        held = {i for i, block_id in enumerate(table) if block_id is not None}
        # The table keeps every position's index; held entries are exactly the visible blocks.
        assert len(table) == ceil_div(computed, BS)
        assert held == {i for i in _visible_blocks(window, computed, computed + 1) if i < len(table)}
        assert bm.num_held_blocks("a") == len(held) == bm.num_blocks - bm.num_free_blocks
        max_held = max(max_held, len(held))
    assert max_held <= ceil_div(window, BS) + 1  # not the whole context
    bm.free("a")
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks


def test_no_window_releases_nothing():
    bm = _manager(None)
    tokens = list(range(6 * BS))
    _compute(bm, "a", tokens, 0, len(tokens))
    assert bm.remove_skipped_blocks("a", len(tokens)) == 0
    assert None not in bm.block_table("a") and bm.num_held_blocks("a") == 6


def test_released_published_blocks_stay_cached_and_are_evicted_last():
    bm = _manager(BS, num_blocks=8)
    tokens = list(range(100, 100 + 4 * BS))
    _compute(bm, "a", tokens, 0, len(tokens))  # blocks 0..2 out of the window of the query at 16
    assert bm.block_table("a")[:3] == [None, None, None]
    assert bm.num_cached_blocks == 4 and bm.num_free_blocks == 8 - 1
    states = bm.block_states()
    assert sorted(states) == [0] * 4 + [2] * 3 + [3]  # 3 cached and free, the held one cached and used
    # A request with the same prompt still hits every released block: they are all present.
    hit = bm.find_prefix_hit(tokens + [1])
    assert hit.num_tokens == 4 * BS


def test_a_prefix_hit_references_only_the_blocks_in_its_window():
    bm = _manager(BS + 1)
    tokens = list(range(100, 100 + 4 * BS))
    _compute(bm, "a", tokens, 0, len(tokens))
    bm.free("a")
    hit = bm.find_prefix_hit(tokens + [5, 6])
    assert hit.num_tokens == 4 * BS
    # The query at 16 sees 12..16: blocks 0..2 of the hit are placeholders at once, block 3 is held.
    assert bm.can_allocate("b", 4 * BS + 2, hit, num_computed_tokens=4 * BS)
    free_before = bm.num_free_blocks
    assert bm.allocate("b", hit.num_tokens, 4 * BS + 2, hit)
    assert bm.block_table("b")[:4] == [None, None, None, hit.block_ids[3]]
    assert [bm.pool.blocks[i].ref_count for i in hit.block_ids] == [0, 0, 0, 1]
    assert free_before - bm.num_free_blocks == 2  # the revived block 3 and one new block
    bm.check_invariants()
    # The chain of keys goes on past the placeholders: the next full block is published.
    _compute(bm, "b", tokens + [5, 6, 7, 8], 4 * BS + 2, 5 * BS)
    assert bm.find_prefix_hit(tokens + [5, 6, 7, 8, 9]).num_tokens == 5 * BS


def test_hit_blocks_out_of_the_window_cost_no_free_block():
    """Four free blocks, four cached: a hit that revives only its last block fits with one new block."""
    bm = _manager(BS + 1, num_blocks=4)
    tokens = list(range(100, 100 + 4 * BS))
    _compute(bm, "a", tokens, 0, len(tokens))
    bm.free("a")
    hit = bm.find_prefix_hit(tokens + [5, 6])
    assert len(hit.block_ids) == 4 and bm.num_free_blocks == 4
    assert bm.can_allocate("b", 4 * BS + 2, hit, num_computed_tokens=4 * BS)
    assert bm.allocate("b", 4 * BS, 4 * BS + 2, hit)
    assert bm.num_free_blocks == 2
    bm.check_invariants()


def test_a_write_into_a_released_block_is_refused():
    bm = _manager(1)
    tokens = list(range(2 * BS))
    _compute(bm, "a", tokens, 0, 2 * BS)
    assert bm.block_table("a") == [None, None]  # w 1: the query at 8 reads only position 8
    with pytest.raises(ValueError, match="released"):
        bm.allocate("a", BS, 2 * BS + 1)
    assert bm.can_allocate("a", 2 * BS + 1)  # the default guess resumes at the table's end
    assert bm.allocate("a", 2 * BS, 2 * BS + 1)
    assert bm.num_held_blocks("a") == 1


# --- every other operation over placeholders --------------------------------------------------------


def test_fork_shares_held_blocks_and_copies_on_write():
    bm = _manager(BS, caching=False)
    tokens = list(range(3 * BS + 2))
    _compute(bm, "p", tokens, 0, len(tokens))
    table = bm.block_table("p")
    assert table[:2] == [None, None]
    bm.fork("p", "c")
    bm.check_invariants()
    assert bm.block_table("c") == table
    assert all(bm.pool.blocks[i].ref_count == 2 for i in table[2:])
    assert bm.allocate("c", len(tokens), len(tokens) + 1)  # the shared last block is copied first
    assert bm.take_copies() == [(table[3], bm.block_table("c")[3])]
    bm.free("p")
    bm.free("c")
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks


def test_trim_keeps_placeholders_and_releases_rejected_slots():
    bm = _manager(3, caching=False)
    tokens = list(range(3 * BS))
    _compute(bm, "a", tokens, 0, len(tokens))
    assert bm.allocate("a", 3 * BS, 3 * BS + 6)  # speculative slots: two more blocks
    bm.trim("a", 3 * BS + 1)
    table = bm.block_table("a")
    assert table[:2] == [None, None] and len(table) == 4 and None not in table[2:]
    bm.check_invariants()
    assert bm.num_held_blocks("a") == bm.num_blocks - bm.num_free_blocks == 2


@pytest.mark.parametrize("window", [1, BS, BS + 1])
def test_swap_copies_only_held_blocks_and_restores_placeholders(window):
    bm = _manager(window, num_blocks=12, num_host_blocks=3)
    tokens = list(range(5 * BS + 1))
    _compute(bm, "a", tokens, 0, len(tokens))
    table = bm.block_table("a")
    held = [i for i in table if i is not None]
    assert len(held) <= 3 < len(table)  # a host arena too small for the whole context still takes it
    assert bm.can_swap_out("a")
    pairs = bm.swap_out("a")
    assert [d for d, _ in pairs] == held
    bm.check_invariants()
    assert bm.num_host_free_blocks == 3 - len(held)
    bm.take_copies()
    assert bm.can_swap_in("a")
    back = bm.swap_in("a")
    new_table = bm.block_table("a")
    assert [h for h, _ in back] == [h for _, h in pairs]
    assert new_table[:table.count(None)] == [None] * table.count(None)
    assert [d for _, d in back] == new_table[table.count(None):]
    bm.check_invariants()
    bm.take_copies()
    # Publishing after the swap walks the key chain over the placeholders.
    tokens.append(3)
    _compute(bm, "a", tokens, len(tokens) - 1, len(tokens))
    bm.free("a")
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks and bm.num_host_free_blocks == 3


def test_build_metadata_reads_a_placeholder_as_block_zero():
    meta = build_metadata([1, 2], [9, 3], [[None, None, 5], [7]], BS)
    assert meta.block_tables.tolist() == [[0, 0, 5], [7, 0, 0]]
    assert meta.slot_mapping.tolist() == [5 * BS + 0, 7 * BS + 1, 7 * BS + 2]
    assert meta.positions.tolist() == [8, 1, 2]
    assert np.array_equal(build_metadata([1], [2], [[3]], BS).block_tables, [[3]])
