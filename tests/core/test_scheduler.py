"""The scheduler alone, without a model: hand-made requests, a real BlockManager, and runner outputs
faked from each SchedulerOutput (as vLLM's tests/v1/core drive theirs). After every step the block
accounting is checked; a drained scheduler holds no block and no request state."""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest

from vllmlite.config import SchedulerConfig
from vllmlite.core.batch import RunnerOutput, SchedulerOutput
from vllmlite.core.block_manager import BlockManager
from vllmlite.core.request import FinishReason, Request, RequestStatus
from vllmlite.core.scheduler import Scheduler
from vllmlite.sampling_params import SamplingParams

BS = 4          # block size throughout
EOS = 9_999     # the model's stop token in these tests
TOKEN = 100     # what the fake runner samples unless told otherwise


def make_scheduler(*, num_blocks: int = 64, num_host_blocks: int = 0, prefix_caching: bool = True,
                   preemption_mode: str = "recompute", max_model_len: int = 1024,
                   num_speculative_tokens: int = 0, **config) -> Scheduler:
    """A Scheduler over a real BlockManager of `num_blocks` blocks of BS tokens; SchedulerConfig
    knobs (max_num_seqs, max_num_batched_tokens, ...) by name."""
    block_manager = BlockManager(num_blocks, BS, prefix_caching, num_host_blocks)
    return Scheduler(SchedulerConfig(**config), block_manager, max_model_len, preemption_mode,
                     frozenset({EOS}), num_speculative_tokens)


def make_request(request_id: str, prompt: int | list[int], max_tokens: int = 16, client_id: str | None = None,
                 priority: int = 0, **params) -> Request:
    """A request with `prompt` tokens (a count: ids from the request id's hash, so two requests share
    no prefix unless given the same list), greedy, SamplingParams fields by name."""
    if isinstance(prompt, int):
        base = 1000 * zlib.crc32(request_id.encode())
        prompt = list(range(base, base + prompt))
    return Request(request_id=request_id, prompt_token_ids=prompt,
                   sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens, **params),
                   max_tokens=max_tokens, generator=np.random.default_rng(0), client_id=client_id,
                   priority=priority)


def runner_output(out: SchedulerOutput, tokens: dict[str, int] | None = None,
                  accepted: dict[str, int] | None = None) -> RunnerOutput:
    """What the runner would report for `out`: one token per sampler (`tokens[id]`, else TOKEN). A
    sequence with draft slots had every slot proposed; `accepted[id]` of them were kept (default 0),
    so it emits the kept guesses plus one token, as the runner's verification does."""
    tokens, accepted = tokens or {}, accepted or {}
    result = RunnerOutput()
    for seq in out.scheduled:
        for sampler in seq.samplers:
            token = tokens.get(sampler.request_id, TOKEN)
            if seq.num_draft_slots:
                num_kept = min(accepted.get(sampler.request_id, 0), seq.num_draft_slots)
                result.num_drafts[sampler.request_id] = seq.num_draft_slots
                result.num_accepted[sampler.request_id] = num_kept
                result.sampled_token_ids[sampler.request_id] = [token] * (num_kept + 1)
            else:
                result.sampled_token_ids[sampler.request_id] = [token]
    return result


def step(scheduler: Scheduler, tokens: dict[str, int] | None = None,
         accepted: dict[str, int] | None = None) -> tuple[SchedulerOutput, list[Request]]:
    """schedule, fake the runner, update (LLMEngine.step's protocol); check the block accounting."""
    out = scheduler.schedule()
    touched = scheduler.update(out, runner_output(out, tokens, accepted))
    scheduler.block_manager.check_invariants()
    return out, touched


def scheduled_ids(out: SchedulerOutput) -> list[str]:
    return [seq.request.request_id for seq in out.scheduled]


def run_until_done(scheduler: Scheduler, max_steps: int = 1000) -> None:
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return
        step(scheduler)
    raise AssertionError("the scheduler did not drain")


def assert_drained(scheduler: Scheduler) -> None:
    """Nothing left: every block free (or cached), no request in any queue."""
    bm = scheduler.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks
    assert not scheduler.requests and not scheduler.running and not scheduler.swapped
    assert len(scheduler.waiting) == 0


# --- admission --------------------------------------------------------------------------------------


def test_admission_fills_the_token_budget_and_chunks_the_last_prompt_admitted():
    """Prompts are admitted in order until the budget is spent; the last one gets what is left."""
    scheduler = make_scheduler(max_num_batched_tokens=10)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", 6))
    out, _ = step(scheduler)
    assert scheduled_ids(out) == ["r0", "r1"]
    assert [len(seq.token_ids) for seq in out.scheduled] == [6, 10 - 6]
    assert out.num_scheduled_tokens == 10
    assert [r.request_id for r in scheduler.waiting] == ["r2"]
    assert scheduler.requests["r1"].num_computed_tokens == 4 and scheduler.requests["r1"].num_output_tokens == 0
    run_until_done(scheduler)
    assert_drained(scheduler)


def test_running_decodes_spend_the_budget_before_a_waiting_prompt():
    """A decode's token comes out of the same step budget the next prompt's chunk is cut from."""
    scheduler = make_scheduler(max_num_batched_tokens=10)
    scheduler.add_request(make_request("decoding", 3))
    step(scheduler)
    scheduler.add_request(make_request("prompt", 20))
    out, _ = step(scheduler)
    assert scheduled_ids(out) == ["decoding", "prompt"]
    assert [len(seq.token_ids) for seq in out.scheduled] == [1, 10 - 1]
    run_until_done(scheduler)
    assert_drained(scheduler)


def test_admission_stops_at_max_num_seqs():
    """No more than max_num_seqs requests run at once, whatever the budget leaves."""
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=256)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", 3, max_tokens=2))
    out, _ = step(scheduler)
    assert scheduled_ids(out) == ["r0", "r1"] and len(scheduler.running) == 2
    out, touched = step(scheduler)  # r0 and r1 reach max_tokens: their seats free up
    assert {r.request_id for r in touched if r.is_finished} == {"r0", "r1"}
    out, _ = step(scheduler)
    assert scheduled_ids(out) == ["r2"]
    run_until_done(scheduler)
    assert_drained(scheduler)


def test_chunked_prefill_advances_computed_tokens_and_samples_only_on_the_last_chunk():
    """A prompt longer than the budget is computed over several steps; only its last chunk samples."""
    scheduler = make_scheduler(max_num_batched_tokens=8)
    request = make_request("long", 20, max_tokens=1)
    scheduler.add_request(request)
    starts, computed = [], []
    while not request.is_finished:
        out, _ = step(scheduler)
        (seq,) = out.scheduled
        starts.append(seq.start_position)
        computed.append(request.num_computed_tokens)
        assert seq.token_ids == request.prompt_token_ids[seq.start_position:seq.seq_len]
        assert len(seq.block_table) == math.ceil(seq.seq_len / BS)
        assert seq.samplers == ([request] if seq.seq_len == 20 else [])
    assert starts == [0, 8, 16] and computed == [8, 16, 20]
    assert request.output_token_ids == [TOKEN] and request.finish_reason is FinishReason.LENGTH
    assert_drained(scheduler)


# --- preemption -------------------------------------------------------------------------------------


def _fill_then_grow(scheduler: Scheduler, prompt_len: int, names: list[str]) -> None:
    """Admit `names` (prompts of `prompt_len`) and decode until one of them is preempted."""
    for name in names:
        scheduler.add_request(make_request(name, prompt_len, max_tokens=50))
    for _ in range(100):
        out, _ = step(scheduler)
        if out.num_preempted:
            return
    raise AssertionError("nothing was preempted")


def test_recompute_preemption_takes_the_newest_running_request_and_frees_its_blocks():
    """Out of blocks, the newest running request goes back to waiting with no KV and no blocks."""
    scheduler = make_scheduler(num_blocks=6, prefix_caching=False)
    _fill_then_grow(scheduler, 7, ["a", "b", "c"])
    a, b, c = (scheduler.requests[n] for n in "abc")
    assert c.status is RequestStatus.WAITING and c.num_preemptions == 1
    assert c.num_computed_tokens == 0 and scheduler.block_manager.block_table("c") == []
    assert c not in scheduler.running and list(scheduler.waiting) == [c]
    assert a.num_preemptions == b.num_preemptions == 0 and scheduler.running == [a, b]
    assert scheduler.num_preemptions == 1
    num_held = sum(len(scheduler.block_manager.block_table(r.request_id)) for r in (a, b))
    assert num_held == scheduler.block_manager.num_blocks - scheduler.block_manager.num_free_blocks


def test_recompute_preempted_request_is_readmitted_before_later_arrivals():
    """A request preempted for recompute goes back ahead of everyone who has not run yet, even a
    newcomer with a more urgent priority (request_queue.py: preempted first, then priority)."""
    scheduler = make_scheduler(num_blocks=6, prefix_caching=False)
    _fill_then_grow(scheduler, 7, ["a", "b", "c"])
    victim = scheduler.requests["c"]
    num_tokens_at_preemption = victim.num_tokens
    scheduler.add_request(make_request("late", 2, max_tokens=1, priority=-1))
    scheduler.abort_requests(["a", "b"])  # room for everyone
    out, _ = step(scheduler)
    assert scheduled_ids(out) == ["c", "late"]
    resumed = out.scheduled[0]
    # Re-prefill: the prompt and the tokens sampled before preemption, from position 0.
    assert resumed.start_position == 0 and resumed.seq_len == num_tokens_at_preemption
    assert resumed.token_ids == victim.token_ids[:num_tokens_at_preemption]
    run_until_done(scheduler)
    assert_drained(scheduler)


def test_several_recompute_preempted_requests_come_back_oldest_first():
    """Preempted newest first, requests dropped for recompute are readmitted oldest first."""
    scheduler = make_scheduler(num_blocks=8, prefix_caching=False)
    for name in "abc":
        scheduler.add_request(make_request(name, 7, max_tokens=50))
    preempted: list[str] = []
    for _ in range(100):
        step(scheduler)
        preempted += [r.request_id for r in scheduler.waiting if r.request_id not in preempted]
        if len(preempted) == 2:
            break
    assert preempted == ["c", "b"]  # the newest goes first
    scheduler.abort_requests(["a"])
    out, _ = step(scheduler)
    assert scheduled_ids(out) == ["b", "c"]
    run_until_done(scheduler)
    assert_drained(scheduler)


def test_swap_preemption_moves_the_victim_to_host_blocks():
    """Swap mode: the newest request's blocks are copied out and freed; its KV counts stay."""
    scheduler = make_scheduler(num_blocks=6, num_host_blocks=32, preemption_mode="swap")
    _fill_then_grow(scheduler, 7, ["a", "b", "c"])
    c = scheduler.requests["c"]
    assert c.status is RequestStatus.SWAPPED and scheduler.swapped == [c]
    assert c.num_computed_tokens == c.num_tokens - 1  # its KV lives on in the host arena
    assert scheduler.block_manager.block_table("c") == [] and scheduler.block_manager.is_swapped_out("c")


def test_several_swapped_requests_come_back_oldest_first():
    """Preempted newest first, swapped requests return oldest first (admission order)."""
    scheduler = make_scheduler(num_blocks=8, num_host_blocks=64, preemption_mode="swap")
    for name in "abc":
        scheduler.add_request(make_request(name, 7, max_tokens=50))
    swapped_order: list[str] = []
    for _ in range(100):
        step(scheduler)
        swapped_order += [r.request_id for r in scheduler.swapped if r.request_id not in swapped_order]
        if len(scheduler.swapped) == 2:
            break
    assert swapped_order == ["c", "b"]  # the newest goes first
    assert [r.request_id for r in scheduler.swapped] == ["b", "c"]
    scheduler.abort_requests(["a"])
    back: list[str] = []
    num_swapped_in = 0
    while scheduler.swapped or not back:
        out, _ = step(scheduler)
        back += [sid for sid in scheduled_ids(out) if sid in "bc" and sid not in back]
        num_swapped_in += len(out.blocks_to_swap_in)
    assert back == ["b", "c"]
    assert num_swapped_in > 0  # their KV came back from the host, not recomputed
    run_until_done(scheduler)
    assert_drained(scheduler)


# --- prefix cache -----------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt_len", [2 * BS + 1, 2 * BS, 3 * BS - 1])
def test_a_shared_prefix_skips_the_cached_full_blocks(prompt_len):
    """A second request with the same prompt starts after the full blocks the first published
    (never at its last token), sharing those blocks."""
    scheduler = make_scheduler()
    prompt = list(range(500, 500 + prompt_len))
    scheduler.add_request(make_request("first", prompt, max_tokens=2))
    step(scheduler)
    first_table = scheduler.block_manager.block_table("first")
    second = make_request("second", list(prompt), max_tokens=1)
    scheduler.add_request(second)
    out, _ = step(scheduler)
    assert scheduled_ids(out) == ["first", "second"]
    seq = out.scheduled[1]
    num_hit = (prompt_len - 1) // BS * BS
    assert seq.start_position == num_hit == second.num_cached_tokens
    assert seq.token_ids == prompt[num_hit:]
    assert seq.block_table[:num_hit // BS] == first_table[:num_hit // BS]
    assert_drained(scheduler)


def test_prompt_logprobs_recompute_a_cached_prefix():
    """A request asking for prompt logprobs is computed from position 0 even when its prefix is
    cached: every prompt position needs its logits."""
    scheduler = make_scheduler()
    prompt = list(range(300, 300 + 3 * BS + 1))
    scheduler.add_request(make_request("first", prompt, max_tokens=1))
    step(scheduler)
    assert scheduler.block_manager.find_prefix_hit(prompt).num_tokens == 3 * BS  # the prefix is cached
    scheduler.add_request(make_request("logprobs", list(prompt), max_tokens=1, prompt_logprobs=1))
    out, _ = step(scheduler)
    (seq,) = out.scheduled
    assert seq.start_position == 0 and seq.token_ids == prompt
    assert out.scheduled[0].request.num_cached_tokens == 0
    assert_drained(scheduler)


# --- speculative decoding ---------------------------------------------------------------------------


@pytest.mark.parametrize("num_accepted", [0, 1, 2, 3])
def test_speculative_round_keeps_accepted_guesses_and_releases_the_rest(num_accepted):
    """A decode reserves k draft slots; after verification the accepted guesses plus one token are
    emitted, computed tokens advance by 1 + accepted, and blocks past them go back to the pool."""
    k = 3
    scheduler = make_scheduler(num_speculative_tokens=k, prefix_caching=False)
    request = make_request("spec", 2 * BS - 2, max_tokens=20)  # 6 prompt tokens: drafts cross a block edge
    scheduler.add_request(request)
    step(scheduler)  # the prompt; no guesses on a prompt's step
    assert request.num_computed_tokens == request.num_tokens - 1 == 2 * BS - 2
    out = scheduler.schedule()
    (seq,) = out.scheduled
    assert seq.num_draft_slots == k
    assert len(seq.block_table) == math.ceil((seq.seq_len + k) / BS)  # slots for every guess
    computed_before, outputs_before = request.num_computed_tokens, request.num_output_tokens
    scheduler.update(out, runner_output(out, accepted={"spec": num_accepted}))
    scheduler.block_manager.check_invariants()
    assert request.num_computed_tokens == computed_before + 1 + num_accepted
    assert request.num_output_tokens == outputs_before + 1 + num_accepted
    table = scheduler.block_manager.block_table("spec")
    assert len(table) == math.ceil(request.num_computed_tokens / BS)
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks - len(table)
    assert (request.num_draft_tokens, request.num_accepted_tokens) == (k, num_accepted)
    stats = scheduler.make_stats().spec_decode
    assert (stats.num_draft_tokens, stats.num_accepted_tokens) == (k, num_accepted)
    run_until_done(scheduler)
    assert_drained(scheduler)


def test_draft_slots_never_let_a_round_pass_max_tokens():
    """One round emits up to drafts + 1 tokens, so drafts are capped at max_tokens - outputs - 1."""
    scheduler = make_scheduler(num_speculative_tokens=4)
    request = make_request("spec", 5, max_tokens=3)
    scheduler.add_request(request)
    step(scheduler)  # one output token
    out, _ = step(scheduler, accepted={"spec": 4})
    assert out.scheduled[0].num_draft_slots == 3 - 1 - 1
    assert request.num_output_tokens == 3 and request.finish_reason is FinishReason.LENGTH
    assert_drained(scheduler)


# --- aborts and stops -------------------------------------------------------------------------------


def test_abort_frees_blocks_and_removes_the_request_from_every_queue():
    """Aborting running, waiting and swapped requests frees their blocks and forgets them."""
    scheduler = make_scheduler(num_blocks=6, num_host_blocks=32, preemption_mode="swap",
                               max_num_batched_tokens=64)
    _fill_then_grow(scheduler, 7, ["a", "b", "c"])
    scheduler.add_request(make_request("queued", 3))
    assert [r.request_id for r in scheduler.swapped] == ["c"]
    aborted = scheduler.abort_requests(["a", "c", "queued", "unknown"])
    assert [r.request_id for r in aborted] == ["a", "c", "queued"]
    assert all(r.finish_reason is FinishReason.ABORT for r in aborted)
    assert [r.request_id for r in scheduler.running] == ["b"] and not scheduler.swapped
    assert len(scheduler.waiting) == 0 and set(scheduler.requests) == {"b"}
    bm = scheduler.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks - len(bm.block_table("b"))
    assert bm.num_host_free_blocks == bm.num_host_blocks
    scheduler.abort_requests(["b"])
    assert_drained(scheduler)


def test_max_tokens_finishes_with_length_after_exactly_that_many_tokens():
    scheduler = make_scheduler()
    request = make_request("r", 5, max_tokens=4)
    scheduler.add_request(request)
    run_until_done(scheduler)
    assert request.num_output_tokens == 4 and request.finish_reason is FinishReason.LENGTH
    assert_drained(scheduler)


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_a_stop_token_ends_the_request_and_eos_unless_ignored(ignore_eos):
    """A request stop token finishes with it as stop_reason; the model's EOS finishes unless
    ignore_eos; each only once min_tokens are out."""
    scheduler = make_scheduler()
    by_param = make_request("param", 5, max_tokens=10, stop_token_ids=[42], min_tokens=2)
    by_eos = make_request("eos", 5, max_tokens=10, ignore_eos=ignore_eos)
    scheduler.add_request(by_param)
    scheduler.add_request(by_eos)
    step(scheduler, tokens={"param": 42, "eos": EOS})  # the stop token before min_tokens: kept going
    assert not by_param.is_finished
    assert by_eos.is_finished is not ignore_eos
    step(scheduler, tokens={"param": 42, "eos": EOS})
    assert by_param.finish_reason is FinishReason.STOP and by_param.stop_reason == 42
    assert by_param.output_token_ids == [42, 42]
    if ignore_eos:
        assert not by_eos.is_finished
        scheduler.abort_requests(["eos"])
    else:
        assert by_eos.finish_reason is FinishReason.STOP and by_eos.stop_reason is None
        assert by_eos.output_token_ids == [EOS]
    assert_drained(scheduler)


def test_the_context_length_finishes_a_request_before_max_tokens():
    scheduler = make_scheduler(max_model_len=8)
    request = make_request("r", 5, max_tokens=100)
    scheduler.add_request(request)
    run_until_done(scheduler)
    assert request.num_tokens == 8 and request.finish_reason is FinishReason.LENGTH
    assert_drained(scheduler)
