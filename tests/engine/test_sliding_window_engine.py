"""The engine's plumbing of a sliding window: CacheConfig.sliding_window reaches the block manager,
and the runner takes tables with placeholders. Which tokens come out is the kernels' part (their
`sliding_window`), checked once a model family with a window exists; here only how much runs."""

from dataclasses import replace

import pytest
from conftest import greedy, run_to_completion

from vllmlite.engine.llm_engine import LLMEngine
from vllmlite.engine.request_limits import RequestLimits
from vllmlite.engine_args import EngineArgs


def _engine(loaded, sliding_window: int | None) -> LLMEngine:
    """Four blocks of four tokens, four tokens a step: 16 tokens of KV in all."""
    config = EngineArgs(model="random", dtype="float64", num_blocks=4, block_size=4,
                        max_num_batched_tokens=4).create_engine_config()
    return LLMEngine(replace(config, cache=replace(config.cache, sliding_window=sliding_window)), loaded)


def test_a_window_lets_a_sequence_run_far_past_the_cache(tiny_model):
    prompt = list(range(1, 31))
    with pytest.raises(ValueError, match="KV cache holds at most 15 prompt tokens"):
        _engine(tiny_model, None).add_request("a", prompt, greedy(60))
    engine = _engine(tiny_model, 5)
    assert engine.block_manager.sliding_window == 5
    done = run_to_completion(engine, [(prompt, greedy(60))])[0]
    assert len(done.outputs[0].token_ids) == 60 and done.outputs[0].finish_reason == "length"
    assert engine.scheduler.num_preemptions == 0


@pytest.mark.parametrize("num_blocks, fits", [(3, True), (2, False)])
def test_request_limits_count_a_steps_blocks_under_a_window(num_blocks, fits):
    """Window 5, chunks of 4, blocks of 4: a step holds at most ceil(7 / 4) + 1 = 3 blocks."""
    limits = RequestLimits(vocab_size=259, max_model_len=4096, max_num_seqs=4, num_blocks=num_blocks,
                           block_size=4, sliding_window=5, max_num_batched_tokens=4)
    if fits:
        assert limits.check([7] * 1000, greedy(100)) == 100
    else:
        with pytest.raises(ValueError, match="sliding window 5"):
            limits.check([7] * 1000, greedy(100))
