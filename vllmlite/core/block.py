"""The block pool: owns block ids, reference counts, the free list (an LRU) and the prefix-cache map.

It knows nothing of requests or block tables; `block_manager.py` builds those on top of it.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass


def block_key(
    parent_key: bytes | None, token_ids: Sequence[int], extra_keys: tuple = ()
) -> bytes:
    """Return the prefix-cache key of one full block: SHA-256 over (parent key, token ids, extra keys).

    Chaining the parent key makes the key name the whole prefix, not just this block's tokens.
    Worked example, block_size 4, prompt [1 2 3 4 | 5 6 7 8 | 9]:
        k0 = block_key(None, [1, 2, 3, 4])
        k1 = block_key(k0,   [5, 6, 7, 8])    # the partial block [9] gets no key
    A prompt [1 2 3 4 | 5 6 7 0 | ...] shares k0 but not k1, so it hits one block. Extra keys (a cache
    salt string, say) are hashed into every block, so equal prompts with different salts never share.
    The encoding is stable across processes (no Python `hash()`): each field is length-prefixed.
    """
    hasher = hashlib.sha256()
    if parent_key is None:
        hasher.update(b"\x00")
    else:
        hasher.update(b"\x01" + struct.pack("<I", len(parent_key)) + parent_key)
    hasher.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    extra = repr(tuple(extra_keys)).encode("utf-8")
    hasher.update(struct.pack("<I", len(extra)) + extra)
    return hasher.digest()


@dataclass(eq=False)
class Block:
    """One KV-cache block. Identity equality: two Block objects are the same block only if `is`.

    `block_key`/`token_ids` are set together when the block is published to the prefix cache and
    cleared together when it is evicted; `prev`/`next` are meaningful only while it is in the free list.
    """

    block_id: int
    ref_count: int = 0
    block_key: bytes | None = None
    token_ids: tuple[int, ...] | None = None
    prev: Block | None = None
    next: Block | None = None

    @property
    def is_cached(self) -> bool:
        return self.block_key is not None


class FreeBlockQueue:
    """Doubly linked list of free blocks: O(1) popleft, append, appendleft and remove-from-middle.

    The links live in the blocks themselves (`prev`/`next`), so removing a block needs no search.
    A block in the queue has `prev is None` only if it is the head, `next is None` only if the tail.
    """

    def __init__(self, blocks: Sequence[Block] = ()) -> None:
        self.head: Block | None = None
        self.tail: Block | None = None
        self._num_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._num_blocks

    def __iter__(self) -> Iterator[Block]:
        block = self.head
        while block is not None:
            yield block
            block = block.next

    def popleft(self) -> Block:
        """Remove and return the head (the block to reuse first). Raises IndexError when empty."""
        if self.head is None:
            raise IndexError("popleft from an empty FreeBlockQueue")
        block = self.head
        self.remove(block)
        return block

    def append(self, block: Block) -> None:
        """Put `block` at the tail (reused last)."""
        block.prev, block.next = self.tail, None
        if self.tail is None:
            self.head = block
        else:
            self.tail.next = block
        self.tail = block
        self._num_blocks += 1

    def appendleft(self, block: Block) -> None:
        """Put `block` at the head (reused first)."""
        block.prev, block.next = None, self.head
        if self.head is None:
            self.tail = block
        else:
            self.head.prev = block
        self.head = block
        self._num_blocks += 1

    def remove(self, block: Block) -> None:
        """Unlink `block`, which must be in this queue, in O(1)."""
        if block.prev is None:
            assert self.head is block, f"block {block.block_id} is not in the free queue"
            self.head = block.next
        else:
            block.prev.next = block.next
        if block.next is None:
            assert self.tail is block, f"block {block.block_id} is not in the free queue"
            self.tail = block.prev
        else:
            block.next.prev = block.prev
        block.prev = block.next = None
        self._num_blocks -= 1


class BlockPool:
    """All device blocks, their refcounts, the free list and the prefix-cache map (key -> block).

    Invariants (see `check_invariants`):
      - a block is in the free list exactly when its ref_count is 0; ref_count never goes negative;
      - the free list holds uncached blocks first, then cached blocks from least to most recently
        freed, so allocation reuses a plain free block before it evicts any cached one;
      - every map entry points at a block whose block_key is that key; a block with a key is mapped.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[bytes, Block] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_count 0, cached (evictable) or not."""
        return len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks published in the prefix-cache map, referenced or not."""
        return len(self.cached_blocks)

    def block_states(self) -> bytes:
        """Per block id: 0 free, 1 used, 2 cached and free (evictable), 3 cached and used.

        >>> pool = BlockPool(3); pool.allocate().block_id, pool.block_states()
        (0, b'\\x01\\x00\\x00')
        """
        return bytes((b.ref_count > 0) + 2 * (b.block_key is not None) for b in self.blocks)

    def allocate(self) -> Block:
        """Take the free list's head, evicting it from the prefix cache if it was published.

        Returns a block with ref_count 1 and no key. Raises RuntimeError if no block is free: callers
        check `num_free_blocks` first.
        """
        if not self.free_queue:
            raise RuntimeError("no free KV-cache blocks")
        block = self.free_queue.popleft()
        if block.block_key is not None:
            del self.cached_blocks[block.block_key]
            block.block_key = block.token_ids = None
        block.ref_count = 1
        return block

    def touch(self, block: Block) -> None:
        """Take one more reference on `block` (a prefix hit or a fork); revives it from the free list."""
        if block.ref_count == 0:
            self.free_queue.remove(block)
        block.ref_count += 1

    def release(self, block: Block) -> None:
        """Drop one reference. At 0 a cached block goes to the free tail, keeping its key so it can
        still be hit; an uncached block goes to the head, since nothing is lost by reusing it first."""
        if block.ref_count <= 0:
            raise ValueError(f"release of block {block.block_id} with ref_count {block.ref_count}")
        block.ref_count -= 1
        if block.ref_count > 0:
            return
        if block.block_key is None:
            self.free_queue.appendleft(block)
        else:
            self.free_queue.append(block)

    def publish(self, block: Block, key: bytes, token_ids: Sequence[int]) -> bool:
        """Record a full, referenced block under `key`. Returns True if `block` is now published.

        If `key` already maps to another block (two requests computed the same prefix), the existing
        block stays the cached copy and `block` remains unpublished: it is freed as a plain block.
        """
        if block.ref_count <= 0:
            raise ValueError(f"publish of unreferenced block {block.block_id}")
        if block.block_key is not None:
            return block.block_key == key
        if key in self.cached_blocks:
            return False
        block.block_key, block.token_ids = key, tuple(token_ids)
        self.cached_blocks[key] = block
        return True

    def lookup(self, key: bytes, token_ids: Sequence[int]) -> Block | None:
        """The published block for `key` if its tokens equal `token_ids`, else None.

        Comparing tokens makes a hash collision a miss, never a hit on the wrong KV.
        """
        block = self.cached_blocks.get(key)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def reset_prefix_cache(self) -> int:
        """Unpublish every block (referenced ones keep their KV but can no longer be hit).

        Returns the number of map entries dropped. O(num_blocks): the free list is rebuilt so the
        now-uncached free blocks keep the uncached-first order.
        """
        num_dropped = len(self.cached_blocks)
        for block in self.cached_blocks.values():
            block.block_key = block.token_ids = None
        self.cached_blocks.clear()
        free_blocks = list(self.free_queue)
        self.free_queue = FreeBlockQueue(free_blocks)
        return num_dropped

    def check_invariants(self) -> None:
        """Assert the accounting adds up (see the class docstring). O(num_blocks)."""
        free_ids = self._check_free_queue_links()
        assert len(free_ids) == len(self.free_queue), "free list length disagrees with its count"
        num_used = 0
        for block in self.blocks:
            assert block.ref_count >= 0, f"block {block.block_id} has ref_count {block.ref_count}"
            is_free = block.block_id in free_ids
            assert is_free == (block.ref_count == 0), (
                f"block {block.block_id}: ref_count {block.ref_count} but in free list: {is_free}"
            )
            num_used += block.ref_count > 0
            assert (block.block_key is None) == (block.token_ids is None)
            if block.block_key is not None:
                assert self.cached_blocks.get(block.block_key) is block, (
                    f"block {block.block_id} has a key but is not the block mapped under it"
                )
        assert num_used + len(self.free_queue) == self.num_blocks, "free + used != total"
        for key, block in self.cached_blocks.items():
            assert block.block_key == key, f"map entry points at block {block.block_id} with another key"

    def _check_free_queue_links(self) -> set[int]:
        """Walk the free list both ways; check links, uniqueness and uncached-before-cached order."""
        forward: list[int] = []
        seen_cached = False
        prev: Block | None = None
        for block in self.free_queue:
            assert block.prev is prev, f"free list prev link broken at block {block.block_id}"
            assert len(forward) < self.num_blocks, "free list longer than the pool (a cycle)"
            if block.is_cached:
                seen_cached = True
            assert block.is_cached or not seen_cached, (
                f"uncached block {block.block_id} sits behind a cached block in the free list"
            )
            forward.append(block.block_id)
            prev = block
        assert self.free_queue.tail is prev, "free list tail does not end the forward walk"
        free_ids = set(forward)
        assert len(free_ids) == len(forward), "a block appears twice in the free list"
        return free_ids
