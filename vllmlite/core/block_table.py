"""The block manager's per-request records: a request's block table (with its sliding-window
placeholders), a prefix hit, and the plan of one allocation. Data and their own invariants only;
the pool, the host arena and every change of reference count stay in `block_manager.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from vllmlite.core.block import Block


class PrefixHit(NamedTuple):
    """Cached blocks covering a prompt's first `num_tokens` tokens.

    Valid only until the next `allocate`/`swap_in` of any request (those may evict the blocks), so
    find it right before allocating. `allocate` raises on a hit whose blocks were evicted.
    """

    block_ids: list[int]
    num_tokens: int  # len(block_ids) * block_size


@dataclass
class RequestBlocks:
    """What the block manager remembers about one request."""

    # Device block table; empty while swapped out. Its first num_skipped_blocks entries are None:
    # released out of the sliding window (the placeholder contract is in sliding_window.py).
    block_ids: list[int | None] = field(default_factory=list)
    num_published_blocks: int = 0  # table[:num_published_blocks] already offered to the prefix cache
    last_key: bytes | None = None  # key of table[num_published_blocks - 1]: the next block's parent
    host_block_ids: list[int] | None = None  # set exactly while swapped out: one per entry not skipped
    num_skipped_blocks: int = 0  # leading placeholders, kept while swapped out

    @property
    def is_swapped_out(self) -> bool:
        return self.host_block_ids is not None

    @property
    def held_block_ids(self) -> list[int]:
        """The device table without its placeholders: the blocks this request references."""
        return self.block_ids[self.num_skipped_blocks:]  # type: ignore[return-value]

    @property
    def num_held_blocks(self) -> int:
        """Blocks it references, on the device or (swapped out) in the host arena."""
        return len(self.host_block_ids if self.host_block_ids is not None else self.held_block_ids)

    def skip_blocks(self, num_skipped: int) -> list[int]:
        """Make the first `num_skipped` entries placeholders; returns the block ids they held (for
        the caller to release), [] if they already were."""
        released = self.held_block_ids[:max(0, num_skipped - self.num_skipped_blocks)]
        self.block_ids[self.num_skipped_blocks:self.num_skipped_blocks + len(released)] = [None] * len(released)
        self.num_skipped_blocks += len(released)
        return released

    def check(self, request_id: str, has_window: bool) -> None:
        """Assert the table's own invariants: held blocks distinct, placeholders exactly the first
        num_skipped_blocks entries (and only under a window), nothing on the device while swapped."""
        num_skipped, held = self.num_skipped_blocks, self.held_block_ids
        assert len(set(held)) == len(held), f"{request_id}: duplicate block"
        assert 0 <= self.num_published_blocks <= len(self.block_ids), f"{request_id}: published"
        assert not (self.is_swapped_out and self.block_ids), f"{request_id}: swapped with blocks"
        assert self.is_swapped_out or num_skipped <= len(self.block_ids), f"{request_id}: skipped"
        assert all(i is None for i in self.block_ids[:num_skipped]), f"{request_id}: skipped block held"
        assert None not in held, f"{request_id}: placeholder after a held block"
        assert num_skipped == 0 or has_window, f"{request_id}: skipped without a window"


class AllocationPlan(NamedTuple):
    """What `allocate` would do; computed without changing anything, so failure changes nothing."""

    hit_blocks: Sequence[Block]  # prefix-hit blocks (first allocation only)
    num_skipped_hit_blocks: int  # of those, the first ones already out of the window: not referenced
    cow_indices: list[int]  # table indices written this step that must be copied first
    num_new_blocks: int  # blocks appended to the table

    @property
    def referenced_hit_blocks(self) -> Sequence[Block]:
        return self.hit_blocks[self.num_skipped_hit_blocks:]

    @property
    def num_free_blocks_needed(self) -> int:
        # Hit blocks sitting in the free list stop being free once referenced (a grown request has none).
        num_revived = sum(block.ref_count == 0 for block in self.referenced_hit_blocks) if self.hit_blocks else 0
        return self.num_new_blocks + len(self.cow_indices) + num_revived
