"""The scheduler over a block manager with a sliding window, driven by hand-made runner outputs.

A shadow KV memory plays the runner: it applies each step's swaps and copies, checks that every
position the step's queries read through their windows holds its token, then writes the step's
tokens. After every update the block accounting is checked and each resident table's placeholders
are exactly the blocks before its next query's window.
"""

from __future__ import annotations

import zlib

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from property_util import examples
from test_scheduler import BS, EOS, assert_drained, make_request, runner_output

from vllmlite.config import SchedulerConfig
from vllmlite.core.batch import SchedulerOutput
from vllmlite.core.block_manager import BlockManager
from vllmlite.core.request import FinishReason, Request
from vllmlite.core.scheduler import Scheduler
from vllmlite.core.sliding_window import SlidingWindow


def make_scheduler(window: int | None, *, num_blocks: int, num_host_blocks: int = 0,
                   preemption_mode: str = "recompute", num_speculative_tokens: int = 0,
                   max_model_len: int = 4096, **config) -> Scheduler:
    block_manager = BlockManager(num_blocks, BS, True, num_host_blocks, sliding_window=window)
    return Scheduler(SchedulerConfig(**config), block_manager, max_model_len, preemption_mode,
                     frozenset({EOS}), num_speculative_tokens)


def token_for(request: Request) -> int:
    """What the fake model samples next: differs by request and position, so a KV slot holding
    another request's or another position's token is caught."""
    return 1 + (zlib.crc32(request.request_id.encode()) + 7 * request.num_tokens) % 5000


class ShadowKV:
    """The runner's memory, one token id per slot (None: never written)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.bm = bm = scheduler.block_manager
        self.window = bm.sliding_window
        self.peak = 0  # the most device blocks in use during a step
        self.device: list[list[int | None]] = [[None] * BS for _ in range(bm.num_blocks)]
        self.host: list[list[int | None]] = [[None] * BS for _ in range(bm.num_host_blocks)]
        self.num_swapped_out = self.num_swapped_in = 0

    def run(self, out: SchedulerOutput, tokens: dict[str, int]) -> None:
        for device_id, host_id in out.blocks_to_swap_out:
            self.host[host_id] = list(self.device[device_id])
        for host_id, device_id in out.blocks_to_swap_in:
            self.device[device_id] = list(self.host[host_id])
        for src, dst in out.blocks_to_copy:
            self.device[dst] = list(self.device[src])
        self.peak = max(self.peak, self.bm.num_blocks - self.bm.num_free_blocks)
        self.num_swapped_out += len(out.blocks_to_swap_out)
        self.num_swapped_in += len(out.blocks_to_swap_in)
        for seq in out.scheduled:
            table, start = seq.block_table, seq.start_position
            first_read = 0 if self.window is None else max(0, start - self.window + 1)
            for p in range(first_read, start):
                block_id = table[p // BS]
                assert block_id is not None, f"{seq.request.request_id}: position {p} read from a placeholder"
                assert self.device[block_id][p % BS] == seq.request.token_ids[p], \
                    f"{seq.request.request_id}: wrong KV at {p}"
            # The step's tokens, then its guesses (the fake runner guesses the token it will sample).
            written = seq.token_ids + [tokens.get(seq.request.request_id, 0)] * seq.num_draft_slots
            for p, token in enumerate(written, start):
                self.device[table[p // BS]][p % BS] = token


def wstep(scheduler: Scheduler, kv: ShadowKV, accepted: dict[str, int] | None = None) -> SchedulerOutput:
    """schedule, run the shadow runner, update; check the accounting and every resident table."""
    out = scheduler.schedule()
    tokens = {s.request_id: token_for(s) for seq in out.scheduled for s in seq.samplers}
    kv.run(out, tokens)
    scheduler.update(out, runner_output(out, tokens, accepted))
    bm = scheduler.block_manager
    bm.check_invariants()
    for request in scheduler.running:
        table = bm.block_table(request.request_id)
        first_visible = request.num_computed_tokens - (bm.sliding_window or 10**9) + 1
        assert [b is None for b in table] == [(i + 1) * BS <= first_visible for i in range(len(table))]
    return out


def run(scheduler: Scheduler, max_steps: int = 5000, accepted: dict[str, int] | None = None) -> tuple[ShadowKV, int]:
    """Step until drained; the shadow memory and the most device blocks in use during a step."""
    kv = ShadowKV(scheduler)
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return kv, kv.peak
        wstep(scheduler, kv, accepted)
    raise AssertionError("the scheduler did not drain")


def add(scheduler: Scheduler, request_id: str, prompt: int, max_tokens: int) -> Request:
    request = make_request(request_id, prompt, max_tokens=max_tokens, ignore_eos=True)
    scheduler.add_request(request)
    return request


# --- one sequence longer than the cache ------------------------------------------------------------


def test_a_prompt_longer_than_the_whole_cache_completes_under_a_window():
    """8 blocks hold 32 tokens; a 40-token prompt and 100 more tokens need 35 blocks in all, but a
    window of 6 with chunks of 8 holds at most ceil((6 + 8 - 2) / 4) + 1 = 4 at once."""
    without = make_scheduler(None, num_blocks=8, max_num_batched_tokens=8)
    refused = add(without, "a", 40, 100)
    run(without)
    assert refused.finish_reason is FinishReason.ERROR and "whole cache" in refused.error
    scheduler = make_scheduler(6, num_blocks=8, max_num_batched_tokens=8)
    request = add(scheduler, "a", 40, 100)
    _, peak = run(scheduler)
    assert request.finish_reason is FinishReason.LENGTH and request.num_output_tokens == 100
    assert request.num_preemptions == 0
    assert peak == scheduler.block_manager.window.peak_blocks(140, 8) == 4
    assert_drained(scheduler)


def test_decoding_far_past_the_cache_completes_under_a_window():
    """Without a window a lone sequence stops (LENGTH) when the cache is full; with one it goes on."""
    without = make_scheduler(None, num_blocks=6)
    stopped = add(without, "a", 10, 200)
    run(without)
    assert stopped.finish_reason is FinishReason.LENGTH and stopped.num_output_tokens == 6 * BS - 10 + 1
    scheduler = make_scheduler(BS + 1, num_blocks=6)
    request = add(scheduler, "a", 10, 200)
    _, peak = run(scheduler)
    assert request.num_output_tokens == 200 and peak <= 3
    assert_drained(scheduler)


@pytest.mark.parametrize("window, chunk", [(1, 1), (3, 4), (BS, 5), (6, 8), (2 * BS, 3), (13, 16)])
def test_a_lone_long_prompt_fits_a_cache_of_exactly_its_peak_and_no_smaller(window, chunk):
    """The admission check and the blocks a step really holds agree, at the boundary."""
    peak = make_scheduler(window, num_blocks=1).block_manager.window.peak_blocks(201, chunk)
    fits = make_scheduler(window, num_blocks=peak, max_num_batched_tokens=chunk)
    request = add(fits, "a", 180, 20)
    _, held = run(fits)
    assert request.num_output_tokens == 20 and request.num_preemptions == 0 and held <= peak
    assert_drained(fits)
    too_small = make_scheduler(window, num_blocks=peak - 1, max_num_batched_tokens=chunk) if peak > 1 else None
    if too_small is not None:
        refused = add(too_small, "a", 180, 20)
        run(too_small)
        assert refused.finish_reason is FinishReason.ERROR and "sliding window" in refused.error


# --- many sequences, preemption and swap -------------------------------------------------------------


def test_many_long_sequences_share_a_cache_too_small_for_one():
    scheduler = make_scheduler(BS + 1, num_blocks=16, max_num_batched_tokens=16)
    requests = [add(scheduler, f"r{i}", 60, 60) for i in range(6)]
    run(scheduler)
    assert all(r.num_output_tokens == 60 for r in requests)
    assert_drained(scheduler)


# Pools a little larger than one request's peak: three requests of 60 tokens each (15 blocks) must
# preempt one another.
@pytest.mark.parametrize("window, num_blocks", [(1, 4), (BS + 1, 6), (2 * BS, 7)])
def test_recompute_preemption_with_placeholders_recomputes_from_position_zero(window, num_blocks):
    scheduler = make_scheduler(window, num_blocks=num_blocks, max_num_batched_tokens=8)
    requests = [add(scheduler, name, 20, 40) for name in "abc"]
    run(scheduler)
    assert scheduler.num_preemptions > 0
    assert all(r.num_output_tokens == 40 for r in requests)
    assert_drained(scheduler)


@pytest.mark.parametrize("window, num_blocks", [(1, 4), (BS + 1, 5), (2 * BS, 6)])
def test_swap_preemption_moves_only_held_blocks(window, num_blocks):
    """A host arena of 6 blocks, far smaller than any context (15 blocks): the held blocks fit, and a
    swapped request comes back with fewer free blocks than its context (only its window's)."""
    scheduler = make_scheduler(window, num_blocks=num_blocks, num_host_blocks=6, preemption_mode="swap",
                               max_num_batched_tokens=8)
    requests = [add(scheduler, name, 20, 40) for name in "abc"]
    kv, _ = run(scheduler)
    assert kv.num_swapped_out > 0 and kv.num_swapped_in == kv.num_swapped_out  # the KV came back
    assert scheduler.num_preemptions > 0
    assert all(r.num_output_tokens == 40 and r.finish_reason is FinishReason.LENGTH for r in requests)
    assert_drained(scheduler)


# --- forks and speculation over placeholders -----------------------------------------------------


def test_forks_share_the_held_blocks_of_a_long_prompt():
    scheduler = make_scheduler(BS + 1, num_blocks=12)
    prompt = list(range(1, 41))
    parent = make_request("p", prompt, max_tokens=30, ignore_eos=True)
    forks = [make_request(f"p#{i}", prompt, max_tokens=30, ignore_eos=True) for i in (1, 2)]
    scheduler.add_request(parent, forks)
    run(scheduler)
    assert all(r.num_output_tokens == 30 for r in (parent, *forks))
    # Each sample drew its own tokens after the shared prompt.
    assert len({tuple(r.output_token_ids) for r in (parent, *forks)}) == 3
    assert_drained(scheduler)


@pytest.mark.parametrize("num_accepted", [0, 1, 3])
def test_speculative_rounds_trim_and_release_under_a_window(num_accepted):
    scheduler = make_scheduler(BS + 1, num_blocks=8, num_speculative_tokens=3, max_num_batched_tokens=8)
    request = add(scheduler, "a", 30, 80)
    _, peak = run(scheduler, accepted={"a": num_accepted})
    assert request.num_output_tokens == 80
    assert peak <= scheduler.block_manager.window.peak_blocks(111, 8) == 4
    assert_drained(scheduler)


def test_kv_occupancy_counts_only_held_blocks():
    scheduler = make_scheduler(BS + 1, num_blocks=8)
    kv = ShadowKV(scheduler)
    request = add(scheduler, "a", 10, 100)
    for _ in range(40):
        wstep(scheduler, kv)
    occupancy, bm = scheduler.kv_occupancy(), scheduler.block_manager
    computed = request.num_computed_tokens
    num_skipped = bm.block_table("a").count(None)
    assert num_skipped == (computed - (BS + 1) + 1) // BS > 0
    assert occupancy.used_blocks == bm.num_held_blocks("a") == bm.num_blocks - bm.num_free_blocks
    assert occupancy.held_tokens == computed - num_skipped * BS


# --- random workloads ----------------------------------------------------------------------------

SHARED_HEAD = list(range(7000, 7000 + 6 * BS))  # prompts starting with it hit each other's blocks


@st.composite
def workloads(draw):
    window = draw(st.sampled_from([1, 3, BS, BS + 1, 2 * BS, 3 * BS + 2]))
    chunk = draw(st.integers(1, 3 * BS))
    mode = draw(st.sampled_from(["recompute", "swap"]))
    peak = SlidingWindow(window, BS).peak_blocks(10**6, chunk + 2)
    num_blocks = draw(st.integers(peak, peak + 4))  # room for one request, or a little more: they preempt
    requests = draw(st.lists(st.tuples(st.integers(0, 6 * BS), st.integers(1, 8 * BS), st.integers(1, 3 * BS),
                                       st.integers(0, 8)), min_size=2, max_size=6))
    return window, chunk, mode, num_blocks, requests


@settings(max_examples=examples(60), deadline=None)
@given(workloads(), st.integers(0, 2))
def test_random_workloads_read_only_present_blocks_and_drain(workload, num_speculative):
    """Arrivals, shared heads (prefix hits over placeholders), chunks, preemption by recompute or swap
    and speculative rounds: every read inside a window finds its token (ShadowKV), placeholders are
    exactly the blocks out of the window (wstep), and every request gets all its tokens."""
    window, chunk, mode, num_blocks, specs = workload
    scheduler = make_scheduler(window, num_blocks=num_blocks, num_host_blocks=4 * num_blocks, preemption_mode=mode,
                               num_speculative_tokens=num_speculative, max_num_batched_tokens=chunk + num_speculative)
    kv, requests = ShadowKV(scheduler), []
    for step_index in range(3000):
        for i, (num_shared, num_own, max_tokens, arrival) in enumerate(specs):
            if arrival == step_index:
                prompt = SHARED_HEAD[:num_shared] + [10_000 * (i + 1) + j for j in range(num_own)]
                requests.append(make_request(f"r{i}", prompt, max_tokens=max_tokens, ignore_eos=True))
                scheduler.add_request(requests[-1])
        if step_index > 20 and not scheduler.has_unfinished_requests():
            break
        wstep(scheduler, kv, accepted={r.request_id: step_index % 3 for r in requests})
    assert all(r.finish_reason is FinishReason.LENGTH and r.num_output_tokens == r.max_tokens for r in requests)
    assert_drained(scheduler)
    event(f"preempted: {scheduler.num_preemptions > 0}, swapped: {kv.num_swapped_out > 0}")
    event(f"prefix hit: {scheduler.block_manager.prefix_hits > 0}")
