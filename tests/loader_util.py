"""Test helper: logits at every prompt position through the engine's own forward passes."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from vllmlite.config import CacheConfig, EngineConfig, SchedulerConfig
from vllmlite.engine.llm_engine import LLMEngine
from vllmlite.sampling_params import SamplingParams


class EngineRun(NamedTuple):
    logits: np.ndarray       # [num_tokens, vocab] at every prompt position
    greedy_token: int        # the token the engine sampled after the prompt
    num_forward_passes: int


def engine_logits(model: str, token_ids: list[int], block_size: int, budget: int,
                  quantization: str = "none", dtype: str | None = None) -> EngineRun:
    """Logits at every position of one prompt, from the engine's own forward passes (paged KV
    cache, chunked prefill when the prompt exceeds `budget`): the LM head is asked for every row.
    In `dtype`, by default float64, or float32 for quantized weights."""
    dtype = dtype or ("float64" if quantization == "none" else "float32")
    engine = LLMEngine(EngineConfig(model=model, dtype=dtype,
                                    cache=CacheConfig(block_size=block_size, num_blocks=64),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=budget),
                                    quantization=quantization))
    llama = engine.runner.model
    forward = llama.forward_logits
    by_position: dict[int, np.ndarray] = {}

    def every_row(input_ids, meta, kv_cache, logits_rows):
        logits = forward(input_ids, meta, kv_cache, np.arange(len(input_ids)))
        by_position.update(zip(meta.positions.tolist(), logits))
        return logits[logits_rows]

    llama.forward_logits = every_row  # the runner's call
    engine.add_request("0", token_ids, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert sorted(by_position) == list(range(len(token_ids)))
    logits = np.stack([by_position[p] for p in range(len(token_ids))])
    return EngineRun(logits, outputs[-1].outputs[0].token_ids[-1], engine.get_stats().num_forward_passes)
