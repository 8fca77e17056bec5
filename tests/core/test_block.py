"""Block pool: the free LRU, refcounts, and the prefix-cache map."""

import pytest

from vllmlite.core.block import Block, BlockPool, FreeBlockQueue, block_key


def _published_pool(num_blocks: int) -> BlockPool:
    """A pool whose every block is referenced once and published under a distinct key."""
    pool = BlockPool(num_blocks)
    for _ in range(num_blocks):
        block = pool.allocate()
        tokens = (block.block_id,)
        assert pool.publish(block, block_key(None, tokens), tokens)
    return pool


def _free_ids(pool: BlockPool) -> list[int]:
    return [block.block_id for block in pool.free_queue]


def test_block_key_chains_parent_tokens_and_extra_keys():
    k0 = block_key(None, [1, 2, 3, 4])
    assert k0 == block_key(None, (1, 2, 3, 4))  # stable: same inputs, same key
    assert len(k0) == 32
    assert block_key(k0, [1, 2, 3, 4]) != k0  # the parent is part of the key
    assert block_key(None, [1, 2, 3, 5]) != k0
    assert block_key(None, [1, 2, 3, 4], ("salt",)) != k0
    assert block_key(None, [1, 2, 3, 4], ("salt",)) != block_key(None, [1, 2, 3, 4], ("other",))
    # Length-prefixed fields: moving a token across the field boundary changes the key.
    assert block_key(None, [12]) != block_key(None, [1, 2])


def test_free_queue_remove_from_middle_keeps_order_and_links():
    blocks = [Block(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    queue.remove(blocks[0])
    queue.remove(blocks[4])
    assert [b.block_id for b in queue] == [1, 3]
    assert len(queue) == 2
    assert queue.head is blocks[1] and queue.tail is blocks[3]
    assert blocks[1].next is blocks[3] and blocks[3].prev is blocks[1]
    queue.appendleft(blocks[0])
    queue.append(blocks[4])
    assert [queue.popleft().block_id for _ in range(4)] == [0, 1, 3, 4]
    with pytest.raises(IndexError):
        queue.popleft()


def test_eviction_follows_order_of_release():
    pool = _published_pool(4)
    for block_id in [2, 0, 3, 1]:
        pool.release(pool.blocks[block_id])
    assert pool.num_cached_blocks == 4 and pool.num_free_blocks == 4
    evicted = []
    for expected_cached in [3, 2, 1, 0]:
        evicted.append(pool.allocate().block_id)
        assert pool.num_cached_blocks == expected_cached
        pool.check_invariants()
    assert evicted == [2, 0, 3, 1]
    assert all(pool.blocks[i].block_key is None for i in evicted)


def test_uncached_free_blocks_are_reused_before_cached_ones():
    pool = BlockPool(4)
    cached, plain = pool.allocate(), pool.allocate()
    pool.publish(cached, block_key(None, [7]), [7])
    pool.release(cached)
    pool.release(plain)
    assert _free_ids(pool) == [plain.block_id, 2, 3, cached.block_id]
    assert [pool.allocate().block_id for _ in range(3)] == [plain.block_id, 2, 3]
    assert pool.num_cached_blocks == 1  # evicted only now that nothing else is free
    assert pool.allocate() is cached
    assert pool.num_cached_blocks == 0
    pool.check_invariants()


def test_touch_takes_cached_block_from_middle_of_free_list_without_walking_it(monkeypatch):
    pool = _published_pool(5)
    for block in pool.blocks:
        pool.release(block)
    hit = pool.blocks[2]

    def no_walk(self):
        raise AssertionError("touch must unlink in O(1), not walk the free list")

    monkeypatch.setattr(FreeBlockQueue, "__iter__", no_walk)
    pool.touch(hit)
    monkeypatch.undo()
    assert hit.ref_count == 1 and pool.num_free_blocks == 4
    assert _free_ids(pool) == [0, 1, 3, 4]
    pool.check_invariants()
    assert {pool.allocate().block_id for _ in range(4)} == {0, 1, 3, 4}
    with pytest.raises(RuntimeError):
        pool.allocate()
    assert pool.lookup(hit.block_key, (2,)) is hit  # never evicted: it was referenced


def test_lookup_confirms_token_ids():
    pool = BlockPool(2)
    block = pool.allocate()
    key = block_key(None, [1, 2])
    pool.publish(block, key, [1, 2])
    assert pool.lookup(key, [1, 2]) is block
    assert pool.lookup(key, [1, 3]) is None  # same key, other tokens: a collision, not a hit
    assert pool.lookup(block_key(None, [1, 3]), [1, 3]) is None


def test_publish_of_duplicate_key_keeps_the_existing_block():
    pool = BlockPool(3)
    first, second = pool.allocate(), pool.allocate()
    key = block_key(None, [5])
    assert pool.publish(first, key, [5])
    assert not pool.publish(second, key, [5])
    assert second.block_key is None and pool.lookup(key, [5]) is first
    pool.release(second)
    assert pool.free_queue.head is second  # unpublished, so it is reused first
    pool.check_invariants()


def test_released_block_keeps_its_key_and_can_still_be_hit():
    pool = BlockPool(2)
    block = pool.allocate()
    key = block_key(None, [9])
    pool.publish(block, key, [9])
    pool.release(block)
    assert block.ref_count == 0 and pool.lookup(key, [9]) is block
    pool.touch(block)
    assert block.ref_count == 1 and pool.num_free_blocks == 1
    pool.check_invariants()


def test_refcount_never_goes_negative_and_empty_pool_refuses_allocation():
    pool = BlockPool(1)
    block = pool.allocate()
    with pytest.raises(RuntimeError):
        pool.allocate()
    pool.release(block)
    with pytest.raises(ValueError):
        pool.release(block)
    with pytest.raises(ValueError):
        pool.publish(block, b"k", [1])  # only a referenced block can be published


def test_reset_prefix_cache_unpublishes_all_and_reuses_uncached_first():
    pool = _published_pool(3)
    pool.release(pool.blocks[0])
    pool.release(pool.blocks[1])
    assert pool.reset_prefix_cache() == 3
    assert pool.num_cached_blocks == 0
    assert all(block.block_key is None for block in pool.blocks)
    pool.check_invariants()
    pool.release(pool.blocks[2])
    assert pool.free_queue.head is pool.blocks[2]
    pool.check_invariants()


def test_check_invariants_catches_broken_accounting():
    pool = BlockPool(3)
    block = pool.allocate()
    block.ref_count = 0  # referenced nowhere, yet not in the free list
    with pytest.raises(AssertionError):
        pool.check_invariants()
    pool = BlockPool(3)
    pool.blocks[1].block_key = b"stray"  # a key with no map entry
    pool.blocks[1].token_ids = (1,)
    with pytest.raises(AssertionError):
        pool.check_invariants()
