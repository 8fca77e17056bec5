"""A hypothesis state machine over the block manager, checked against a reference model of it.

The machine plays a scheduler and a runner: within a step it admits requests (with prefix hits and
chunked prefill), grows running ones, forks, frees, swaps out and in, each request at most once per
step; at the end of the step it applies the copies in the documented order (swap-out, swap-in,
copy-on-write), writes the scheduled tokens into a shadow KV memory and publishes full blocks.

The model keeps the same state in plain lists and dicts (the free list as a list in LRU order,
cached blocks keyed by the whole token prefix instead of a hash chain) and predicts every result:
prefix hits, whether allocation succeeds, each block table id for id (copy-on-write and eviction
included), reference counts, the free list's order, the cached blocks, the queued copies and the
host arena. After every rule `check_invariants()` holds and the model agrees; after every step each
computed token of each resident request sits in its slot; at the end nothing has leaked.
tests/test_block_manager_random.py is the seeded random walk this extends (shrinking, the model).

The same machine runs again with a sliding window drawn at the start (`SlidingWindowMachine`): after
each step's publishing, blocks out of the window are released and become placeholders (None) in the
model's tables too; the KV check covers the positions a future query can still read, and every
table's placeholders are checked against the window's definition itself.

Run long with VLLMLITE_HYPOTHESIS_EXAMPLES=N (see tests/property_util.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from property_util import examples

from vllmlite.config import ceil_div
from vllmlite.core.block_manager import BlockManager

BS = 4
NUM_BLOCKS = 12
NUM_HOST_BLOCKS = 6
# Prompts sharing heads, so prefix hits happen: [0..7] is the head of two of them.
PROMPTS = (list(range(3 * BS)), [*range(2 * BS), *range(50, 50 + BS)], list(range(20, 20 + 3 * BS)))
SALTS = (None, "salt")
MAX_REQUESTS = 4  # few live requests, so rules meet the same ones often (fork, write, free a sibling)


@dataclass
class ModelRequest:
    tokens: list[int]
    extra_keys: tuple
    computed: int = 0
    table: list[int | None] = field(default_factory=list)  # None: released by the sliding window
    published: int = 0
    host: list[int] | None = None  # host block ids (of the held blocks) while swapped out
    skipped: int = 0  # leading placeholders

    @property
    def held(self) -> list[int]:
        return self.table[self.skipped:]


class Model:
    """The block manager's documented behaviour, in lists and dicts."""

    def __init__(self, window: int | None = None) -> None:
        self.window = window
        self.ref = [0] * NUM_BLOCKS
        self.free = list(range(NUM_BLOCKS))  # head (reused first) .. tail
        self.key_of: dict[int, tuple] = {}  # cached block -> (token prefix through it, extra keys)
        self.cache: dict[tuple, int] = {}
        self.requests: dict[str, ModelRequest] = {}
        self.copies: list[tuple[int, int]] = []
        self.pending: list[int] = []  # copy sources released at the end of the step
        self.host_free = list(range(NUM_HOST_BLOCKS))
        self.host_pending: list[int] = []

    # -- the pool
    def allocate_block(self) -> int:
        block = self.free.pop(0)
        if block in self.key_of:
            del self.cache[self.key_of.pop(block)]  # eviction
            event("evict a cached block")
        self.ref[block] = 1
        return block

    def touch(self, block: int) -> None:
        if self.ref[block] == 0:
            self.free.remove(block)
        self.ref[block] += 1

    def release(self, block: int) -> None:
        self.ref[block] -= 1
        if self.ref[block] == 0:
            if block in self.key_of:
                self.free.append(block)  # cached: evicted last
            else:
                self.free.insert(0, block)

    def release_after_copies(self, block: int) -> None:
        if self.ref[block] == 1 and any(src == block for src, _ in self.copies):
            self.pending.append(block)
        else:
            self.release(block)

    def release_table(self, table: list[int | None]) -> None:
        table = [b for b in table if b is not None]
        dead = {b for b in table if self.ref[b] == 1}
        self.copies = [(src, dst) for src, dst in self.copies if dst not in dead]
        for block in reversed(table):
            self.release_after_copies(block)

    # -- the manager
    @staticmethod
    def key(tokens: list[int], num_blocks: int, extra_keys: tuple) -> tuple:
        return tuple(tokens[:num_blocks * BS]), extra_keys

    def find_hit(self, tokens: list[int], extra_keys: tuple) -> list[int]:
        hit = []
        for i in range(max(len(tokens) - 1, 0) // BS):
            block = self.cache.get(self.key(tokens, i + 1, extra_keys))
            if block is None:
                break
            hit.append(block)
        return hit

    def num_skipped(self, computed: int) -> int:
        """Blocks wholly before position computed - window + 1, counted position by position."""
        if self.window is None:
            return 0
        first_visible = computed - self.window + 1
        return sum(1 for i in range(ceil_div(computed, BS) + 1) if (i + 1) * BS - 1 < first_visible)

    def plan(self, req: ModelRequest | None, hit: list[int], computed: int, num_tokens: int) -> tuple[list[int], int]:
        """(copy-on-write indices, free blocks needed)."""
        table = req.table if req is not None else hit
        num_required = ceil_div(num_tokens, BS)
        cow = []
        if num_tokens > computed:
            cow = [i for i in range(computed // BS, min(len(table), num_required))
                   if self.ref[table[i]] > 1 or table[i] in self.key_of]
        skipped = min(len(hit), self.num_skipped(computed))
        num_revived = sum(self.ref[b] == 0 for b in hit[skipped:]) if req is None else 0
        return cow, max(0, num_required - len(table)) + len(cow) + num_revived

    def remove_skipped(self, req: ModelRequest) -> None:
        skipped = min(self.num_skipped(req.computed), len(req.table))
        if skipped > req.skipped:
            self.release_table(req.table[req.skipped:skipped])
            req.table[req.skipped:skipped] = [None] * (skipped - req.skipped)
            req.skipped = skipped

    def allocate(self, req: ModelRequest, cow: list[int], num_tokens: int) -> None:
        for index in cow:
            src, dst = req.table[index], self.allocate_block()
            req.table[index] = dst
            self.copies.append((src, dst))
            self.release_after_copies(src)
        while len(req.table) < ceil_div(num_tokens, BS):
            req.table.append(self.allocate_block())

    def publish(self, req: ModelRequest) -> None:
        num_full = min(req.computed // BS, len(req.table))
        for i in range(req.published, num_full):
            key = self.key(req.tokens, i + 1, req.extra_keys)
            block = req.table[i]
            if block is not None and block not in self.key_of and key not in self.cache:
                self.key_of[block], self.cache[key] = key, block
        req.published = max(req.published, num_full)

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.copies = self.copies, []
        for block in self.pending:
            self.release(block)
        self.pending = []
        self.host_free += self.host_pending
        self.host_pending = []
        return copies


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self._build(None)

    def _build(self, window: int | None) -> None:
        self.bm = BlockManager(NUM_BLOCKS, BS, enable_prefix_caching=True, num_host_blocks=NUM_HOST_BLOCKS,
                               sliding_window=window)
        self.model = Model(window)
        self.device: list[list[int | None]] = [[None] * BS for _ in range(NUM_BLOCKS)]
        self.host: list[list[int | None]] = [[None] * BS for _ in range(NUM_HOST_BLOCKS)]
        self.num_created = 0
        self._start_step()

    def _start_step(self) -> None:
        self.touched: set[str] = set()
        self.writes: dict[str, int] = {}  # request id -> num_tokens scheduled this step
        self.swap_out_pairs: list[tuple[int, int]] = []
        self.swap_in_pairs: list[tuple[int, int]] = []

    def _candidates(self, swapped: bool) -> list[str]:
        return sorted(r for r, req in self.model.requests.items()
                      if r not in self.touched and (req.host is not None) == swapped)

    def _new_id(self) -> str:
        self.num_created += 1
        return f"r{self.num_created}"

    # -- rules: one scheduler decision each

    @precondition(lambda self: len(self.model.requests) < MAX_REQUESTS)
    @rule(prompt=st.sampled_from(PROMPTS), length=st.integers(1, 3 * BS), tail=st.lists(st.integers(0, 3), max_size=5),
          salt=st.sampled_from(SALTS), chunk=st.integers(0, 3 * BS))
    def admit(self, prompt, length, tail, salt, chunk):
        tokens, extra_keys = prompt[:length] + tail, () if salt is None else (salt,)
        request_id = self._new_id()
        hit = self.bm.find_prefix_hit(tokens, extra_keys)
        expected_hit = self.model.find_hit(tokens, extra_keys)
        assert (hit.block_ids, hit.num_tokens) == (expected_hit, len(expected_hit) * BS)
        num_tokens = hit.num_tokens + 1 + chunk % (len(tokens) - hit.num_tokens)  # chunked prefill
        cow, num_needed = self.model.plan(None, expected_hit, hit.num_tokens, num_tokens)
        fits = num_needed <= len(self.model.free)
        event(f"admit: prefix hit {bool(expected_hit)}, fits {fits}")
        assert self.bm.can_allocate(request_id, num_tokens, hit, num_computed_tokens=hit.num_tokens) == fits
        assert self.bm.allocate(request_id, hit.num_tokens, num_tokens, hit) == fits
        if fits:
            skipped = min(len(expected_hit), self.model.num_skipped(hit.num_tokens))
            for block in expected_hit[skipped:]:
                self.model.touch(block)
            table = [None] * skipped + expected_hit[skipped:]
            req = ModelRequest(tokens, extra_keys, hit.num_tokens, table, len(expected_hit), skipped=skipped)
            self.model.requests[request_id] = req
            self.model.allocate(req, cow, num_tokens)
            self.writes[request_id] = num_tokens
            self.touched.add(request_id)

    @rule(data=st.data(), new_token=st.integers(0, 3), chunk=st.integers(0, 3 * BS))
    def grow(self, data, new_token, chunk):
        candidates = self._candidates(swapped=False)
        if not candidates:
            return
        request_id = data.draw(st.sampled_from(candidates))
        req = self.model.requests[request_id]
        if req.computed == len(req.tokens):
            req.tokens.append(new_token)  # the token sampled last step
        num_tokens = req.computed + 1 + chunk % (len(req.tokens) - req.computed)
        cow, num_needed = self.model.plan(req, [], req.computed, num_tokens)
        fits = num_needed <= len(self.model.free)
        event(f"grow: copy-on-write {bool(cow)}, fits {fits}")
        assert self.bm.can_allocate(request_id, num_tokens, num_computed_tokens=req.computed) == fits
        assert self.bm.allocate(request_id, req.computed, num_tokens) == fits
        self.touched.add(request_id)
        if fits:
            self.model.allocate(req, cow, num_tokens)
            self.writes[request_id] = num_tokens

    @precondition(lambda self: len(self.model.requests) < MAX_REQUESTS)
    @rule(data=st.data())
    def fork(self, data):
        candidates = self._candidates(swapped=False)
        if not candidates:
            return
        parent_id, child_id = data.draw(st.sampled_from(candidates)), self._new_id()
        self.bm.fork(parent_id, child_id)
        parent = self.model.requests[parent_id]
        for block in parent.held:
            self.model.touch(block)
        self.model.requests[child_id] = ModelRequest(list(parent.tokens), parent.extra_keys, parent.computed,
                                                     list(parent.table), parent.published, skipped=parent.skipped)
        self.touched.update([parent_id, child_id])

    @rule(data=st.data())
    def free(self, data):
        candidates = sorted(r for r in self.model.requests if r not in self.touched)
        if not candidates:
            return
        request_id = data.draw(st.sampled_from(candidates))
        self.bm.free(request_id)
        req = self.model.requests.pop(request_id)
        self.model.release_table(req.table)
        if req.host is not None:
            self.model.host_free += req.host
        self.touched.add(request_id)

    @rule(data=st.data())
    def swap_out(self, data):
        candidates = self._candidates(swapped=False)
        if not candidates:
            return
        request_id = data.draw(st.sampled_from(candidates))
        req = self.model.requests[request_id]
        held = req.held
        fits = len(held) <= len(self.model.host_free)
        event(f"swap out: fits {fits}, placeholders {bool(req.skipped)}")
        assert self.bm.can_swap_out(request_id) == fits
        if not fits:
            return
        pairs = self.bm.swap_out(request_id)
        source_of = {dst: src for src, dst in self.model.copies}
        host, self.model.host_free = self.model.host_free[:len(held)], self.model.host_free[len(held):]
        assert pairs == [(source_of.get(d, d), h) for d, h in zip(held, host)]
        self.model.release_table(held)
        req.table, req.host, req.published = [], host, 0
        self.swap_out_pairs += pairs
        self.touched.add(request_id)

    @rule(data=st.data())
    def swap_in(self, data):
        candidates = self._candidates(swapped=True)
        if not candidates:
            return
        request_id = data.draw(st.sampled_from(candidates))
        req = self.model.requests[request_id]
        fits = len(req.host) <= len(self.model.free)
        event(f"swap in: fits {fits}")
        assert self.bm.can_swap_in(request_id) == fits
        if not fits:
            return
        pairs = self.bm.swap_in(request_id)
        req.table = [None] * req.skipped + [self.model.allocate_block() for _ in req.host]
        assert pairs == list(zip(req.host, req.held))
        self.model.host_pending += req.host
        req.host = None
        self.swap_in_pairs += pairs
        self.touched.add(request_id)

    @precondition(lambda self: self.model.key_of)
    @rule()
    def reset_prefix_cache(self):
        assert self.bm.reset_prefix_cache() == len(self.model.key_of)
        self.model.key_of.clear()
        self.model.cache.clear()

    @rule()
    def end_step(self):
        """The runner's copies in the documented order, the forward pass's writes, then publishing."""
        for device_id, host_id in self.swap_out_pairs:
            self.host[host_id] = list(self.device[device_id])
        for host_id, device_id in self.swap_in_pairs:
            self.device[device_id] = list(self.host[host_id])
        if self.model.pending:
            event("a copy source held to the end of the step")
        copies = self.bm.take_copies()
        assert copies == self.model.take_copies()
        for src, dst in copies:
            self.device[dst] = list(self.device[src])
        for request_id, num_tokens in self.writes.items():
            req = self.model.requests[request_id]
            for position in range(req.computed, num_tokens):
                self.device[req.table[position // BS]][position % BS] = req.tokens[position]
            req.computed = num_tokens
            self.bm.publish_full_blocks(request_id, req.tokens, num_tokens, req.extra_keys)
            self.model.publish(req)
            num_released = self.bm.remove_skipped_blocks(request_id, num_tokens)
            skipped_before = req.skipped
            self.model.remove_skipped(req)
            assert num_released == req.skipped - skipped_before
            if num_released:
                event("blocks released by the window")
        self._start_step()
        for request_id, req in self.model.requests.items():
            if req.host is None:
                # What a future query can read (from the first held block on) holds its tokens.
                first = req.skipped * BS
                stored = [self.device[req.table[p // BS]][p % BS] for p in range(first, req.computed)]
                assert stored == req.tokens[first:req.computed], f"{request_id}: wrong KV"

    # -- agreement with the model, after every rule

    @invariant()
    def agrees_with_the_model(self):
        self.bm.check_invariants()
        pool, model = self.bm.pool, self.model
        assert [b.ref_count for b in pool.blocks] == model.ref
        assert [b.block_id for b in pool.free_queue] == model.free
        assert {b.block_id for b in pool.cached_blocks.values()} == set(model.key_of)
        assert self.bm.num_free_blocks == len(model.free)
        assert self.bm.num_host_free_blocks == len(model.host_free)
        for request_id, req in model.requests.items():
            assert self.bm.block_table(request_id) == req.table
            assert self.bm.is_swapped_out(request_id) == (req.host is not None)
            assert self.bm.num_held_blocks(request_id) == len(req.host if req.host is not None else req.held)
        assert set(self.bm._requests) == set(model.requests)
        # no block in two places: a block is free, or held by tables and held copy sources only
        held = {b for req in model.requests.values() for b in req.held} | set(model.pending)
        assert held.isdisjoint(model.free) and len(held) + len(model.free) == NUM_BLOCKS

    @invariant()
    def placeholders_are_exactly_the_blocks_out_of_every_window(self):
        """Block i holds positions i*BS .. i*BS + BS - 1; the next query, at `computed`, and every later
        one reads positions >= computed - window + 1. Written out, not taken from the model."""
        window = self.model.window
        for request_id, req in self.model.requests.items():
            if req.host is not None:
                continue
            table = self.bm.block_table(request_id)
            for i, block_id in enumerate(table):
                out_of_window = window is not None and i * BS + BS - 1 < req.computed - window + 1
                assert (block_id is None) == out_of_window, (request_id, i, req.computed, window, table)

    def teardown(self):
        for request_id in list(self.model.requests):
            self.bm.free(request_id)
        self.bm.take_copies()
        self.bm.check_invariants()
        assert self.bm.num_free_blocks == NUM_BLOCKS and self.bm.num_host_free_blocks == NUM_HOST_BLOCKS
        assert all(b.ref_count == 0 for b in self.bm.pool.blocks) and not self.bm._requests


BlockManagerMachine.TestCase.settings = settings(max_examples=examples(120), stateful_step_count=60)
test_block_manager_agrees_with_its_model = BlockManagerMachine.TestCase


class SlidingWindowMachine(BlockManagerMachine):
    """The same rules and model over a block manager with a sliding window: smaller than a block, a
    block, not a multiple of one, and longer than the prompts."""

    @initialize(window=st.sampled_from([1, 3, BS, BS + 1, 2 * BS, 3 * BS + 2]))
    def choose_window(self, window):
        self._build(window)


SlidingWindowMachine.TestCase.settings = settings(max_examples=examples(150), stateful_step_count=60)
test_block_manager_with_sliding_window_agrees_with_its_model = SlidingWindowMachine.TestCase
