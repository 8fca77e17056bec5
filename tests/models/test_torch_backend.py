"""The torch backend under the same engine: greedy tokens identical to the numpy path in float32 (on
the CPU here, on a GPU under the `cuda` mark), and bfloat16 logits within a stated tolerance of
float32's on a model of SmolLM2-135M's shape (random weights, so nothing is downloaded)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import engine_on, greedy, make_prompts, run_to_completion

from vllmlite.config import ModelConfig
from vllmlite.models.loader import LoadedModel, random_weights
from vllmlite.tokenizer import ByteTokenizer

torch = pytest.importorskip("torch")
from torch_facade import triton_interpreted_without_a_gpu  # noqa: E402  (needs torch)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
# SmolLM2-135M's shape (docs/architecture.md), with the byte vocabulary of the test tokenizer.
SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                     head_dim=64, rope_theta=100000.0)


def need(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")


def smollm2_shaped(dtype=np.float32, num_layers: int = 30) -> LoadedModel:
    tokenizer = ByteTokenizer()
    config = ModelConfig(architecture="llama", vocab_size=tokenizer.vocab_size, max_position_embeddings=2048,
                         **{**SMOLLM2_SHAPE, "num_layers": num_layers})
    return LoadedModel(config, random_weights(config, np.dtype(dtype), seed=3), tokenizer, "random")


def greedy_tokens(engine, prompts, max_tokens=16) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in run_to_completion(engine, [(p, greedy(max_tokens)) for p in prompts])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("attention", ["torch", "triton"])
def test_float32_greedy_tokens_equal_the_numpy_paths(device, attention):
    """Mixed prompt lengths (chunked prefill over several steps, decodes batched beside it) on a
    SmolLM2-shaped model: every token as the numpy references give it, with short queries attended
    by the gathered groups or by the Triton kernel (interpreted on a CPU)."""
    need(device)
    if attention == "triton" and not triton_interpreted_without_a_gpu():
        pytest.skip("triton is not installed")
    loaded = smollm2_shaped(num_layers=4)
    prompts = make_prompts(6, seed=5, min_len=1, max_len=90)
    expected = greedy_tokens(engine_on(loaded, dtype="float32", kernels="numpy", max_num_batched_tokens=64), prompts)
    engine = engine_on(loaded, dtype="float32", kernels="torch", device=device, max_num_batched_tokens=64)
    engine.model.kernels.triton = attention == "triton"   # the backend's choice, forced either way
    assert greedy_tokens(engine, prompts) == expected


@pytest.mark.parametrize("device", DEVICES)
def test_bfloat16_logits_stay_within_tolerance_of_float32(device):
    """Tolerance: bf16 keeps 8 bits of mantissa (relative step 2^-8 = 0.4%), and 30 layers of
    residual adds compound it; we require the logits' error to be under 3% of their spread (RMS)
    and the argmax to agree on at least 90% of positions. Measured values are in the assertion."""
    need(device)
    loaded = smollm2_shaped()
    prompt = make_prompts(1, seed=9, min_len=64, max_len=64)[0]

    def logits(dtype: str) -> np.ndarray:
        engine = engine_on(loaded, dtype=dtype, kernels="torch", device=device)
        model, kv = engine.runner.model, engine.runner.kv_cache
        from vllmlite.kernels.attention_metadata import build_metadata
        meta = build_metadata([len(prompt)], [len(prompt)], [list(range(len(prompt) // 16 + 1))], 16)
        return model.forward(np.array(prompt), meta, kv, np.arange(len(prompt))).astype(np.float64)

    full, half = logits("float32"), logits("bfloat16")
    error = np.sqrt(np.mean((full - half) ** 2)) / np.sqrt(np.mean((full - full.mean()) ** 2))
    agree = np.mean(full.argmax(-1) == half.argmax(-1))
    assert error < 0.03 and agree >= 0.9, (error, agree)


def test_half_precision_is_refused_on_the_numpy_paths_and_quantization_on_torch():
    from vllmlite.config import EngineConfig
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineConfig(model="random", dtype="bfloat16", kernels="numpy")
    with pytest.raises(ValueError, match="quantization must be 'none'"):
        EngineConfig(model="random", kernels="torch", quantization="int4")
    assert dataclasses.replace(EngineConfig(model="random"), kernels="torch", dtype="bfloat16").uses_torch


def test_the_cpu_paths_never_import_torch():
    """torch is an optional extra: the server, the offline LLM and an engine on the numba kernels
    load and run a step without it."""
    import subprocess
    import sys
    code = ("import sys, vllmlite.api.server, vllmlite.llm\n"
            "from vllmlite.engine_args import EngineArgs\n"
            "from vllmlite.engine.llm_engine import LLMEngine\n"
            "from vllmlite.sampling_params import SamplingParams\n"
            "engine = LLMEngine(EngineArgs(model='random', num_blocks=16).create_engine_config())\n"
            "engine.add_request('a', [1, 2, 3], SamplingParams(max_tokens=2))\n"
            "engine.step()\n"
            "sys.exit(1 if any(m in ('torch', 'triton') or m.startswith(('torch.', 'triton.')) for m in sys.modules) else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=300).returncode == 0
