"""A MoE layer's routing, as transformers routes (Mixtral, Qwen3-MoE, OLMoE), and the routed
experts until the kernels provide `moe`. Knows nothing of layers or files."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from vllmlite.kernels import reference


class Routing(NamedTuple):
    expert_ids: np.ndarray       # [tokens, top_k] int64, the most probable expert first
    expert_weights: np.ndarray   # [tokens, top_k] in the router logits' dtype


def route(router_logits: np.ndarray, top_k: int, normalize: bool) -> Routing:
    """Softmax over the experts in float32 (transformers' `softmax(..., dtype=torch.float)`, whatever
    the model's dtype), the top_k most probable, renormalized to sum to 1 when `normalize`, cast to
    the logits' dtype. Among equal probabilities the lower expert id first.
    Example: logits [[0, 2, 1]], top_k 2, normalize -> experts [[1, 2]], weights [[0.731, 0.269]]."""
    logits = np.asarray(router_logits, dtype=np.float32)                       # [tokens, experts]
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    expert_ids = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]         # [tokens, top_k]
    weights = np.take_along_axis(probs, expert_ids, axis=-1)
    if normalize:
        weights /= weights.sum(axis=-1, keepdims=True)
    return Routing(expert_ids.astype(np.int64), weights.astype(router_logits.dtype))


def moe(x: np.ndarray, expert_ids: np.ndarray, expert_weights: np.ndarray, w_gate_up: np.ndarray,
        w_down: np.ndarray, out: np.ndarray, activation: str = "silu") -> None:
    """out[t] = sum over k of expert_weights[t, k] * down_e(act(gate_e(x[t])) * up_e(x[t])),
    e = expert_ids[t, k]; each expert runs once on the tokens routed to it."""
    act_and_mul = getattr(reference, f"{activation}_and_mul")
    out[...] = 0
    for e in np.unique(expert_ids):
        tokens, slots = np.nonzero(expert_ids == e)                       # the (token, k) pairs routed to e
        act = np.empty((len(tokens), w_down.shape[2]), dtype=x.dtype)     # [n, inter]
        act_and_mul(x[tokens] @ w_gate_up[e].T, act)
        np.add.at(out, tokens, expert_weights[tokens, slots, None] * (act @ w_down[e].T))


def moe_on_host(kernels):
    """`moe` for a backend without one: the operands copied to the host, the result written back."""
    def run(x, expert_ids, expert_weights, w_gate_up, w_down, out, activation: str = "silu") -> None:
        host = kernels.to_numpy
        result = np.empty_like(host(out))                                 # [tokens, hidden]
        moe(host(x), host(expert_ids), host(expert_weights), host(w_gate_up), host(w_down), result, activation)
        out[...] = kernels.to_device(result)
    return run
