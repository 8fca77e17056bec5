"""Integer dot products on quantized weights (llama.cpp's way): the activations rounded to 8 bits
per block of 32, each block's product summed in int32, the scales applied once per block. The
numpy definition here is the contract the compiled kernels (vllmlite/kernels/numba/int_linear.py)
meet; knows nothing of the model.

Activations, like Q8_0 (scale kept in float32, where llama.cpp stores float16):

    d_x = max |x_block| / 127,   q_x = round(x_block / d_x) in [-127, 127]   (d_x = 0: q_x = 0)

A weight block w = d_w * q_w + m_w (m_w = 0 for symmetric int8) times that block of x is then

    d_w * d_x * sum(q_w * q_x)  +  m_w * d_x * sum(q_x)

where both sums are integers: the second uses the rounded x too, so the float form here and the
integer form of the kernels are the same function, up to float32 summation order.
"""

from __future__ import annotations

import numpy as np

from vllmlite.kernels.quant import BLOCK, QuantizedMatrix, unpack_nibbles, untile

Q_MAX = np.float32(127)


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [tokens, in] -> q int8 [tokens, in], scales float32 [tokens, in / 32].

    >>> q, d = quantize_activations(np.array([[0.5, -1.0] + [0.0] * 30], np.float32))
    >>> q[0, :3].tolist(), d.tolist() == [[np.float32(1.0) / 127]]
    ([64, -127, 0], True)
    """
    num_tokens, cols = x.shape
    blocks = x.astype(np.float32).reshape(num_tokens, cols // BLOCK, BLOCK)   # [tokens, blocks, 32]
    scales = np.abs(blocks).max(axis=-1) / Q_MAX                            # [tokens, blocks]
    divisor = np.where(scales == 0, np.float32(1), scales)[..., None]
    q = np.clip(np.rint(blocks / divisor), -127, 127).astype(np.int8)
    return q.reshape(num_tokens, cols), scales


def weight_integers(weight: QuantizedMatrix) -> np.ndarray:
    """The weight's integers q_w, int32 [rows, blocks, 32] (int4's nibbles unpacked)."""
    rows = untile(weight)
    return (unpack_nibbles(rows.qs) if weight.format == "int4" else rows.qs).astype(np.int32)


def int_dot_linear(x: np.ndarray, weight: QuantizedMatrix) -> np.ndarray:
    """out [tokens, rows] = x [tokens, in] times `weight` [rows, in] with 8-bit activations, as
    the module docstring defines it."""
    num_tokens, cols = x.shape
    q_x, d_x = quantize_activations(x)
    q_x = q_x.reshape(num_tokens, cols // BLOCK, BLOCK).astype(np.int32)   # [tokens, blocks, 32]; none too
    rows = untile(weight)
    dots = np.einsum("rbj,tbj->trb", weight_integers(weight), q_x)        # int32 [tokens, rows, blocks]
    terms = rows.scales[None] * (d_x[:, None, :] * dots.astype(np.float32))  # [tokens, rows, blocks]
    if rows.mins is not None:
        x_sums = q_x.sum(axis=-1).astype(np.float32)                         # [tokens, blocks]
        terms += rows.mins[None] * (d_x * x_sums)[:, None, :]
    return terms.sum(axis=-1, dtype=np.float32)
