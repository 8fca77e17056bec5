"""The scheduler's numbers: KV occupancy, speculative-decoding counts, and the stats snapshot the
engine publishes. Reads the scheduler's queues and block manager; changes no request.
"""

from __future__ import annotations

from typing import Protocol

from vllmlite.core.block_manager import BlockManager
from vllmlite.core.chunking import ChunkingPolicy
from vllmlite.core.request import Request
from vllmlite.core.request_queue import WaitingQueue
from vllmlite.stats import KVOccupancy, SchedulerStats, SpecDecodeStats


class SchedulerState(Protocol):
    """What the stats read of a Scheduler (core/scheduler.py satisfies it)."""

    running: list[Request]
    waiting: WaitingQueue
    swapped: list[Request]
    block_manager: BlockManager
    num_preemptions: int
    spec_counts: SpecDecodeCounts
    chunking: ChunkingPolicy


def kv_occupancy(running: list[Request], block_manager: BlockManager) -> KVOccupancy:
    """Tokens held by running requests and blocks in use. Block i of a table holds
    min(block_size, computed - i * block_size) tokens (block size 16, 40 computed tokens:
    [16, 16, 8]); a block shared through the prefix cache is counted once, a placeholder (out of the
    sliding window) not at all."""
    bm, size = block_manager, block_manager.block_size
    filled: dict[int, int] = {}  # block id -> tokens held in it
    for request in running:
        for i, block_id in enumerate(bm.block_table(request.request_id)):
            num_held = min(size, request.num_computed_tokens - i * size)
            if num_held > 0 and block_id is not None:
                filled[block_id] = max(filled.get(block_id, 0), num_held)
    return KVOccupancy(sum(filled.values()), bm.num_blocks - bm.num_free_blocks, len(running))


def scheduler_stats(scheduler: SchedulerState) -> SchedulerStats:
    """A snapshot of the request queues, the device blocks and the cumulative counts."""
    bm = scheduler.block_manager
    num_free = bm.num_free_blocks
    return SchedulerStats(
        num_running=len(scheduler.running), num_waiting=len(scheduler.waiting), num_swapped=len(scheduler.swapped),
        num_kv_blocks=bm.num_blocks, num_kv_blocks_used=bm.num_blocks - num_free,
        num_kv_blocks_cached=bm.num_cached_blocks, num_kv_blocks_free=num_free,
        prefix_cache_queries=bm.prefix_queries, prefix_cache_hits=bm.prefix_hits,
        num_preemptions=scheduler.num_preemptions, spec_decode=scheduler.spec_counts.snapshot(),
        chunking=scheduler.chunking.snapshot())


class SpecDecodeCounts:
    """Speculative decoding counters: guesses scored, guesses kept, and acceptance per position."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_drafts = 0               # rounds that scored at least one guess
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * num_speculative_tokens  # [k]: rounds whose guess i was kept

    def record(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        if num_drafts == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1
        request.num_draft_tokens += num_drafts
        request.num_accepted_tokens += num_accepted

    def snapshot(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               tuple(self.accepted_per_position))
