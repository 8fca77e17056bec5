"""Block manager: block tables, prefix hits, copy-on-write, all-or-nothing allocation and swap."""

import pytest

import vllmlite.core.block_manager as block_manager_module
from vllmlite.core.block_manager import BlockManager, PrefixHit

BS = 4  # block size used throughout


def _manager(num_blocks: int = 16, num_host_blocks: int = 0, caching: bool = True) -> BlockManager:
    return BlockManager(num_blocks, BS, enable_prefix_caching=caching, num_host_blocks=num_host_blocks)


def _prefill(bm: BlockManager, request_id: str, tokens: list[int], extra_keys: tuple = ()) -> PrefixHit:
    """Admit a request, compute its whole prompt in one step, publish. Returns the hit it got."""
    hit = bm.find_prefix_hit(tokens, extra_keys)
    assert bm.allocate(request_id, hit.num_tokens, len(tokens), hit)
    bm.record_prefix_lookup(len(tokens), hit)
    bm.publish_full_blocks(request_id, tokens, len(tokens), extra_keys)
    bm.check_invariants()
    return hit


def _snapshot(bm: BlockManager) -> tuple:
    tables = {rid: (list(s.block_ids), s.num_published_blocks, s.last_key) for rid, s in bm._requests.items()}
    free_ids = [b.block_id for b in bm.pool.free_queue]
    refs = [b.ref_count for b in bm.pool.blocks]
    return tables, refs, free_ids, dict(bm.pool.cached_blocks), list(bm._copies), bm.num_host_free_blocks


@pytest.mark.parametrize("num_tokens", [1, BS - 1, BS, BS + 1, 2 * BS, 2 * BS + 1])
def test_prefix_hit_never_covers_the_last_token(num_tokens):
    bm = _manager()
    tokens = list(range(100, 100 + num_tokens))
    assert _prefill(bm, "a", tokens) == PrefixHit([], 0)
    hit = bm.find_prefix_hit(tokens)
    assert hit.num_tokens == (num_tokens - 1) // BS * BS
    assert hit.num_tokens < num_tokens
    assert hit.block_ids == bm.block_table("a")[: len(hit.block_ids)]
    # The same prompt with one more token hits every full block the first request published.
    longer = bm.find_prefix_hit(tokens + [7])
    assert longer.num_tokens == num_tokens // BS * BS


def test_publish_on_fill_lets_a_second_request_hit_while_the_first_still_runs():
    bm = _manager()
    prompt = list(range(2 * BS + 1))
    assert bm.allocate("a", 0, BS, bm.find_prefix_hit(prompt))  # first chunk: one block
    bm.publish_full_blocks("a", prompt, BS)
    hit = bm.find_prefix_hit(prompt)
    assert hit == PrefixHit([bm.block_table("a")[0]], BS)
    assert bm.allocate("b", hit.num_tokens, len(prompt), hit)
    assert bm.block_table("b")[0] == bm.block_table("a")[0]
    assert bm.pool.blocks[hit.block_ids[0]].ref_count == 2
    assert bm.allocate("a", BS, len(prompt))  # "a" goes on with its own blocks
    assert bm.take_copies() == []  # nobody writes the shared full block
    bm.check_invariants()


def test_hit_is_confirmed_by_token_ids_under_a_forced_key_collision(monkeypatch):
    monkeypatch.setattr(block_manager_module, "block_key", lambda parent, tokens, extra=(): b"same")
    bm = _manager()
    _prefill(bm, "a", [1, 2, 3, 4, 9])
    assert bm.find_prefix_hit([5, 6, 7, 8, 9]) == PrefixHit([], 0)  # same key, other tokens
    assert bm.find_prefix_hit([1, 2, 3, 4, 7]).num_tokens == BS  # same key, same tokens


def test_cache_salt_separates_otherwise_equal_prefixes():
    bm = _manager()
    prompt = list(range(2 * BS + 1))
    _prefill(bm, "a", prompt, ("salt-a",))
    assert bm.find_prefix_hit(prompt, ("salt-b",)).num_tokens == 0
    assert bm.find_prefix_hit(prompt).num_tokens == 0
    assert bm.find_prefix_hit(prompt, ("salt-a",)).num_tokens == 2 * BS


def test_failed_allocation_changes_nothing_and_counts_free_hit_blocks_as_taken():
    bm = _manager(num_blocks=4)
    prompt = list(range(2 * BS + 1))  # blocks 0, 1 full and published, block 2 partial
    _prefill(bm, "a", prompt)
    bm.free("a")
    assert bm.num_free_blocks == 4 and bm.pool.num_cached_blocks == 2
    longer = prompt[: 2 * BS] + list(range(50, 50 + 2 * BS + 1))  # 5 blocks, 2 of them hit
    hit = bm.find_prefix_hit(longer)
    assert hit.num_tokens == 2 * BS
    # 3 new blocks fit in 4 free ones only if the 2 free hit blocks were not counted as taken.
    assert not bm.can_allocate("b", len(longer), hit)
    before = _snapshot(bm)
    assert not bm.allocate("b", hit.num_tokens, len(longer), hit)
    assert _snapshot(bm) == before
    assert bm.block_table("b") == []
    assert bm.allocate("b", hit.num_tokens, len(longer) - 1, hit)  # exactly 4 blocks fit
    assert bm.block_table("b")[:2] == hit.block_ids
    bm.check_invariants()


def test_failed_growth_with_copy_on_write_changes_nothing():
    bm = _manager(num_blocks=3)
    _prefill(bm, "a", [1, 2, 3, 4, 5])  # 2 blocks; the second is partial
    bm.fork("a", "c")
    assert bm.num_free_blocks == 1
    # "c" writes its partial block (a copy) and needs one more block: 2 free blocks needed.
    before = _snapshot(bm)
    assert not bm.can_allocate("c", 2 * BS + 1, num_computed_tokens=5)
    assert not bm.allocate("c", 5, 2 * BS + 1)
    assert _snapshot(bm) == before
    assert bm.allocate("c", 5, 2 * BS)  # the copy alone fits
    assert len(bm.take_copies()) == 1
    bm.check_invariants()


def test_cached_blocks_are_evicted_only_when_plain_free_blocks_run_out():
    bm = _manager(num_blocks=6)
    prompt = list(range(2 * BS))
    _prefill(bm, "a", prompt)
    bm.free("a")  # released tail first: block 1 is the least recently freed
    probe = prompt + [99]
    assert bm.allocate("b", 0, 4 * BS)  # takes the 4 never-cached blocks
    assert bm.find_prefix_hit(probe).num_tokens == 2 * BS
    assert bm.allocate("c", 0, 1)  # evicts the prompt's tail block first
    assert bm.find_prefix_hit(probe).num_tokens == BS
    assert bm.allocate("d", 0, 1)
    assert bm.find_prefix_hit(probe).num_tokens == 0
    assert bm.num_free_blocks == 0
    bm.check_invariants()


def test_fork_then_write_to_shared_partial_block_copies_it_exactly_once():
    bm = _manager()
    _prefill(bm, "a", [1, 2, 3, 4, 5, 6])  # block 0 full and published, block 1 partial
    parent_table = bm.block_table("a")
    bm.fork("a", "c")
    assert bm.block_table("c") == parent_table
    assert bm.allocate("c", 6, 7)  # the child writes position 6, in the shared block 1
    child_table = bm.block_table("c")
    assert child_table[0] == parent_table[0]  # the full block stays shared
    assert child_table[1] != parent_table[1]
    assert bm.allocate("a", 6, 7)  # the parent now holds block 1 alone: written in place
    assert bm.block_table("a") == parent_table
    assert bm.take_copies() == [(parent_table[1], child_table[1])]
    assert bm.take_copies() == []
    assert bm.pool.blocks[parent_table[1]].ref_count == 1
    bm.check_invariants()


def test_swap_out_and_in_round_trip_restores_table_and_frees_device_blocks():
    bm = _manager(num_blocks=8, num_host_blocks=4)
    _prefill(bm, "a", list(range(2 * BS + 2)))  # 3 blocks
    device_table = bm.block_table("a")
    assert bm.can_swap_out("a")
    out_pairs = bm.swap_out("a")
    assert [d for d, _ in out_pairs] == device_table
    assert bm.num_free_blocks == 8 and bm.num_host_free_blocks == 1
    assert bm.block_table("a") == [] and bm.is_swapped_out("a")
    with pytest.raises(ValueError):
        bm.allocate("a", 2 * BS + 2, 2 * BS + 3)
    bm.check_invariants()
    bm.take_copies()
    in_pairs = bm.swap_in("a")
    assert [h for h, _ in in_pairs] == [h for _, h in out_pairs]
    assert [d for _, d in in_pairs] == bm.block_table("a")
    assert len(bm.block_table("a")) == 3 and bm.num_free_blocks == 5
    assert not bm.is_swapped_out("a")
    bm.take_copies()
    assert bm.num_host_free_blocks == 4
    bm.check_invariants()


def test_copy_source_losing_its_last_reference_is_held_until_take_copies():
    bm = _manager(num_blocks=4)
    _prefill(bm, "a", [1, 2, 3, 4, 5, 6])
    bm.fork("a", "c")
    assert bm.allocate("c", 6, 7)
    source = bm.block_table("a")[1]
    bm.free("a")  # drops the source's last table reference while its copy is still queued
    assert source not in [block.block_id for block in bm.pool.free_queue]
    assert bm.num_free_blocks == 1
    bm.check_invariants()
    assert bm.take_copies() == [(source, bm.block_table("c")[1])]
    assert bm.num_free_blocks == 2 and bm.pool.blocks[source].ref_count == 0
    bm.check_invariants()


@pytest.mark.parametrize("free_parent_first", [False, True])
def test_swap_out_in_the_step_of_a_copy_reads_the_copy_source(free_parent_first):
    bm = _manager(num_host_blocks=4)
    _prefill(bm, "a", [1, 2, 3, 4, 5, 6])
    bm.fork("a", "c")
    assert bm.allocate("c", 6, 7)  # queues a copy of the shared partial block
    shared, fresh = bm.block_table("a")[1], bm.block_table("c")[1]
    if free_parent_first:
        bm.free("a")  # `shared` is now held only for the queued copy
        bm.check_invariants()
    pairs = bm.swap_out("c")  # swap-out copies run before this step's copy: `fresh` is still empty
    assert pairs[1][0] == shared and fresh not in [d for d, _ in pairs]
    bm.check_invariants()
    assert bm.take_copies() == []  # the copy into the released block is dropped
    assert bm.pool.blocks[shared].ref_count == (0 if free_parent_first else 1)
    bm.check_invariants()


def test_published_block_is_copied_rather_than_overwritten():
    bm = _manager()
    prompt = list(range(2 * BS))
    _prefill(bm, "a", prompt)
    published = bm.block_table("a")[1]
    assert bm.allocate("a", BS + 1, 2 * BS)  # recompute positions BS+1.. of a published block
    assert bm.block_table("a")[1] != published
    assert bm.take_copies() == [(published, bm.block_table("a")[1])]
    assert bm.find_prefix_hit(prompt + [0]).block_ids[1] == published
    bm.check_invariants()


def test_host_blocks_freed_by_swap_in_are_not_reused_in_the_same_step():
    bm = _manager(num_blocks=8, num_host_blocks=2)
    _prefill(bm, "a", [1, 2, 3, 4, 5])
    _prefill(bm, "b", [6, 7, 8, 9, 10])
    bm.swap_out("a")
    bm.take_copies()
    assert not bm.can_swap_out("b")  # host arena full
    bm.swap_in("a")
    assert not bm.can_swap_out("b")  # "a"'s host blocks are read by this step's swap-in copies
    bm.take_copies()
    assert bm.can_swap_out("b")
    bm.check_invariants()


def test_free_releases_everything_and_leaves_blocks_free_or_cached():
    bm = _manager(num_blocks=12, num_host_blocks=4)
    prompt = list(range(2 * BS + 1))
    _prefill(bm, "a", prompt)
    _prefill(bm, "b", prompt + [1, 2])
    bm.fork("b", "b2")
    assert bm.allocate("b2", len(prompt) + 2, len(prompt) + 3)
    assert len(bm.take_copies()) == 1
    _prefill(bm, "c", [9] * 5)
    assert bm.usage == pytest.approx(7 / 12)  # a: 3; b: 1 more (2 hit a's); b2: its copy; c: 2
    bm.swap_out("c")
    for request_id in ["a", "b", "b2", "c"]:
        bm.free(request_id)
        bm.check_invariants()
    bm.free("never-seen")  # no-op
    assert bm.num_free_blocks == 12 and bm.usage == 0.0
    assert all(block.ref_count == 0 for block in bm.pool.blocks)
    assert bm.num_host_free_blocks == 4
    assert bm.pool.num_cached_blocks == 3  # the shared prompt's 2 full blocks and "c"'s one


def test_prefix_caching_off_never_hits_or_publishes():
    bm = _manager(caching=False)
    prompt = list(range(3 * BS))
    _prefill(bm, "a", prompt)
    assert bm.find_prefix_hit(prompt + [1]) == PrefixHit([], 0)
    assert bm.pool.num_cached_blocks == 0
    assert (bm.prefix_queries, bm.prefix_hits) == (0, 0)


def test_prefix_metrics_count_tokens_queried_and_hit():
    bm = _manager()
    prompt = list(range(2 * BS + 1))
    _prefill(bm, "a", prompt)
    hit = bm.find_prefix_hit(prompt)
    assert (bm.prefix_queries, bm.prefix_hits) == (len(prompt), 0)  # a lookup counts once recorded
    bm.record_prefix_lookup(len(prompt), hit)
    assert (bm.prefix_queries, bm.prefix_hits) == (2 * len(prompt), 2 * BS)


def test_allocate_rejects_inconsistent_counts_and_stale_hits():
    bm = _manager(num_blocks=3)
    prompt = list(range(BS + 1))
    _prefill(bm, "a", prompt)
    bm.free("a")
    hit = bm.find_prefix_hit(prompt)
    assert hit.num_tokens == BS
    with pytest.raises(ValueError):
        bm.allocate("b", 0, len(prompt), hit)  # computed tokens must include the hit
    with pytest.raises(ValueError):
        bm.allocate("b", 5, 3)
    assert bm.allocate("x", 0, 3 * BS)  # evicts the hit's block
    bm.free("x")
    with pytest.raises(ValueError):
        bm.allocate("b", hit.num_tokens, len(prompt), hit)
    bm.check_invariants()
