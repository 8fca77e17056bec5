"""Every backend's kernels against the numpy reference, on the array layouts the model passes
(strided views into the fused QKV buffer, workspace slices) and at the real model's head size.

Paged attention's own oracle is the dense attention in tests/test_attention.py; here the compiled
kernel is also held to the reference at SmolLM2's shape on a ragged batch of long contexts.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import subprocess
import sys

import numpy as np
import pytest
from conftest import engine_on, greedy, run_to_completion
from gguf import GGMLQuantizationType, quants
from numba.core.registry import CPUDispatcher

import vllmlite.kernels.numba as numba_package
from vllmlite.engine_args import EngineArgs
from vllmlite.kernels import BACKENDS, blas, get_kernels, resolve_backend
from vllmlite.kernels.attention_metadata import build_metadata
from vllmlite.kernels.numba.attention import DECODE_PART, DECODE_PART_SLACK
from vllmlite.kernels.quant import dequantize, from_gguf, quantize, tile

REFERENCE = get_kernels("numpy")
TOLERANCE = {np.float32: 1e-5, np.float64: 1e-12}
DTYPES = [np.float32, np.float64]


def qkv_views(rng: np.random.Generator, num_tokens: int, heads: int, kv_heads: int, head_dim: int, dtype):
    """q, k, v as the model makes them: strided views into one [tokens, (heads + 2 kv) * d] buffer."""
    qkv = rng.standard_normal((num_tokens, (heads + 2 * kv_heads) * head_dim)).astype(dtype)
    q_end, k_end = heads * head_dim, (heads + kv_heads) * head_dim
    return (qkv, qkv[:, :q_end].reshape(num_tokens, heads, head_dim),
            qkv[:, q_end:k_end].reshape(num_tokens, kv_heads, head_dim),
            qkv[:, k_end:].reshape(num_tokens, kv_heads, head_dim))


def feature_major(rows: np.ndarray) -> np.ndarray:
    """The same values as a token-major view of a row-major [features, tokens] array, as the
    model's workspace hands them out."""
    return np.ascontiguousarray(rows.T).T


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 7, 64])
@pytest.mark.parametrize("layout", ["token_major", "feature_major"])
def test_norms_match_the_reference(kernels, dtype, num_tokens, layout):
    rng = np.random.default_rng(num_tokens)
    x = (3 * rng.standard_normal((num_tokens, 576))).astype(dtype)
    residual = rng.standard_normal((num_tokens, 576)).astype(dtype)
    weight = rng.standard_normal(576).astype(dtype)
    expected, out = np.empty_like(x), np.full_like(x, np.nan)
    if layout == "feature_major":
        x, residual, out = feature_major(x), feature_major(residual), feature_major(out)
    REFERENCE.rms_norm(x, weight, 1e-5, expected)
    kernels.rms_norm(x, weight, 1e-5, out)
    np.testing.assert_allclose(out, expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])

    expected_residual, got_residual = residual.copy(), residual.copy()
    REFERENCE.add_rms_norm(x, expected_residual, weight, 1e-5, expected)
    kernels.add_rms_norm(x, got_residual, weight, 1e-5, out)
    np.testing.assert_allclose(got_residual, residual + x, rtol=TOLERANCE[dtype])
    np.testing.assert_allclose(out, expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 5, 16, 17, 40])  # both sides of the compiled few-token path
@pytest.mark.parametrize("layout", ["token_major", "feature_major"])
def test_linear_matches_a_float64_product(kernels, dtype, num_tokens, layout):
    rng = np.random.default_rng(num_tokens)
    weight = rng.standard_normal((4 * 37 + 3, 96)).astype(dtype)    # a ragged last tile of output rows
    x = rng.standard_normal((num_tokens, 96)).astype(dtype)
    out = np.full((num_tokens, weight.shape[0]), np.nan, dtype)
    if layout == "feature_major":
        x, out = feature_major(x), feature_major(out)
    kernels.linear(x, weight, out)
    expected = x.astype(np.float64) @ weight.astype(np.float64).T
    np.testing.assert_allclose(out, expected, rtol=10 * TOLERANCE[dtype], atol=10 * TOLERANCE[dtype])


# int8: affine (float weights rounded at load) and symmetric (Q8_0 as a GGUF stores it, no mins).
@pytest.mark.parametrize("fmt", ["int8", "int8_symmetric", "int4"])
@pytest.mark.parametrize("num_tokens", [1, 8, 9, 256])        # both sides of the packed-bytes path / BLAS tiles
# Rows: one, a few, a ragged tile, whole tiles, more than one buffer of tiles for BLAS.
@pytest.mark.parametrize("shape", [(1, 64), (3, 96), (17, 32), (256, 160), (600, 64)])
@pytest.mark.parametrize("layout", ["token_major", "feature_major"])
def test_quantized_linear_matches_the_dequantized_product(kernels, fmt, num_tokens, shape, layout):
    rng = np.random.default_rng(num_tokens)
    w = rng.standard_normal(shape).astype(np.float32)
    if fmt == "int8_symmetric":
        weight = tile(from_gguf(quants.quantize(w, GGMLQuantizationType.Q8_0), "Q8_0", shape))
        assert weight.mins is None
    else:
        weight = quantize(w, fmt)
    x = rng.standard_normal((num_tokens, shape[1])).astype(np.float32)
    out = np.full((num_tokens, shape[0]), np.nan, np.float32)
    if layout == "feature_major":
        x, out = feature_major(x), feature_major(out)
    kernels.linear(x, weight, out)
    expected = x.astype(np.float64) @ dequantize(weight).astype(np.float64).T
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def test_numpys_openblas_is_called_from_compiled_code_where_numpy_ships_it():
    """With numpy's PyPI wheels (scipy-openblas) the many-token quantized product must take the
    one-region sgemm route, not silently the slower np.matmul one."""
    blas_name = np.__config__.CONFIG["Build Dependencies"]["blas"]["name"]
    assert blas.AVAILABLE == (blas_name == "scipy-openblas"), blas_name


@pytest.mark.parametrize("fmt", ["int8", "int8_symmetric", "int4"])
@pytest.mark.parametrize("sgemm", [True, False])   # compiled code calling OpenBLAS, or np.matmul per batch of tiles
@pytest.mark.parametrize("shape", [(17, 32), (130, 96), (600, 64)])
@pytest.mark.parametrize("layout", ["token_major", "feature_major", "column_slice"])
def test_both_routes_of_the_many_token_quantized_product(monkeypatch, fmt, sgemm, shape, layout):
    if sgemm and not blas.AVAILABLE:
        pytest.skip(f"numpy's BLAS here is {np.__config__.CONFIG['Build Dependencies']['blas']['name']}")
    monkeypatch.setattr(blas, "AVAILABLE", sgemm)
    rng = np.random.default_rng(shape[0])
    w = rng.standard_normal(shape).astype(np.float32)
    if fmt == "int8_symmetric":
        weight = tile(from_gguf(quants.quantize(w, GGMLQuantizationType.Q8_0), "Q8_0", shape))
    else:
        weight = quantize(w, fmt)
    x = rng.standard_normal((20, shape[1])).astype(np.float32)
    if layout == "feature_major":
        x, out = feature_major(x), feature_major(np.full((20, shape[0]), np.nan, np.float32))
    elif layout == "column_slice":      # rows of the output further apart than its width
        out = np.full((20, shape[0] + 5), np.nan, np.float32)[:, 2:shape[0] + 2]
    else:
        out = np.full((20, shape[0]), np.nan, np.float32)
    get_kernels("numba").linear(x, weight, out)
    expected = x.astype(np.float64) @ dequantize(weight).astype(np.float64).T
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_matches_the_reference_in_place_on_strided_views(kernels, dtype):
    rng = np.random.default_rng(1)
    head_dim, max_positions = 64, 300
    angles = rng.uniform(0, 100, (max_positions, head_dim // 2))
    cos, sin = np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)
    positions = rng.integers(0, max_positions, 11)
    qkv, q, k, v = qkv_views(rng, 11, 9, 3, head_dim, dtype)
    expected_q, expected_k, untouched_v = q.copy(), k.copy(), v.copy()
    REFERENCE.rope(expected_q, positions, cos, sin)
    REFERENCE.rope(expected_k, positions, cos, sin)
    kernels.rope(q, positions, cos, sin)
    kernels.rope(k, positions, cos, sin)
    np.testing.assert_allclose(q, expected_q, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    np.testing.assert_allclose(k, expected_k, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    np.testing.assert_array_equal(v, untouched_v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softcap_bounds_logits_by_tanh(kernels, dtype):
    """Gemma 2's final-logit soft-cap, in place: cap * tanh(x / cap), so |x| < cap."""
    x = (100 * np.random.default_rng(3).standard_normal((4, 50))).astype(dtype)
    want = 30.0 * np.tanh(x.astype(np.float64) / 30.0)
    kernels.softcap(x, 30.0)
    np.testing.assert_allclose(x, want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype] * 30)
    assert np.abs(x).max() <= 30.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 5, 150])   # numba: one thread in chunks of rows, and in parallel
@pytest.mark.parametrize("layout", ["token_major", "feature_major"])
def test_silu_and_mul_matches_the_reference(kernels, dtype, num_tokens, layout):
    rng = np.random.default_rng(2)
    gate_up = (10 * rng.standard_normal((num_tokens, 2 * 96))).astype(dtype)
    gate_up[0, :3] = [-1000.0, 1000.0, 0.0]                         # exp(1000) overflows to inf: -0
    expected, out = np.empty((num_tokens, 96), dtype), np.full((num_tokens, 96), np.nan, dtype)
    if layout == "feature_major":
        gate_up, out = feature_major(gate_up), feature_major(out)
    REFERENCE.silu_and_mul(gate_up, expected)
    kernels.silu_and_mul(gate_up, out)
    np.testing.assert_allclose(out, expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    gate, up = gate_up[:, :96].astype(np.float64), gate_up[:, 96:].astype(np.float64)
    with np.errstate(over="ignore"):
        np.testing.assert_allclose(out, gate / (1 + np.exp(-gate)) * up, rtol=1e-4, atol=1e-4)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """transformers' gelu_pytorch_tanh, in float64."""
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 5, 40])   # both sides of the compiled few-token path
@pytest.mark.parametrize("layout", ["token_major", "feature_major"])
def test_gelu_tanh_and_mul_matches_the_reference(kernels, dtype, num_tokens, layout):
    rng = np.random.default_rng(num_tokens)
    gate_up = (3 * rng.standard_normal((num_tokens, 2 * 96))).astype(dtype)
    gate_up[0, :4] = [-1000.0, 1000.0, 0.0, -3.0]                   # saturated both ways, the origin
    expected, out = np.empty((num_tokens, 96), dtype), np.full((num_tokens, 96), np.nan, dtype)
    if layout == "feature_major":
        gate_up, out = feature_major(gate_up), feature_major(out)
    REFERENCE.gelu_tanh_and_mul(gate_up, expected)
    kernels.gelu_tanh_and_mul(gate_up, out)
    np.testing.assert_allclose(out, expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    gate, up = gate_up[:, :96].astype(np.float64), gate_up[:, 96:].astype(np.float64)
    with np.errstate(over="ignore"):
        np.testing.assert_allclose(out, gelu_tanh(gate) * up, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_from_strided_views(kernels, dtype):
    rng = np.random.default_rng(3)
    _, _, k, v = qkv_views(rng, 6, 9, 3, 64, dtype)
    k_cache, v_cache = np.zeros((40, 3, 64), dtype), np.zeros((40, 3, 64), dtype)
    slots = np.array([33, 2, 17, 16, 5, 39])
    kernels.write_kv(k_cache, v_cache, k, v, slots)
    np.testing.assert_array_equal(k_cache[slots], k)
    np.testing.assert_array_equal(v_cache[slots], v)
    assert np.count_nonzero(k_cache.any(axis=(1, 2))) == len(slots)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_and_write_kv_is_rope_then_the_rotated_keys_written(kernels, dtype):
    """The fused op (one Triton kernel on torch): queries and keys rotated in place as rope's, the
    cache's slots holding exactly the rotated keys and the values, no other slot touched."""
    rng = np.random.default_rng(5)
    head_dim, max_positions, tokens = 64, 300, 6
    angles = rng.uniform(0, 100, (max_positions, head_dim // 2))
    cos, sin = np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)
    positions = rng.integers(0, max_positions, tokens)
    qkv, _, _, v = qkv_views(rng, tokens, 9, 3, head_dim, dtype)
    qk = qkv[:, :12 * head_dim].reshape(tokens, 12, head_dim)
    expected, untouched_v = qk.copy(), v.copy()
    REFERENCE.rope(expected, positions, cos, sin)
    k_cache, v_cache = np.zeros((40, 3, head_dim), dtype), np.zeros((40, 3, head_dim), dtype)
    slots = np.array([33, 2, 17, 16, 5, 39])
    kernels.rope_and_write_kv(qk, v, positions, cos, sin, k_cache, v_cache, slots)
    np.testing.assert_allclose(qk, expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    np.testing.assert_array_equal(k_cache[slots], qk[:, 9:])
    np.testing.assert_array_equal(v_cache[slots], v)
    np.testing.assert_array_equal(v, untouched_v)
    assert np.count_nonzero(k_cache.any(axis=(1, 2))) == np.count_nonzero(v_cache.any(axis=(1, 2))) == len(slots)


BATCH = [(1, 700), (200, 200), (1, 1), (37, 300), (1, 129), (16, 16), (4, 515), (130, 650)]


# Decodes whose contexts end just before, at and after DECODE_PART keys and span several parts, and
# on either side of the slack a last part takes in (one part up to DECODE_PART + DECODE_PART_SLACK).
DECODES = [(1, DECODE_PART - 1), (1, DECODE_PART), (1, DECODE_PART + 1), (1, 3 * DECODE_PART + 17),
           (1, DECODE_PART + DECODE_PART_SLACK), (1, DECODE_PART + DECODE_PART_SLACK + 1), (1, 2 * DECODE_PART + 1)]


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("shapes,bs", [(BATCH, 16), ([(1, 700)], 16), ([(5, 333)], 16), (DECODES, 16), (DECODES, 7)],
                         ids=["batch", "one_decode", "one_chunk", "decode_parts", "parts_inside_blocks"])
def test_paged_attention_matches_the_reference_at_model_scale(kernels, group, shapes, bs):
    """SmolLM2's head size, a ragged batch of decodes and prefill chunks over contexts up to 700
    tokens, block tables shuffled across the pool, float32: within 1e-5 of the reference; a lone
    sequence, decoding or in a short chunk (one user); and decodes split into parts of
    DECODE_PART keys by the compiled kernel, with part boundaries on and inside blocks."""
    rng = np.random.default_rng(group)
    kv_heads, head_dim = 3, 64
    num_blocks = sum(-(-seq_len // bs) for _, seq_len in shapes) + 3
    pool = rng.permutation(num_blocks).tolist()
    tables = []
    for _, seq_len in shapes:
        n = -(-seq_len // bs)
        tables.append(pool[:n])
        pool = pool[n:]
    k_cache = rng.standard_normal((num_blocks * bs, kv_heads, head_dim)).astype(np.float32)
    v_cache = rng.standard_normal((num_blocks * bs, kv_heads, head_dim)).astype(np.float32)
    meta = build_metadata([q for q, _ in shapes], [s for _, s in shapes], tables, bs)
    num_tokens = sum(q for q, _ in shapes)
    _, q, _, _ = qkv_views(rng, num_tokens, group * kv_heads, kv_heads, head_dim, np.float32)
    expected = np.empty(q.shape, np.float32)
    REFERENCE.paged_attention(q, k_cache, v_cache, meta, expected)
    out = np.full(q.shape, np.nan, np.float32)
    kernels.paged_attention(q, k_cache, v_cache, meta, out)
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-5)


def test_backend_is_chosen_by_name_or_environment(monkeypatch):
    monkeypatch.delenv("VLLMLITE_KERNELS", raising=False)
    assert resolve_backend() == "numba"
    monkeypatch.setenv("VLLMLITE_KERNELS", "numpy")   # read by EngineArgs alone, into the engine's config
    backend = EngineArgs(model="random").create_engine_config().kernel_backend
    assert backend == "numpy" and get_kernels(backend) is REFERENCE
    assert resolve_backend("numba") == "numba"
    with pytest.raises(ValueError, match="kernels must be one of"):
        resolve_backend("cuda")
    assert set(BACKENDS) == {"numba", "numpy"}


def test_every_numba_kernel_divides_as_numpy_does():
    """The numba kernels compile with numpy's error model (kernels/numba/jit.py): under numba's
    default every division tests its divisor for zero to raise, and that branch kept LLVM from
    vectorizing the loops that divide (SiLU's ran scalar, about 3-6x slower)."""
    package = numba_package.__name__
    kernels = {f"{info.name}.{name}": f for info in pkgutil.iter_modules(numba_package.__path__)
               for name, f in vars(importlib.import_module(f"{package}.{info.name}")).items()
               if isinstance(f, CPUDispatcher) and f.py_func.__module__.startswith(package)}
    assert len(kernels) > 20
    assert {name for name, f in kernels.items() if f.targetoptions.get("error_model") != "numpy"} == set()


WARM_UP_COVERAGE = """
import vllmlite
from vllmlite import LLM, SamplingParams
from vllmlite.kernels.numba import attention, elementwise, int_linear, linear
from numba.core.registry import CPUDispatcher

def signatures():
    return {f"{m.__name__}.{name}": len(f.signatures) for m in (attention, elementwise, int_linear, linear)
            for name, f in vars(m).items() if isinstance(f, CPUDispatcher)}

llm = LLM("random", quantization=QUANTIZATION, int_dot=INT_DOT, max_num_batched_tokens=32)   # warms up
after_warm_up = signatures()
greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
llm.generate([{"prompt_token_ids": [1, 2, 3]}], greedy)             # one user: single-token decodes
llm.generate([{"prompt_token_ids": [4, 5]}, {"prompt_token_ids": list(range(7, 90))}],
             greedy)                                                # two at once, a chunked long prompt
new = {name: n for name, n in signatures().items() if n != after_warm_up[name]}
assert not new, f"compiled after warm-up: {new}"
"""


@pytest.mark.parametrize("quantization, int_dot", [("none", False), ("int4", False), ("int4", True)])
def test_warm_up_compiles_every_kernel_signature_requests_use(quantization, int_dot):
    """A kernel first compiled during a request stalls it for seconds (a single user's first
    decode paid ~8 s when warm-up missed the one-token layouts). In a fresh process, nothing may
    compile after the engine's warm-up."""
    script = f"QUANTIZATION = {quantization!r}\nINT_DOT = {int_dot!r}\n" + WARM_UP_COVERAGE
    env = {k: v for k, v in os.environ.items() if k != "VLLMLITE_KERNELS"}   # the compiled default
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_an_engine_shorter_than_the_warm_up_prompt_starts_and_generates(backend, tiny_model):
    """warm_up runs a 20-token prompt whatever max_model_len is: the rotary tables must reach it
    (they were sized max_model_len, so numpy raised IndexError and numba read past them)."""
    engine = engine_on(tiny_model, max_model_len=8, kernels=backend)
    [output] = run_to_completion(engine, [([1, 2, 3], greedy(4))])
    assert len(output.outputs[0].token_ids) == 4
