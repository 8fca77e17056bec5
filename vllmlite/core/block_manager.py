"""Per-request block tables over the block pool: allocation, copy-on-write, prefix reuse and swap.

It knows requests only by `request_id` and the token lists it is handed; it never imports the scheduler.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from vllmlite.config import ceil_div
from vllmlite.core.block import Block, BlockPool, block_key
from vllmlite.core.block_table import AllocationPlan, PrefixHit, RequestBlocks
from vllmlite.core.host_arena import HostArena
from vllmlite.core.sliding_window import SlidingWindow


class BlockManager:
    """Block tables for requests over one device `BlockPool`, plus a host arena for swapped requests.

    Invariants (see `check_invariants`): a block's ref_count equals the number of tables holding it,
    plus one while it waits in `_pending_release`; a swapped-out request has an empty device table and
    owns its host blocks alone; host blocks are free, pending (freed by `swap_in` this step) or owned;
    a table's placeholders (`sliding_window`: None entries) are exactly its first num_skipped_blocks.

    Copies are returned, never executed: the runner applies one step's copies in this order, before the
    forward pass: swap-out pairs (device -> host), swap-in pairs (host -> device), then `take_copies()`
    (device -> device). Reuse within a step is kept safe for that order: a block released this step
    is only reallocated as a destination written later in the order; a copy-on-write source that
    loses its last reference, and a host block freed by `swap_in`, are held until `take_copies()`.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, num_host_blocks: int = 0,
                 sliding_window: int | None = None) -> None:
        """`sliding_window`: every layer attends to the last that many positions only; blocks that fall
        out of every future window are released by `remove_skipped_blocks`. None: full attention."""
        if block_size <= 0:
            raise ValueError(f"bad block_size {block_size}")
        self.block_size = block_size
        self.window = SlidingWindow(sliding_window, block_size)
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.host = HostArena(num_host_blocks)
        self._requests: dict[str, RequestBlocks] = {}
        self._copies: list[tuple[int, int]] = []  # queued copy-on-write (src, dst) block ids
        self._pending_release: list[int] = []  # copy sources no table holds: released at take_copies
        self.prefix_queries = 0  # tokens looked up by find_prefix_hit
        self.prefix_hits = 0  # of those, tokens found cached

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Device blocks not referenced by any request, including evictable cached ones."""
        return self.pool.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Device blocks published in the prefix cache, referenced or not."""
        return self.pool.num_cached_blocks

    @property
    def usage(self) -> float:
        """Fraction of device blocks referenced by some request, in [0, 1]."""
        return (self.pool.num_blocks - self.pool.num_free_blocks) / self.pool.num_blocks

    @property
    def num_host_blocks(self) -> int:
        return self.host.num_blocks

    @property
    def num_host_free_blocks(self) -> int:
        return self.host.num_free_blocks

    def block_states(self) -> bytes:
        """Per device block id: 0 free, 1 used, 2 cached and free, 3 cached and used (O(num_blocks))."""
        return self.pool.block_states()

    @property
    def sliding_window(self) -> int | None:
        return self.window.window

    def block_table(self, request_id: str) -> list[int | None]:
        """A copy of the request's device block table; [] for an unknown or swapped-out request.
        None entries are placeholders for blocks out of the sliding window (sliding_window.py)."""
        state = self._requests.get(request_id)
        return list(state.block_ids) if state is not None else []

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks of the request's table that are not placeholders, on the device or the host."""
        state = self._requests.get(request_id)
        return state.num_held_blocks if state is not None else 0

    def is_swapped_out(self, request_id: str) -> bool:
        state = self._requests.get(request_id)
        return state is not None and state.is_swapped_out

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> int:
        """Release every block out of the window of the request's next query, which sits at position
        `num_computed_tokens` (`SlidingWindow.num_skipped_blocks`); its entries become placeholders.

        Call after the computed tokens advance, once `publish_full_blocks` has run: a published block
        released here stays cached (evictable). Later blocks are released first, so in the LRU the
        prompt's head outlives its tail. Returns the number released (0 without a window, or for an
        unknown or swapped-out request). O(blocks released).
        """
        if self.window.window is None:
            return 0  # every step of every request calls this: full attention pays one test
        state = self._requests.get(request_id)
        if state is None or state.is_swapped_out:
            return 0
        released = state.skip_blocks(self.window.num_skipped_blocks(num_computed_tokens))
        self._release_table(released)
        return len(released)

    def find_prefix_hit(self, token_ids: Sequence[int], extra_keys: tuple = ()) -> PrefixHit:
        """The longest run of published full blocks matching `token_ids` from the start.

        Never covers the last token, so at least one token is computed and yields logits:
        bs 4, 8 tokens -> at most (8 - 1) // 4 = 1 block; 9 tokens -> at most 2 blocks.
        Under a sliding window too, every block from the start must be cached (released published
        blocks stay so until evicted); `allocate` references only those in the request's window.
        With prefix caching off: always an empty hit. Counts nothing: the caller records a lookup
        once it is used (`record_prefix_lookup`), so a request retried for admission counts once.
        """
        if not self.enable_prefix_caching:
            return PrefixHit([], 0)
        bs = self.block_size
        max_blocks = max(len(token_ids) - 1, 0) // bs
        block_ids: list[int] = []
        key: bytes | None = None
        for i in range(max_blocks):
            chunk = token_ids[i * bs : (i + 1) * bs]
            key = block_key(key, chunk, extra_keys)
            block = self.pool.lookup(key, chunk)
            if block is None:
                break
            block_ids.append(block.block_id)
        return PrefixHit(block_ids, len(block_ids) * bs)

    def record_prefix_lookup(self, num_query_tokens: int, hit: PrefixHit) -> None:
        """Count a used lookup: `prefix_queries` and `prefix_hits` are in tokens (vLLM's metrics)."""
        if self.enable_prefix_caching:
            self.prefix_queries += num_query_tokens
            self.prefix_hits += hit.num_tokens

    def publish_full_blocks(
        self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int, extra_keys: tuple = ()
    ) -> None:
        """Publish every block now filled with computed tokens (positions < num_computed_tokens).

        Call after each step with the request's tokens so far and its updated (post-rollback)
        num_computed_tokens; `extra_keys` must be those given to `find_prefix_hit`. O(new blocks).
        No-op with prefix caching off, and for an unknown or swapped-out request (no device blocks).
        """
        state = self._requests.get(request_id)
        if not self.enable_prefix_caching or state is None:
            return
        bs = self.block_size
        num_full_blocks = min(num_computed_tokens // bs, len(state.block_ids))
        if len(token_ids) < num_full_blocks * bs:
            raise ValueError(f"{len(token_ids)} tokens cannot fill {num_full_blocks} blocks of {bs}")
        if num_full_blocks <= state.num_published_blocks:
            return  # no block filled since the last call (most steps of a decode)
        for i in range(state.num_published_blocks, num_full_blocks):
            chunk = token_ids[i * bs : (i + 1) * bs]
            key = block_key(state.last_key, chunk, extra_keys)
            # A duplicate key (another request computed the same prefix) leaves this block unpublished;
            # the chain still advances, since the key names the tokens, not the block. So it does over
            # a placeholder (a request swapped back in publishes from block 0 again).
            block_id = state.block_ids[i]
            if block_id is not None:
                self.pool.publish(self.pool.blocks[block_id], key, chunk)
            state.last_key = key
        state.num_published_blocks = max(state.num_published_blocks, num_full_blocks)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block. Returns the number dropped. Running requests keep their KV."""
        return self.pool.reset_prefix_cache()

    def can_allocate(
        self,
        request_id: str,
        num_tokens: int,
        prefix_hit: PrefixHit | None = None,
        num_computed_tokens: int | None = None,
    ) -> bool:
        """Whether `allocate` would succeed now. Exact when `num_computed_tokens` is given.

        If omitted it is taken as the hit's tokens for a new request, and as the start of the last
        block for an existing one (exact whenever the computed tokens reach into the last block, which
        holds for every request the scheduler grew to fit last step). `allocate` remains the authority.
        """
        state = self._requests.get(request_id)
        if num_computed_tokens is None:
            if state is None:
                num_computed_tokens = prefix_hit.num_tokens if prefix_hit is not None else 0
            else:
                # A table the window emptied entirely (w < bs) resumes at its end.
                last_block_start = max(len(state.block_ids) - 1, state.num_skipped_blocks, 0) * self.block_size
                num_computed_tokens = min(last_block_start, num_tokens)
        plan = self._plan(request_id, num_computed_tokens, num_tokens, prefix_hit)
        return plan is None or plan.num_free_blocks_needed <= self.pool.num_free_blocks

    def allocate(
        self,
        request_id: str,
        num_computed_tokens: int,
        num_tokens: int,
        prefix_hit: PrefixHit | None = None,
    ) -> bool:
        """Make the request's table hold `num_tokens` tokens, of which `num_computed_tokens` have KV.

        All-or-nothing: returns False and changes nothing if too few blocks are free (cached
        unreferenced blocks count as free and are evicted LRU only when needed); True otherwise.
        On the first allocation (a request the manager does not know) the hit's blocks become the
        table's head, and num_computed_tokens must cover them; a later call ignores `prefix_hit`.
        A block written this step (positions [num_computed_tokens, num_tokens)) that is shared or
        published is first replaced by a fresh copy; the pair is queued for `take_copies()`.
        Raises ValueError for a swapped-out request (swap_in first) or inconsistent counts.
        """
        plan = self._plan(request_id, num_computed_tokens, num_tokens, prefix_hit)
        if plan is None:
            return True
        if plan.num_free_blocks_needed > self.pool.num_free_blocks:
            return False
        state = self._requests.get(request_id)
        if state is None:
            # Reference the hit blocks before allocating, so allocation cannot evict them; those already
            # out of the window become placeholders at once.
            for block in plan.referenced_hit_blocks:
                self.pool.touch(block)
            num_skipped = plan.num_skipped_hit_blocks
            state = RequestBlocks([None] * num_skipped + [b.block_id for b in plan.referenced_hit_blocks],
                                  num_skipped_blocks=num_skipped)
            if plan.hit_blocks:
                state.num_published_blocks = len(plan.hit_blocks)
                state.last_key = plan.hit_blocks[-1].block_key
            self._requests[request_id] = state
        for index in plan.cow_indices:
            self._copy_on_write(state, index)
        for _ in range(plan.num_new_blocks):
            state.block_ids.append(self.pool.allocate().block_id)
        return True

    def take_copies(self) -> list[tuple[int, int]]:
        """Drain the queued copy-on-write (src_block_id, dst_block_id) pairs, in the order queued.

        Call exactly once per step, after scheduling: it ends the step, so blocks held for this step's
        copies (sources nobody else holds, host blocks freed by `swap_in`) become reusable.
        """
        copies, self._copies = self._copies, []
        for block_id in self._pending_release:
            self.pool.release(self.pool.blocks[block_id])
        self._pending_release.clear()
        self.host.end_step()
        return copies

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give `child_id` a table sharing every block of `parent_id` (each block's ref_count + 1).
        The first write by either into a shared block copies it (see `allocate`)."""
        parent = self._requests.get(parent_id)
        if parent is None or parent.is_swapped_out:
            raise ValueError(f"cannot fork {parent_id!r}: unknown or swapped out")
        if child_id in self._requests:
            raise ValueError(f"cannot fork into existing request {child_id!r}")
        for block_id in parent.held_block_ids:
            self.pool.touch(self.pool.blocks[block_id])
        child = RequestBlocks(list(parent.block_ids), parent.num_published_blocks, parent.last_key,
                              num_skipped_blocks=parent.num_skipped_blocks)
        self._requests[child_id] = child

    def free(self, request_id: str) -> None:
        """Release every block of the request, tail first, and forget it. No-op if unknown.

        Tail first: released cached blocks join the LRU tail in reverse, so the prompt's head (the
        part other prompts most likely share) is evicted last. Host blocks of a swapped-out request
        return to the host free list.
        """
        state = self._requests.pop(request_id, None)
        if state is None:
            return
        self._release_table(state.held_block_ids)
        if state.host_block_ids is not None:
            self.host.free(state.host_block_ids)

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Shrink the table to the blocks that hold `num_tokens` tokens, releasing the rest.

        Used after speculative verification: slots taken for rejected drafts go back to the pool.
        Published blocks are never trimmed (they hold computed tokens only), nor placeholders.
        """
        state = self._requests.get(request_id)
        if state is None or state.is_swapped_out:
            return
        keep = max(ceil_div(num_tokens, self.block_size), state.num_published_blocks, state.num_skipped_blocks)
        if keep < len(state.block_ids):
            tail = state.block_ids[keep:]
            del state.block_ids[keep:]
            self._release_table(tail)

    def can_swap_out(self, request_id: str) -> bool:
        state = self._requests.get(request_id)
        is_resident = state is not None and not state.is_swapped_out
        return is_resident and self.host.can_allocate(len(state.held_block_ids))

    def swap_out(self, request_id: str) -> list[tuple[int, int]]:
        """Move the request to host blocks. Returns (device_block_id, host_block_id) pairs to copy.

        The device blocks are released at once (others may reuse them this step: swap-out copies run
        first). Its device table becomes empty; the request keeps its place in the manager.
        Placeholders are not copied: they come back as placeholders. Raises ValueError unless
        `can_swap_out`.
        """
        if not self.can_swap_out(request_id):
            raise ValueError(f"cannot swap out {request_id!r}")
        state = self._requests[request_id]
        # A block whose copy-on-write is still queued holds nothing yet: read its source instead.
        source_of = {dst: src for src, dst in self._copies}
        held = state.held_block_ids
        host_block_ids = self.host.allocate(len(held))
        pairs = [(source_of.get(d, d), h) for d, h in zip(held, host_block_ids)]
        self._release_table(held)
        state.block_ids = []
        state.host_block_ids = host_block_ids
        # The blocks swapped back in are new and unpublished: publishing restarts from block 0.
        state.num_published_blocks, state.last_key = 0, None
        return pairs

    def can_swap_in(self, request_id: str) -> bool:
        state = self._requests.get(request_id)
        host_block_ids = state.host_block_ids if state is not None else None
        return host_block_ids is not None and len(host_block_ids) <= self.pool.num_free_blocks

    def swap_in(self, request_id: str) -> list[tuple[int, int]]:
        """Move the request back to fresh device blocks. Returns (host_block_id, device_block_id) pairs.

        The table gets the same length and placeholders it had when swapped out. Raises ValueError
        unless `can_swap_in`.
        """
        if not self.can_swap_in(request_id):
            raise ValueError(f"cannot swap in {request_id!r}")
        state = self._requests[request_id]
        host_block_ids = state.host_block_ids or []
        device_block_ids = [self.pool.allocate().block_id for _ in host_block_ids]
        state.block_ids = [None] * state.num_skipped_blocks + device_block_ids
        state.host_block_ids = None
        self.host.free_after_step(host_block_ids)
        return list(zip(host_block_ids, device_block_ids))

    def _plan(
        self, request_id: str, num_computed_tokens: int, num_tokens: int, prefix_hit: PrefixHit | None
    ) -> AllocationPlan | None:
        """Work out what `allocate` needs, validating the counts; changes nothing. None: nothing at all
        (a known request whose table already holds every slot written, in blocks only it holds and
        unpublished: most steps of a decode)."""
        state = self._requests.get(request_id)
        if state is not None and state.is_swapped_out:
            raise ValueError(f"request {request_id!r} is swapped out: swap_in before allocate")
        if not 0 <= num_computed_tokens <= num_tokens:
            raise ValueError(f"need 0 <= num_computed_tokens {num_computed_tokens} <= {num_tokens}")
        hit_blocks = self._hit_blocks(prefix_hit) if state is None else ()
        if hit_blocks and num_computed_tokens < len(hit_blocks) * self.block_size:
            raise ValueError("num_computed_tokens must include the prefix hit's tokens")
        block_ids = state.block_ids if state is not None else [block.block_id for block in hit_blocks]
        if num_computed_tokens > len(block_ids) * self.block_size:
            raise ValueError(f"{num_computed_tokens} computed tokens but only {len(block_ids)} blocks")
        num_skipped = state.num_skipped_blocks if state is not None else \
            min(len(hit_blocks), self.window.num_skipped_blocks(num_computed_tokens))
        if num_tokens > num_computed_tokens and num_computed_tokens // self.block_size < num_skipped:
            raise ValueError(f"position {num_computed_tokens} lies in a block released by the sliding window")
        num_required = ceil_div(num_tokens, self.block_size)
        # Written positions [num_computed, num_tokens) -> block indices; bs 4, computed 6, tokens 9:
        # blocks 1..2 are written, block 1 exists (copied first if shared), block 2 is new. Only the
        # written blocks are looked at: a decode reads one, however long its table.
        cow_indices = []
        if num_tokens > num_computed_tokens:
            first_written = num_computed_tokens // self.block_size
            for index in range(first_written, min(len(block_ids), num_required)):
                block = self.pool.blocks[block_ids[index]]
                if block.ref_count > 1 or block.is_cached:
                    cow_indices.append(index)
        num_new_blocks = max(0, num_required - len(block_ids))
        if state is not None and not cow_indices and not num_new_blocks:
            return None
        return AllocationPlan(hit_blocks, num_skipped if state is None else 0, cow_indices, num_new_blocks)

    def _hit_blocks(self, prefix_hit: PrefixHit | None) -> list[Block]:
        if prefix_hit is None or not prefix_hit.block_ids:
            return []
        blocks = [self.pool.blocks[block_id] for block_id in prefix_hit.block_ids]
        if any(not block.is_cached for block in blocks):
            raise ValueError("stale prefix hit: a block was evicted; find the hit right before allocate")
        if prefix_hit.num_tokens != len(blocks) * self.block_size:
            raise ValueError(f"prefix hit of {len(blocks)} blocks claims {prefix_hit.num_tokens} tokens")
        return blocks

    def _copy_on_write(self, state: RequestBlocks, index: int) -> None:
        """Point table[index] at a fresh block and queue (old, new) for copying."""
        src = self.pool.blocks[state.block_ids[index]]
        dst = self.pool.allocate()
        state.block_ids[index] = dst.block_id
        self._copies.append((src.block_id, dst.block_id))
        self._release_after_copies(src)

    def _release_table(self, block_ids: list[int]) -> None:
        """Release a table's blocks tail first, dropping queued copies into blocks only it held."""
        if self._copies:
            dead = {i for i in block_ids if self.pool.blocks[i].ref_count == 1}
            self._copies = [(src, dst) for src, dst in self._copies if dst not in dead]
        for block_id in reversed(block_ids):
            self._release_after_copies(self.pool.blocks[block_id])

    def _release_after_copies(self, block: Block) -> None:
        """Drop a table's reference, but hold a queued copy's source until `take_copies()`: freed
        now, it could become this step's swap-in destination, which the runner writes first."""
        is_last_reference = block.ref_count == 1
        if is_last_reference and any(src == block.block_id for src, _ in self._copies):
            self._pending_release.append(block.block_id)
        else:
            self.pool.release(block)

    def check_invariants(self) -> None:
        """Assert pool and table accounting agree (see the class docstring). O(num_blocks + tables)."""
        self.pool.check_invariants()
        holders: Counter[int] = Counter()  # block id -> tables holding it
        for request_id, state in self._requests.items():
            state.check(request_id, self.window.window is not None)
            holders.update(state.held_block_ids)
        pending = Counter(self._pending_release)
        for block in self.pool.blocks:
            num_holders = holders[block.block_id] + pending[block.block_id]
            assert block.ref_count == num_holders, (
                f"block {block.block_id}: ref_count {block.ref_count} but {num_holders} holders"
            )
        for _, dst in self._copies:
            assert holders[dst] > 0, f"queued copy into block {dst} that no table holds"
        self.host.check_invariants(i for state in self._requests.values() for i in state.host_block_ids or [])
