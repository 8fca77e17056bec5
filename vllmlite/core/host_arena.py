"""HostArena: the host blocks that hold swapped-out requests' KV, by id. A host block is free, owned
by a swapped-out request, or pending: freed by a swap-in this step, reusable once the step's copies
have run (the swap-in copies read it).

Knows nothing of device blocks, requests or the prefix cache (the block manager owns those).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class HostArena:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"bad num_host_blocks {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._pending_free: list[int] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """`num_blocks` free host block ids, the longest free first; IndexError unless `can_allocate`."""
        return [self._free.popleft() for _ in range(num_blocks)]

    def free(self, block_ids: Iterable[int]) -> None:
        """Give back blocks nothing reads this step (a swapped-out request finished): free at once."""
        self._free.extend(block_ids)

    def free_after_step(self, block_ids: Iterable[int]) -> None:
        """Give back blocks a swap-in reads this step: they become free at `end_step`."""
        self._pending_free.extend(block_ids)

    def end_step(self) -> None:
        """The step's copies are done: pending blocks are free."""
        self._free.extend(self._pending_free)
        self._pending_free.clear()

    def check_invariants(self, owned: Iterable[int]) -> None:
        """Assert every host block is exactly one of free, pending or `owned` (by a swapped-out request)."""
        every = [*self._free, *self._pending_free, *owned]
        assert sorted(every) == list(range(self.num_blocks)), "host arena accounting broken"
