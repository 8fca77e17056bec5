"""The engine with a model whose every layer slides (Mistral): the blocks out of every window are
freed, so a sequence runs far past what the KV cache holds, with the tokens of full-memory runs and
of transformers."""

import dataclasses
import json

import pytest
from conftest import greedy, run_to_completion
from paths import GOLDENS

from vllmlite import LLM, SamplingParams
from vllmlite.engine.llm_engine import LLMEngine
from vllmlite.engine.request_limits import RequestLimits
from vllmlite.engine_args import EngineArgs

MISTRAL = GOLDENS / "families" / "mistral"


def _sliding(loaded, window: int):
    """The tiny random model with every layer sliding over `window` tokens."""
    config = dataclasses.replace(loaded.config, layer_types=("sliding",) * loaded.config.num_layers,
                                 sliding_window=window)
    return dataclasses.replace(loaded, config=config)


def _engine(loaded, num_blocks: int) -> LLMEngine:
    """Blocks of four tokens, four tokens a step."""
    config = EngineArgs(model="random", dtype="float64", num_blocks=num_blocks, block_size=4,
                        max_num_batched_tokens=4).create_engine_config()
    return LLMEngine(config, loaded)


def test_a_window_lets_a_sequence_run_far_past_the_cache(tiny_model):
    """30 + 60 tokens through 16 tokens of KV: the window's blocks move along, and every token is the
    one a cache holding the whole sequence gives."""
    prompt, model = list(range(1, 31)), _sliding(tiny_model, 5)
    with pytest.raises(ValueError, match="KV cache holds at most 15 prompt tokens"):
        _engine(tiny_model, 4).add_request("a", prompt, greedy(60))
    engine = _engine(model, 4)
    assert engine.block_manager.sliding_window == 5
    done = run_to_completion(engine, [(prompt, greedy(60))])[0]
    assert engine.scheduler.num_preemptions == 0
    whole = run_to_completion(_engine(model, 64), [(prompt, greedy(60))])[0]
    assert done.outputs[0].token_ids == whole.outputs[0].token_ids and len(whole.outputs[0].token_ids) == 60


def test_mistral_in_a_cache_smaller_than_its_sequence_gives_transformers_tokens():
    """The Mistral golden (window 8) in 32 tokens of KV for a 40-token prompt and 12 greedy tokens:
    freed blocks are never read, and the tokens are transformers'."""
    golden = json.loads((MISTRAL / "expected.json").read_text())
    llm = LLM(str(MISTRAL), dtype="float32", num_blocks=8, block_size=4, max_num_batched_tokens=8)
    assert llm.engine.block_manager.sliding_window == 8
    params = SamplingParams(temperature=0.0, max_tokens=len(golden["greedy_ids"]), ignore_eos=True)
    [output] = llm.generate([{"prompt_token_ids": golden["input_ids"]}], params, use_tqdm=False)
    assert list(output.outputs[0].token_ids) == golden["greedy_ids"]


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
