"""Multi-step decoding (`num_scheduler_steps`): greedy decode steps replay their CUDA graph several
times back to back (worker/cuda_graphs.py `launch_steps`), the device feeding each pass the last one's
tokens. It must never change a token: stops mid-run, max_tokens, prefix caching, preemption and
requests that cannot take part all give the numpy path's tokens, and no block leaks (checked after
every step by run_to_completion). On the CPU the passes run eagerly on the graphs' buffers (Triton in
its interpreter); under the `cuda` mark they are captured and replayed."""

from __future__ import annotations

import pytest
from conftest import engine_on, greedy, make_prompts, run_to_completion, step_to_completion

torch = pytest.importorskip("torch")
from torch_facade import triton_interpreted_without_a_gpu  # noqa: E402  (needs torch)

if not triton_interpreted_without_a_gpu():   # before any kernel is defined
    pytest.skip("triton is not installed", allow_module_level=True)

from test_cuda_graphs import graph_engine  # noqa: E402

from vllmlite.engine_args import EngineArgs  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def numpy_tokens(tiny_model, requests) -> list[list[int]]:
    engine = engine_on(tiny_model, dtype="float32", kernels="numpy")
    return [r.outputs[0].token_ids for r in run_to_completion(engine, requests)]


def spy_passes(engine, shortest: list[int] | None = None, ahead: list[bool] | None = None) -> list[int]:
    """The number of passes of every multi-step replay the engine makes, appended as they are
    queued (and to `shortest`, the passes its shortest-lookahead row takes part in; to `ahead`,
    whether its inputs were a step's still on the device: async scheduling)."""
    graphs, passes = engine.runner.graphs, []
    launch_steps = graphs.launch_steps

    def spy(ids, meta, lookahead, after=None):
        passes.append(int(lookahead.max()) + 1)
        if shortest is not None:
            shortest.append(int(lookahead.min()) + 1)
        if ahead is not None:
            ahead.append(after is not None)
        return launch_steps(ids, meta, lookahead, after)
    graphs.launch_steps = spy
    return passes


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_multi_step_gives_the_numpy_paths_tokens_and_stops_where_it_should(tiny_model, device, async_scheduling,
                                                                           monkeypatch):
    """Seven requests with output budgets 3..15 and five passes a step (so runs end mid-step at
    max_tokens), one stopped by a token it generates on its way and one by a stop string: every
    token, and every stop, equals the numpy path's (tokens past a stop string are dropped). With
    async scheduling the steps after the first are queued ahead, fed on the device, and the
    requests a stop ends have their passes ahead dropped."""
    prompts = make_prompts(7, seed=5, min_len=2, max_len=40)
    requests = [(p, greedy(max_tokens=3 + 2 * i)) for i, p in enumerate(prompts)]
    plain = numpy_tokens(tiny_model, requests)
    stop = plain[6][5]                        # the 6th token of the longest request ends it there
    requests[6] = (prompts[6], greedy(max_tokens=15, stop_token_ids=[stop]))
    text = tiny_model.tokenizer.decode(plain[5][4:6])   # and a stop string ends the next one mid-run
    requests[5] = (prompts[5], greedy(max_tokens=13, stop=[text], detokenize=True))
    expected = numpy_tokens(tiny_model, requests)
    assert expected[6] == plain[6][:plain[6].index(stop) + 1] and len(expected[5]) < len(plain[5])
    engine = graph_engine(tiny_model, device, monkeypatch, max_num_seqs=8, num_scheduler_steps=5,
                          async_scheduling=async_scheduling)
    shortest: list[int] = []
    ahead: list[bool] = []
    passes = spy_passes(engine, shortest, ahead)
    step = engine.step

    def checked_step():   # a step queued ahead never passes a request's max_tokens
        outputs = step()
        for seq in engine._in_flight.scheduled.scheduled if engine._in_flight else ():
            r = seq.request
            assert r.is_finished or r.num_output_tokens + 1 + seq.num_draft_slots <= r.max_tokens
        return outputs
    engine.step = checked_step
    assert [r.outputs[0].token_ids for r in run_to_completion(engine, requests)] == expected
    assert max(passes) == 5 and any(a < b for a, b in zip(shortest, passes))   # rows cut short by max_tokens
    assert any(ahead) == async_scheduling and not ahead[0]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_multi_step_under_preemption_and_with_prefix_caching(tiny_model, device, async_scheduling, monkeypatch):
    """A pool too small for every sequence's lookahead (preemption and dropped lookahead), and
    requests sharing a prompt prefix that arrive later (prefix hits on blocks that multi-step
    passes filled): the numpy path's tokens, and the cache was hit."""
    base = make_prompts(1, seed=9, min_len=30, max_len=30)[0]
    prompts = [base + p for p in make_prompts(6, seed=3, min_len=1, max_len=6)]
    requests = [(p, greedy(max_tokens=12)) for p in prompts]
    expected = numpy_tokens(tiny_model, requests)
    engine = graph_engine(tiny_model, device, monkeypatch, max_num_seqs=8, num_scheduler_steps=6,
                          num_blocks=24, block_size=4, enable_prefix_caching=True, async_scheduling=async_scheduling)
    passes = spy_passes(engine)
    outputs = run_to_completion(engine, requests, arrivals={4: 6, 5: 9})
    assert [r.outputs[0].token_ids for r in outputs] == expected
    assert max(passes) > 1 and engine.scheduler.num_preemptions > 0
    assert any(r.num_cached_tokens for r in outputs[4:])


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_a_request_that_needs_the_sampler_runs_one_pass_a_step(tiny_model, device, async_scheduling, monkeypatch):
    """Logprobs need the sampler: while such a request decodes, steps run one pass and its lookahead
    slots are returned; once it is done, the others go back to several."""
    prompts = make_prompts(3, seed=4, min_len=3, max_len=20)
    requests = [(prompts[0], greedy(max_tokens=4, logprobs=2)), (prompts[1], greedy(max_tokens=14)),
                (prompts[2], greedy(max_tokens=14))]
    expected = numpy_tokens(tiny_model, requests)
    engine = graph_engine(tiny_model, device, monkeypatch, max_num_seqs=4, num_scheduler_steps=3,
                          async_scheduling=async_scheduling)
    passes = spy_passes(engine)
    outputs = run_to_completion(engine, requests)
    assert [r.outputs[0].token_ids for r in outputs] == expected
    assert len(outputs[0].outputs[0].logprobs) == 4
    assert passes and max(passes) == 3


def test_num_scheduler_steps_is_checked_and_needs_the_graphs(tiny_model):
    with pytest.raises(ValueError, match="num_scheduler_steps must be an integer in"):
        EngineArgs(model="random", num_scheduler_steps=0, num_blocks=8).create_engine_config()
    with pytest.raises(ValueError, match="adaptive chunking"):
        EngineArgs(model="random", num_scheduler_steps=4, num_blocks=8, prefill_chunking="adaptive").create_engine_config()
    with pytest.raises(ValueError, match="speculative decoding"):
        EngineArgs(model="random", num_scheduler_steps=4, num_blocks=8,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 2}).create_engine_config()
    engine = engine_on(tiny_model, dtype="float32", kernels="torch", num_scheduler_steps=4)   # no graphs
    assert engine.runner.graphs is None and engine.scheduler.num_lookahead_slots == 0


@pytest.mark.parametrize("device", DEVICES)
def test_a_row_past_its_lookahead_writes_only_the_scratch_block(tiny_model, device, monkeypatch):
    """Two decodes, one allowed no lookahead beside one allowed three: the first row's K/V at its
    position is exactly what a one-pass step writes, and its slots after that stay untouched while
    the other row runs on (its later passes go to the scratch block)."""
    engines = [graph_engine(tiny_model, device, monkeypatch, max_num_seqs=2, num_scheduler_steps=steps)
               for steps in (4, 1)]
    for engine in engines:
        for i, prompt in enumerate(make_prompts(2, seed=8, min_len=6, max_len=9)):
            engine.add_request(str(i), prompt, greedy(max_tokens=10))
        engine.step()   # the prompts
    multi, single = (engine.scheduler.schedule() for engine in engines)
    assert [s.num_draft_slots for s in multi.scheduled] == [3, 3]
    multi.scheduled[0].num_draft_slots = 0
    before = engines[0].runner.kv_cache[0][0].clone()
    result = engines[0].runner.execute(multi)
    engines[1].runner.execute(single)
    assert result.num_accepted == {"0": 0, "1": 3} and len(result.sampled_token_ids["1"]) == 4
    seq, bs = multi.scheduled[0], engines[0].block_manager.block_size
    slot = [seq.block_table[p // bs] * bs + p % bs for p in range(seq.start_position, seq.start_position + 4)]
    k_multi, k_single = engines[0].runner.kv_cache[0][0], engines[1].runner.kv_cache[0][0]
    assert torch.equal(k_multi[slot[0]], k_single[slot[0]])
    assert torch.equal(k_multi[slot[1:]], before[slot[1:]])


def async_engine_on(tiny_model, device, monkeypatch, **overrides):
    return graph_engine(tiny_model, device, monkeypatch, async_scheduling=True, **overrides)


@pytest.mark.parametrize("device", DEVICES)
def test_async_scheduling_one_pass_a_step_and_a_request_arriving_while_a_step_runs_ahead(tiny_model, device,
                                                                                           monkeypatch):
    """One pass a step, each queued behind the last: the numpy path's tokens; a request that arrives
    while a step runs ahead waits for it, then joins, and gets its own tokens too."""
    prompts = make_prompts(4, seed=12, min_len=3, max_len=30)
    requests = [(p, greedy(max_tokens=9 + i)) for i, p in enumerate(prompts)]
    expected = numpy_tokens(tiny_model, requests)
    engine = async_engine_on(tiny_model, device, monkeypatch, max_num_seqs=4)
    ahead: list[bool] = []
    passes = spy_passes(engine, ahead=ahead)
    outputs = run_to_completion(engine, requests, arrivals={3: 5})
    assert [r.outputs[0].token_ids for r in outputs] == expected
    assert set(passes) == {1} and sum(ahead) > 5


@pytest.mark.parametrize("device", DEVICES)
def test_async_scheduling_a_request_aborted_while_its_step_runs_ahead(tiny_model, device, monkeypatch):
    """A request aborted while a step holding it runs ahead: its tokens from that step are dropped,
    its blocks freed, and the others get the numpy path's tokens; nothing leaks."""
    prompts = make_prompts(3, seed=13, min_len=3, max_len=20)
    requests = [(p, greedy(max_tokens=24)) for p in prompts]
    expected = numpy_tokens(tiny_model, requests)
    engine = async_engine_on(tiny_model, device, monkeypatch, max_num_seqs=4, num_scheduler_steps=4)
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params)
    while engine._in_flight is None:
        engine.step()
    tokens_before = len(engine.scheduler.requests["1"].output_token_ids)
    engine.abort_request("1")
    finished = step_to_completion(engine)
    assert [finished[i].outputs[0].token_ids for i in ("0", "2")] == [expected[0], expected[2]]
    assert "1" not in finished and 0 < tokens_before < 24


@pytest.mark.parametrize("device", DEVICES)
def test_async_scheduling_when_the_step_ahead_finds_no_room(tiny_model, device, monkeypatch):
    """A pool that holds the running steps but not always the one ahead: then the engine waits for
    the step, schedules as usual (preempting), and goes on ahead when there is room again. Every
    token is the numpy path's."""
    prompts = make_prompts(3, seed=14, min_len=7, max_len=7)
    requests = [(p, greedy(max_tokens=20)) for p in prompts]
    expected = numpy_tokens(tiny_model, requests)
    engine = async_engine_on(tiny_model, device, monkeypatch, max_num_seqs=4, num_scheduler_steps=4,
                             num_blocks=14, block_size=4)
    ahead: list[bool] = []
    spy_passes(engine, ahead=ahead)
    assert [r.outputs[0].token_ids for r in run_to_completion(engine, requests)] == expected
    assert any(ahead) and engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("device", DEVICES)
def test_async_scheduling_runs_ahead_while_requests_wait_for_a_seat(tiny_model, device, monkeypatch):
    """More requests than seats: while every seat is taken and none comes free by max_tokens, steps
    still run ahead with requests waiting; a seat that comes free lets the head of the queue in.
    Every token is the numpy path's."""
    prompts = make_prompts(5, seed=15, min_len=3, max_len=25)
    requests = [(p, greedy(max_tokens=10 + 3 * i)) for i, p in enumerate(prompts)]
    expected = numpy_tokens(tiny_model, requests)
    engine = async_engine_on(tiny_model, device, monkeypatch, max_num_seqs=2, num_scheduler_steps=3)
    waiting_when_ahead: list[int] = []
    launch_steps = engine.runner.graphs.launch_steps

    def spy(ids, meta, lookahead, after=None):
        if after is not None:
            waiting_when_ahead.append(len(engine.scheduler.waiting))
        return launch_steps(ids, meta, lookahead, after)
    engine.runner.graphs.launch_steps = spy
    schedule_ahead = engine.scheduler.schedule_ahead

    def checked(current):   # never ahead past a seat that max_tokens frees in current while one waits
        ahead = schedule_ahead(current)
        if ahead is not None and engine.scheduler.waiting:
            assert all(s.request.num_output_tokens + 1 + s.num_draft_slots < s.request.max_tokens
                       for s in current.scheduled)
        return ahead
    engine.scheduler.schedule_ahead = checked
    assert [r.outputs[0].token_ids for r in run_to_completion(engine, requests)] == expected
    assert any(waiting_when_ahead)
