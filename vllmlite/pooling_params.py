"""PoolingParams: how an embedding request wants its prompt's hidden states pooled (vLLM's name).

Owns the pooling types, the per-request knobs and `finish_embedding`, the last step from the pooled
final-norm hidden states to the embedding. Knows nothing of requests, blocks or the model.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

import numpy as np


class PoolingType(str, enum.Enum):
    """Which final-norm hidden states make the embedding (llama-server's `--pooling`)."""

    LAST = "last"   # the prompt's last position
    MEAN = "mean"   # the average over every prompt position


@dataclass
class PoolingParams:
    """An embedding request's knobs; the pooling type is the engine's (EngineArgs.pooling).

    `normalize`: divide the pooled vector by its L2 norm (vLLM's and llama-server's default).
    """

    normalize: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a boolean, got {self.normalize!r}")

    def clone(self) -> PoolingParams:
        """An independent copy, validated again (fields may have been assigned since construction)."""
        return dataclasses.replace(self)


def finish_embedding(pooled: np.ndarray, num_tokens: int, pooling: PoolingType, normalize: bool) -> list[float]:
    """The embedding from `pooled` [hidden]: the last row, or the sum of all `num_tokens` rows (mean).

    >>> finish_embedding(np.array([3.0, 4.0]), 1, PoolingType.LAST, True)
    [0.6, 0.8]
    >>> finish_embedding(np.array([2.0, 4.0]), 2, PoolingType.MEAN, False)
    [1.0, 2.0]
    """
    vector = pooled / num_tokens if pooling is PoolingType.MEAN else pooled
    if normalize:
        vector = vector / max(float(np.linalg.norm(vector)), 1e-12)  # a zero vector stays zero
    return vector.tolist()
