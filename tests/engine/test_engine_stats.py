"""The stats contract: what get_stats() reports, checked against counts computed another way, and
that the async engine, the metrics and the API read nothing else of the engine."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import pytest
from conftest import greedy, make_prompts, run_to_completion
from paths import REPO_ROOT
from server_util import metric_value, wait_until

from vllmlite.config import SchedulerConfig, ceil_div
from vllmlite.engine.async_engine import AsyncLLMEngine
from vllmlite.engine.metrics import EngineMetrics
from vllmlite.engine.request_stream import GenerateRequest
from vllmlite.stats import ChunkingStats, EngineStats, SchedulerStats, SpecDecodeStats

PACKAGE = REPO_ROOT / "vllmlite"


def test_an_idle_engine_reports_every_block_free_and_zero_counts(make_engine):
    engine = make_engine(num_blocks=32)
    idle_chunking = ChunkingStats(policy="fixed", target_tpot_ms=SchedulerConfig.target_tpot_ms,
                                  prefill_budget=SchedulerConfig.max_num_batched_tokens,
                                  per_request_budget=SchedulerConfig.max_num_batched_tokens)
    assert engine.get_stats() == EngineStats(SchedulerStats(num_kv_blocks=32, num_kv_blocks_free=32,
                                                            chunking=idle_chunking))
    assert engine.get_stats().scheduler.kv_cache_usage == 0.0


def test_queues_and_blocks_after_the_first_step(make_engine):
    engine = make_engine(block_size=4, max_num_seqs=2, enable_prefix_caching=False)
    prompts = [list(range(1, 11)), list(range(1, 7)), list(range(1, 4))]   # 10, 6 and 3 tokens
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, greedy(4))
    before = engine.get_stats()
    assert (before.scheduler.num_running, before.scheduler.num_waiting, before.num_unfinished_requests) == (0, 3, 3)
    engine.step()
    stats = engine.get_stats()
    s = stats.scheduler
    assert (s.num_running, s.num_waiting, s.num_swapped) == (2, 1, 0)    # max_num_seqs admits two
    assert s.num_kv_blocks_used == ceil_div(10, 4) + ceil_div(6, 4)       # each prompt's blocks
    assert s.num_kv_blocks_used + s.num_kv_blocks_free == s.num_kv_blocks
    assert s.kv_cache_usage == s.num_kv_blocks_used / s.num_kv_blocks
    assert (s.prefix_cache_queries, s.prefix_cache_hits, s.num_kv_blocks_cached) == (0, 0, 0)  # caching off
    assert stats.num_forward_passes == 1


def test_kv_occupancy_counts_a_shared_prefix_block_once(make_engine):
    engine = make_engine(block_size=4, enable_prefix_caching=True)
    shared = make_prompts(1, seed=3, min_len=8, max_len=8)[0]             # two full blocks
    engine.add_request("a", shared + [1, 2], greedy(3))                     # 10 tokens: blocks 4 + 4 + 2
    engine.step()
    engine.add_request("b", shared + [3, 4, 5], greedy(3))                  # 11 tokens, the 8 shared cached
    engine.step()
    occupancy = engine.kv_occupancy()
    # After two steps "a" has computed its 10 prompt tokens and one decode (11), "b" its 11: the two
    # shared blocks hold 8 tokens once, then a's third block 3 and b's third block 3.
    assert occupancy.num_running == 2
    assert occupancy.held_tokens == 8 + 3 + 3
    assert occupancy.used_blocks == engine.get_stats().scheduler.num_kv_blocks_used == 2 + 1 + 1


def test_prefix_queries_hits_and_cached_blocks_count_tokens(make_engine):
    engine = make_engine(block_size=4, enable_prefix_caching=True)
    shared = make_prompts(1, seed=5, min_len=12, max_len=12)[0]            # three full blocks
    [first] = run_to_completion(engine, [(shared, greedy(5))])
    extra = [(t + 1) % 256 for t in first.outputs[0].token_ids[:4]]        # unlike the first one's output
    engine.add_request("second", shared + extra, greedy(5))
    while engine.has_unfinished_requests():
        outputs = engine.step()
    s = engine.get_stats().scheduler
    assert outputs[0].num_cached_tokens == 12
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (12 + 16, 12)
    # Published: full blocks of computed tokens (the last output token has no KV yet): the first
    # request's 16 of 17 tokens, the second's 20 of 21, of which the 3 shared blocks count once.
    assert s.num_kv_blocks_cached == 16 // 4 + 20 // 4 - 3
    assert s.num_kv_blocks_used == 0 and s.num_kv_blocks_free == s.num_kv_blocks


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_counts_under_preemption_agree_with_the_requests_and_steps(make_engine, mode):
    engine = make_engine(block_size=4, num_blocks=24, preemption_mode=mode, swap_space=0.01,
                         max_num_batched_tokens=32)
    prompts = make_prompts(8, seed=7, min_len=10, max_len=40)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, greedy(30))
    finished, num_steps, max_swapped, preemptions = {}, 0, 0, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        num_steps += 1
        stats = engine.get_stats()
        s = stats.scheduler
        assert s.num_kv_blocks_used + s.num_kv_blocks_free == s.num_kv_blocks == 24
        assert s.num_running + s.num_waiting + s.num_swapped == stats.num_unfinished_requests \
            == len(prompts) - len(finished)
        assert s.num_preemptions >= preemptions
        preemptions, max_swapped = s.num_preemptions, max(max_swapped, s.num_swapped)
    stats = engine.get_stats()
    assert stats.num_forward_passes == num_steps          # one pass per step, none without work
    assert stats.scheduler.num_preemptions == sum(o.metrics.num_preemptions for o in finished.values()) > 0
    assert (max_swapped > 0) == (mode == "swap")
    assert stats.num_draft_forward_passes == 0 and stats.scheduler.spec_decode == SpecDecodeStats()


@pytest.mark.parametrize("method, has_draft_model", [
    ({"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}, False),
    ({"method": "self_draft", "num_draft_layers": 1}, True),
], ids=["ngram", "self_draft"])
def test_spec_decode_counts_agree_with_the_requests(make_engine, method, has_draft_model):
    engine = make_engine(speculative_config={**method, "num_speculative_tokens": 3})
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], *make_prompts(3, seed=11)]
    results = run_to_completion(engine, [(p, greedy(20)) for p in prompts])
    stats = engine.get_stats()
    spec = stats.scheduler.spec_decode
    assert spec.num_draft_tokens == sum(r.metrics.num_draft_tokens for r in results) > 0
    assert spec.num_accepted_tokens == sum(r.metrics.num_accepted_tokens for r in results)
    assert len(spec.accepted_per_position) == 3 and sum(spec.accepted_per_position) == spec.num_accepted_tokens
    assert list(spec.accepted_per_position) == sorted(spec.accepted_per_position, reverse=True)
    assert 0 < spec.num_drafts <= spec.num_draft_tokens <= 3 * spec.num_drafts
    assert spec.acceptance_rate == spec.num_accepted_tokens / spec.num_draft_tokens
    assert (stats.num_draft_forward_passes > 0) == has_draft_model


def test_the_async_engine_and_metrics_publish_the_engine_stats(make_engine):
    engine = AsyncLLMEngine(make_engine(block_size=4), EngineMetrics("random"))
    engine.start()
    prompt = make_prompts(1, seed=9, min_len=20, max_len=20)[0]

    async def main():
        for i in range(2):  # one after the other: the second hits the first one's blocks
            async for _ in engine.generate(GenerateRequest(str(i), prompt, greedy(6))):
                pass

    try:
        asyncio.run(main())
        assert wait_until(lambda: engine.num_unfinished_requests == 0)
        published = engine.get_stats()
        assert published == engine.engine.get_stats()  # nothing ran since its last publication
    finally:
        engine.shutdown(timeout=0)
    s = published.scheduler
    assert s.prefix_cache_hits == 16 and s.prefix_cache_queries == 40
    text = engine.metrics.render()
    assert metric_value(text, "vllmlite:prefix_cache_queries_total") == s.prefix_cache_queries
    assert metric_value(text, "vllmlite:prefix_cache_hits_total") == s.prefix_cache_hits
    assert metric_value(text, "vllmlite:num_requests_running") == s.num_running == 0
    assert metric_value(text, "vllmlite:num_requests_waiting") == s.num_not_running == 0
    assert metric_value(text, "vllmlite:kv_cache_usage_perc") == s.kv_cache_usage == 0.0


def test_metrics_write_spec_decode_counts_per_position():
    metrics = EngineMetrics("m")
    spec = SpecDecodeStats(num_drafts=4, num_draft_tokens=8, num_accepted_tokens=5, accepted_per_position=(3, 2))
    metrics.record_stats(EngineStats(SchedulerStats(num_waiting=2, num_swapped=1, spec_decode=spec)))
    text = metrics.render()
    assert metric_value(text, "vllmlite:num_requests_waiting") == 3   # swapped requests wait too
    assert metric_value(text, "vllmlite:spec_decode_num_draft_tokens_total") == 8
    assert metric_value(text, "vllmlite:spec_decode_num_accepted_tokens_total") == 5
    assert metric_value(text, "vllmlite:spec_decode_num_accepted_tokens_per_pos_total", position="1") == 2


def _engine_attributes(path: Path) -> set[str]:
    """Attributes read off anything named `engine`: `engine.x`, `self.engine.x`, `ctx.engine.engine.x`."""
    return {node.attr for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Attribute)
            and (node.value.id if isinstance(node.value, ast.Name) else getattr(node.value, "attr", None)) == "engine"}


def _called_names(path: Path) -> set[str]:
    return {node.func.id for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}


@pytest.mark.parametrize("path", [PACKAGE / "engine" / "async_engine.py", PACKAGE / "engine" / "metrics.py",
                                  PACKAGE / "engine" / "inspection.py", *sorted((PACKAGE / "api").rglob("*.py"))],
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_readers_of_the_engine_reach_into_none_of_its_parts(path):
    assert _engine_attributes(path).isdisjoint({"scheduler", "block_manager", "runner", "output_processor"})


@pytest.mark.parametrize("name", ["engine/llm_engine.py", "engine/processor.py", "worker/runner.py",
                                  "worker/speculative.py", "engine/output_processor.py"])
def test_optional_proposer_parts_are_declared_not_probed(name):
    assert not _called_names(PACKAGE / name) & {"getattr", "hasattr"}
