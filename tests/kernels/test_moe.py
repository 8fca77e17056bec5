"""Routed experts (`moe`) on every backend against a dense loop over tokens and their experts, and
`route` against transformers' routing written in torch: top_k 1, 2 and 8, experts with no token,
one token and many, both activation layouts, both activations; unsupported operands refused."""

from __future__ import annotations

import numpy as np
import pytest

from vllmlite.kernels import get_kernels, reference
from vllmlite.kernels.quant import quantize
from vllmlite.kernels.reference import route

TOLERANCE = {np.float32: 1e-5, np.float64: 1e-12}
ACTIVATIONS = {"silu": lambda g: g / (1 + np.exp(-g)),
               "gelu_tanh": lambda g: 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))}


def dense_moe(x, expert_ids, expert_weights, w_gate_up, w_down, activation):
    """One token and one of its experts at a time, in float64."""
    x, w_gate_up, w_down = (a.astype(np.float64) for a in (x, w_gate_up, w_down))
    inter = w_down.shape[2]
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for e, weight in zip(expert_ids[t], expert_weights[t]):
            gate_up = w_gate_up[e] @ x[t]
            out[t] += weight * (w_down[e] @ (ACTIVATIONS[activation](gate_up[:inter]) * gate_up[inter:]))
    return out


def feature_major(rows: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(rows.T).T


def make_moe(num_tokens, num_experts, top_k, hidden, inter, dtype, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((num_tokens, hidden)).astype(dtype)
    w_gate_up = (rng.standard_normal((num_experts, 2 * inter, hidden)) / np.sqrt(hidden)).astype(dtype)
    w_down = (rng.standard_normal((num_experts, hidden, inter)) / np.sqrt(inter)).astype(dtype)
    # Experts 0 and 1 never routed to (logits far below), so some experts have no tokens at every size.
    logits = rng.standard_normal((num_tokens, num_experts)).astype(np.float32)
    logits[:, :2] -= 100
    routing = route(logits, top_k, normalize=True)
    return x, routing.expert_ids, routing.expert_weights, w_gate_up, w_down


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("top_k, num_experts", [(1, 4), (2, 8), (8, 12)])
@pytest.mark.parametrize("num_tokens", [1, 5, 40])   # one token; few per expert; more than linear's skinny path
@pytest.mark.parametrize("layout", ["token_major", "feature_major"])
def test_moe_matches_a_dense_loop_over_tokens_and_experts(kernels, dtype, top_k, num_experts, num_tokens, layout):
    x, expert_ids, expert_weights, w_gate_up, w_down = make_moe(num_tokens, num_experts, top_k, 48, 24, dtype,
                                                                seed=num_tokens * 10 + top_k)
    assert not np.isin([0, 1], expert_ids).any()           # experts with no tokens
    expected = dense_moe(x, expert_ids, expert_weights, w_gate_up, w_down, "silu")
    out = np.full(x.shape, np.nan, dtype)
    if layout == "feature_major":
        x, out = feature_major(x), feature_major(out)
    kernels.moe(x, expert_ids, expert_weights, w_gate_up, w_down, out)
    np.testing.assert_allclose(out, expected, rtol=10 * TOLERANCE[dtype], atol=10 * TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_moe_with_gelu_experts_many_tokens_and_unnormalized_weights(kernels, dtype):
    rng = np.random.default_rng(3)
    x, _, _, w_gate_up, w_down = make_moe(300, 6, 2, 32, 16, dtype, seed=3)
    expert_ids = rng.integers(0, 6, (300, 2))
    expert_ids[:, 1] = (expert_ids[:, 0] + 1 + rng.integers(0, 5, 300)) % 6       # distinct per token
    expert_weights = rng.uniform(0, 1, (300, 2)).astype(np.float32)
    expected = dense_moe(x, expert_ids, expert_weights, w_gate_up, w_down, "gelu_tanh")
    out = np.full(x.shape, np.nan, dtype)
    kernels.moe(x, expert_ids, expert_weights, w_gate_up, w_down, out, activation="gelu_tanh")
    np.testing.assert_allclose(out, expected, rtol=10 * TOLERANCE[dtype], atol=10 * TOLERANCE[dtype])


@pytest.mark.parametrize("backend", ["numpy", "numba", "torch"])
def test_unsupported_moe_operands_are_refused(backend):
    if backend == "torch":
        pytest.importorskip("torch")
        from vllmlite.kernels.torch import TorchKernels
        kernels = TorchKernels("cpu")
    else:
        kernels = get_kernels(backend)
    x, expert_ids, expert_weights, w_gate_up, w_down = make_moe(3, 4, 2, 32, 32, np.float32, seed=0)
    out = np.zeros_like(x)
    if backend == "torch":
        x, expert_ids, expert_weights, w_gate_up, w_down, out = (
            kernels.to_device(a) for a in (x, expert_ids, expert_weights, w_gate_up, w_down, out))
    with pytest.raises(ValueError, match=r"activation must be one of \['gelu_tanh', 'silu'\]"):
        kernels.moe(x, expert_ids, expert_weights, w_gate_up, w_down, out, activation="relu")
    with pytest.raises(NotImplementedError, match="quantized expert weights are not supported"):
        kernels.moe(x, expert_ids, expert_weights, quantize(np.ones((64, 32), np.float32), "int8"), w_down, out)
    with pytest.raises(ValueError, match="disagree"):
        kernels.moe(x, expert_ids, expert_weights, w_gate_up, w_down[:, :, :8], out)
    with pytest.raises(ValueError, match="expert ids must lie in 0 .. 3"):
        kernels.moe(x, expert_ids + 3, expert_weights, w_gate_up, w_down, out)


def transformers_routing(torch, logits: np.ndarray, top_k: int, normalize: bool):
    """transformers' Mixtral/Qwen3-MoE/OLMoE sparse block's routing, line for line."""
    router_logits = torch.from_numpy(logits)
    routing_weights = torch.nn.functional.softmax(router_logits, dim=1, dtype=torch.float)
    routing_weights, selected_experts = torch.topk(routing_weights, top_k, dim=-1)
    if normalize:
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
    return selected_experts.numpy(), routing_weights.to(router_logits.dtype).numpy()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("top_k, num_experts", [(1, 4), (2, 8), (8, 64), (4, 60)])
@pytest.mark.parametrize("normalize", [True, False])
def test_route_matches_transformers(dtype, top_k, num_experts, normalize):
    torch = pytest.importorskip("torch")
    logits = (3 * np.random.default_rng(top_k).standard_normal((50, num_experts))).astype(dtype)
    expected_ids, expected_weights = transformers_routing(torch, logits, top_k, normalize)
    routing = route(logits, top_k, normalize)
    np.testing.assert_array_equal(routing.expert_ids, expected_ids)
    assert routing.expert_weights.dtype == dtype
    np.testing.assert_allclose(routing.expert_weights, expected_weights, rtol=1e-6, atol=0)


def test_route_breaks_ties_towards_the_lower_expert():
    """Equal probabilities (equal logits): the lower expert id first, as documented."""
    routing = route(np.array([[1.0, 3.0, 3.0, 0.0, 3.0]], np.float32), 2, normalize=True)
    assert routing.expert_ids.tolist() == [[1, 2]]
    np.testing.assert_allclose(routing.expert_weights, [[0.5, 0.5]])
    assert reference.route(np.array([[0.0, 2.0, 1.0]]), 2, True).expert_ids.tolist() == [[1, 2]]  # the docstring's
