"""A seeded random walk over the block manager (allocate, grow, publish, fork, free, swap) that
keeps a shadow copy of KV memory: invariants after every operation, every computed token in its slot
(with a sliding window: every one a future query can read; the blocks before it released)."""

import random
from dataclasses import dataclass, field

import pytest

from vllmlite.core.block_manager import BlockManager

BS = 4  # block size used throughout


@dataclass
class _StepLog:
    """What one simulated step did, for the simulated runner to apply."""

    touched: set[str] = field(default_factory=set)  # requests already operated on this step
    swap_out_pairs: list[tuple[int, int]] = field(default_factory=list)
    swap_in_pairs: list[tuple[int, int]] = field(default_factory=list)
    writes: list[tuple[str, int]] = field(default_factory=list)  # (request_id, num_tokens) scheduled


class _Sim:
    """Drives a BlockManager like a scheduler and runner would, over a shadow KV memory: after each
    step every computed token of every resident request must sit at its slot."""

    def __init__(self, rng: random.Random, num_blocks: int, num_host_blocks: int, window: int | None = None) -> None:
        self.rng = rng
        self.window = window
        self.bm = BlockManager(num_blocks, BS, enable_prefix_caching=True, num_host_blocks=num_host_blocks,
                               sliding_window=window)
        self.device = [[None] * BS for _ in range(num_blocks)]  # [num_blocks][BS] token at each slot
        self.host = [[None] * BS for _ in range(num_host_blocks)]
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.prompts = [[rng.randrange(50) for _ in range(3 * BS)] for _ in range(3)]
        self.num_created = 0

    def step(self) -> None:
        """A few operations on distinct requests, then the copies and writes, then the checks."""
        log = _StepLog()
        for _ in range(self.rng.randint(1, 4)):
            op = self.rng.choice(["new", "new", "grow", "grow", "grow", "fork", "free", "swap", "swap"])
            getattr(self, f"_{op}")(log)
            self.bm.check_invariants()
        self._run_copies_and_writes(log)
        if self.rng.random() < 0.02:
            self.bm.reset_prefix_cache()
        self.bm.check_invariants()
        self._check_kv_contents()

    def _untouched(self, log: _StepLog, swapped: bool) -> list[str]:
        return [r for r in self.tokens if r not in log.touched and self.bm.is_swapped_out(r) == swapped]

    def _new(self, log: _StepLog) -> None:
        request_id = f"r{self.num_created}"
        self.num_created += 1
        prompt = self.rng.choice(self.prompts)[: self.rng.randint(1, 3 * BS)]
        prompt = prompt + [self.rng.randrange(50) for _ in range(self.rng.randint(0, 5))]
        hit = self.bm.find_prefix_hit(prompt)
        num_tokens = self.rng.randint(hit.num_tokens + 1, len(prompt))  # chunked prefill
        expected = self.bm.can_allocate(request_id, num_tokens, hit, num_computed_tokens=hit.num_tokens)
        assert self.bm.allocate(request_id, hit.num_tokens, num_tokens, hit) == expected
        if expected:
            self.bm.record_prefix_lookup(len(prompt), hit)
            self.tokens[request_id], self.computed[request_id] = prompt, hit.num_tokens
            log.writes.append((request_id, num_tokens))
            log.touched.add(request_id)

    def _grow(self, log: _StepLog) -> None:
        candidates = self._untouched(log, swapped=False)
        if not candidates:
            return
        request_id = self.rng.choice(candidates)
        log.touched.add(request_id)
        tokens, computed = self.tokens[request_id], self.computed[request_id]
        if computed == len(tokens):
            tokens.append(self.rng.randrange(50))  # the token sampled last step
        num_tokens = self.rng.randint(computed + 1, len(tokens))
        expected = self.bm.can_allocate(request_id, num_tokens, num_computed_tokens=computed)
        assert self.bm.allocate(request_id, computed, num_tokens) == expected
        if expected:
            log.writes.append((request_id, num_tokens))

    def _fork(self, log: _StepLog) -> None:
        candidates = self._untouched(log, swapped=False)
        if candidates:
            parent = self.rng.choice(candidates)
            child = f"r{self.num_created}"
            self.num_created += 1
            self.bm.fork(parent, child)
            self.tokens[child], self.computed[child] = list(self.tokens[parent]), self.computed[parent]
            log.touched.update([parent, child])

    def _free(self, log: _StepLog) -> None:
        candidates = [r for r in self.tokens if r not in log.touched]
        if candidates:
            request_id = self.rng.choice(candidates)
            self.bm.free(request_id)
            del self.tokens[request_id], self.computed[request_id]
            log.touched.add(request_id)

    def _swap(self, log: _StepLog) -> None:
        for request_id in self._untouched(log, swapped=True):
            if self.bm.can_swap_in(request_id):
                pairs = self.bm.swap_in(request_id)
                assert [d for _, d in pairs] == [b for b in self.bm.block_table(request_id) if b is not None]
                log.swap_in_pairs += pairs
                log.touched.add(request_id)
                return
        candidates = [r for r in self._untouched(log, swapped=False) if self.bm.can_swap_out(r)]
        if candidates:
            request_id = self.rng.choice(candidates)
            free_before = self.bm.num_free_blocks
            table = [b for b in self.bm.block_table(request_id) if b is not None]
            num_exclusive = sum(self.bm.pool.blocks[b].ref_count == 1 for b in table)
            log.swap_out_pairs += self.bm.swap_out(request_id)
            # Blocks it held alone are freed, except a queued copy's source, held until take_copies.
            assert free_before <= self.bm.num_free_blocks <= free_before + num_exclusive
            log.touched.add(request_id)

    def _run_copies_and_writes(self, log: _StepLog) -> None:
        """What the runner does, in the documented order, then the forward pass's K/V writes."""
        for device_id, host_id in log.swap_out_pairs:
            self.host[host_id] = list(self.device[device_id])
        for host_id, device_id in log.swap_in_pairs:
            self.device[device_id] = list(self.host[host_id])
        for src, dst in self.bm.take_copies():
            self.device[dst] = list(self.device[src])
        for request_id, num_tokens in log.writes:
            table = self.bm.block_table(request_id)  # writes are never followed by free or swap
            for position in range(self.computed[request_id], num_tokens):
                self.device[table[position // BS]][position % BS] = self.tokens[request_id][position]
            self.computed[request_id] = num_tokens
            self.bm.publish_full_blocks(request_id, self.tokens[request_id], num_tokens)
            self.bm.remove_skipped_blocks(request_id, num_tokens)

    def _check_kv_contents(self) -> None:
        for request_id, tokens in self.tokens.items():
            if self.bm.is_swapped_out(request_id):
                continue
            table, computed = self.bm.block_table(request_id), self.computed[request_id]
            # The positions the next query (at `computed`) and later ones read; the blocks wholly
            # before them are placeholders, every other block is held.
            first = 0 if self.window is None else max(0, computed - self.window + 1)
            assert all((b is None) == (i < first // BS) for i, b in enumerate(table)), (first, table)
            stored = [self.device[table[p // BS]][p % BS] for p in range(first, computed)]
            assert stored == tokens[first:computed], f"{request_id}: wrong KV"

    def finish(self) -> None:
        for request_id in list(self.tokens):
            self.bm.free(request_id)
        self.bm.take_copies()
        self.bm.check_invariants()
        assert all(block.ref_count == 0 for block in self.bm.pool.blocks)
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert self.bm.num_host_free_blocks == self.bm.num_host_blocks
        assert self.bm._requests == {}


@pytest.mark.parametrize("window", [None, 1, 3, BS, BS + 1, 2 * BS + 3])
@pytest.mark.parametrize("seed, num_blocks, num_host_blocks", [(0, 20, 8), (1, 20, 8), (2, 8, 3), (3, 6, 6)])
def test_random_operations_keep_invariants_and_kv_contents(seed, num_blocks, num_host_blocks, window):
    sim = _Sim(random.Random(seed), num_blocks, num_host_blocks, window)
    for _ in range(120):
        sim.step()
    assert sim.bm.prefix_hits > 0  # the shared prompts did produce hits
    sim.finish()
