"""Decode steps on the CUDA graphs' static buffers (vllmlite/worker/cuda_graphs.py): padded up the
batch ladder, padding rows writing only the scratch block, and every greedy token as the numpy
path gives it in float32. On the CPU the padded pass runs eagerly on the same buffers (Triton in its
interpreter); under the `cuda` mark the graphs are captured and replayed."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import engine_on, greedy, make_prompts, run_to_completion

torch = pytest.importorskip("torch")
from torch_facade import triton_interpreted_without_a_gpu  # noqa: E402  (needs torch)

if not triton_interpreted_without_a_gpu():   # before any kernel is defined
    pytest.skip("triton is not installed", allow_module_level=True)

from vllmlite.engine import llm_engine  # noqa: E402
from vllmlite.worker.cuda_graphs import batch_ladder  # noqa: E402


def test_the_ladder_covers_every_batch_up_to_the_largest():
    assert batch_ladder(1) == [1]
    assert batch_ladder(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_ladder(256)[-3:] == [224, 240, 256]


def graph_engine(loaded, device: str, monkeypatch, **overrides):
    """An engine on the torch kernels whose decode steps go through DecodeGraphs (on the CPU: not
    captured, the same padded pass run eagerly)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    monkeypatch.setattr(llm_engine, "uses_cuda_graphs", lambda config: True)
    engine = engine_on(loaded, dtype="float32", kernels="torch", device=device, **overrides)
    engine.model.kernels.triton = True
    return engine


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_padded_decode_batches_give_the_numpy_paths_tokens(tiny_model, device, monkeypatch):
    """Seven sequences of different lengths and output budgets: as they finish the batch shrinks
    through 7, 6, ... 1, each padded up to the ladder (8, 4, 2, 1), and prefill chunks run
    eagerly beside them. Every token equals the numpy references'."""
    prompts = make_prompts(7, seed=11, min_len=1, max_len=60)
    requests = [(p, greedy(max_tokens=3 + 2 * i)) for i, p in enumerate(prompts)]
    expected = [r.outputs[0].token_ids for r in
                run_to_completion(engine_on(tiny_model, dtype="float32", kernels="numpy"), requests)]
    engine = graph_engine(tiny_model, device, monkeypatch, max_num_seqs=8)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8]
    replays = []
    run = graphs.run
    graphs.run = lambda ids, meta: replays.append(len(ids)) or run(ids, meta)
    assert [r.outputs[0].token_ids for r in run_to_completion(engine, requests)] == expected
    assert set(replays) >= {7, 5, 3, 1}   # sizes padded up to every rung of the ladder


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_padded_decode_batches_over_fp8_kv_give_the_torch_operations_tokens(tiny_model, device, monkeypatch):
    """kv_cache_dtype fp8: the graphs' padded decodes and eager prefills through the Triton kernels
    give every token the torch operations give (a plain engine without Triton, one step at a time)."""
    prompts = make_prompts(7, seed=12, min_len=1, max_len=60)
    requests = [(p, greedy(max_tokens=3 + 2 * i)) for i, p in enumerate(prompts)]
    engine = graph_engine(tiny_model, device, monkeypatch, max_num_seqs=8, kv_cache_dtype="fp8")
    assert engine.runner.kv_cache[0][0].dtype == torch.float8_e4m3fn
    monkeypatch.undo()   # the plain engine: no graphs
    plain = engine_on(tiny_model, dtype="float32", kernels="torch", kv_cache_dtype="fp8", device=device,
                      enforce_eager=True)
    plain.model.kernels.triton = False
    assert plain.runner.graphs is None
    expected = [r.outputs[0].token_ids for r in run_to_completion(plain, requests)]
    assert [r.outputs[0].token_ids for r in run_to_completion(engine, requests)] == expected


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_padding_rows_write_only_the_scratch_block(tiny_model, device, monkeypatch):
    """Three decodes padded to four: the fourth row's K/V lands in the block after the block
    manager's pool, and no block a request could own changes but the three decodes' own slots."""
    engine = graph_engine(tiny_model, device, monkeypatch, max_num_seqs=4, num_blocks=32)
    runner = engine.runner
    scratch = engine.block_manager.num_blocks
    assert runner.kv_cache[0][0].shape[0] == (scratch + 1) * engine.block_manager.block_size
    for i, prompt in enumerate(make_prompts(3, seed=2, min_len=5, max_len=20)):
        engine.add_request(str(i), prompt, greedy(max_tokens=4))
    engine.step()   # the prefills, eagerly
    before = [k.clone() for k, _ in runner.kv_cache]
    out = engine.scheduler.schedule()
    assert len(out.scheduled) == 3 and all(len(s.token_ids) == 1 for s in out.scheduled)
    runner.execute(out)
    bs = engine.block_manager.block_size
    written = {s.block_table[s.start_position // bs] * bs + s.start_position % bs for s in out.scheduled}
    for layer, old in zip(runner.kv_cache, before):
        changed = set(np.flatnonzero((layer[0] != old).any(dim=(1, 2)).cpu().numpy()).tolist())
        assert changed - set(range(scratch * bs, (scratch + 1) * bs)) == written
        assert changed & set(range(scratch * bs, (scratch + 1) * bs))   # the padding row wrote there


def test_enforce_eager_and_the_cpu_capture_nothing(tiny_model):
    assert not llm_engine.uses_cuda_graphs(engine_on(tiny_model, kernels="torch", dtype="float32").config)
    from vllmlite.engine_args import EngineArgs
    config = EngineArgs(model="random", device="cuda", enforce_eager=True, num_blocks=8)._engine_config()
    assert config.enforce_eager and not llm_engine.uses_cuda_graphs(config)
    assert llm_engine.uses_cuda_graphs(EngineArgs(model="random", device="cuda", num_blocks=8)._engine_config())


def test_moe_models_run_every_step_eagerly(monkeypatch):
    """Their routing reads the router's logits on the host each layer, which a graph cannot replay."""
    from paths import GOLDENS

    from vllmlite.models.loader import load_model
    engine = graph_engine(load_model(str(GOLDENS / "families" / "qwen3_moe"), dtype="float32"), "cpu", monkeypatch)
    assert engine.runner.graphs is None
