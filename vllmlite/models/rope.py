"""Rotary position embeddings: inverse frequencies (with their scalings) and the cos/sin tables
the `rope` kernel reads. Knows nothing of layers or kernels beyond the tables' shape."""

from __future__ import annotations

import numpy as np

from vllmlite.config import ModelConfig


def rope_inv_freq(config: ModelConfig, freq_factors: np.ndarray | None = None,
                  theta: float | None = None) -> np.ndarray:
    """Rotary inverse frequencies [rotary_dim / 2] for base `theta` (default the config's), with
    linear or llama3 scaling when configured."""
    d = config.rotary_dim
    theta = config.rope_theta if theta is None else theta
    inv_freq = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    if freq_factors is not None:
        return inv_freq / freq_factors.astype(np.float64)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: long wavelengths are divided by `factor`, short ones kept, the middle interpolated.
    old_len = scaling.original_max_position_embeddings
    wavelen = 2 * np.pi / inv_freq
    scaled = np.where(wavelen > old_len / scaling.low_freq_factor, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= old_len / scaling.high_freq_factor) & (wavelen <= old_len / scaling.low_freq_factor)
    return np.where(is_medium, smoothed, scaled)


def rope_tables(inv_freq: np.ndarray, num_positions: int, attention_factor: float = 1.0
                ) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin), each [num_positions, rotary_dim / 2] in float64. attention_factor scales both, as
    HF scales its cos/sin (longrope's magnitude correction)."""
    angles = np.outer(np.arange(num_positions, dtype=np.float64), inv_freq)  # [positions, rotary_dim/2]
    return np.cos(angles) * attention_factor, np.sin(angles) * attention_factor
