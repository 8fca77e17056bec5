"""The invariance suite again on the torch kernels (CPU, float64 like the numpy path): paging,
chunking, prefix caching, batching, preemption and arrival order change no greedy token there
either, and every token equals the dense reference's."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from conftest import engine_on
from test_engine_invariance import *  # noqa: F403  (the same tests, collected again here)


@pytest.fixture
def make_engine(tiny_model):
    def factory(**overrides):
        return engine_on(tiny_model, **{"kernels": "torch", **overrides})
    return factory
