"""Routing at its edges: the key of a prompt of exactly one block, and the load bound computed over
healthy replicas only, against hand-computed values."""

import pytest

from vllmlite.api.ray.routing import load_capacity, routing_key
from vllmlite.core.block import block_key

BS = 4


def test_a_prompt_of_exactly_one_block_has_that_blocks_key():
    """A prompt of block_size tokens fills its first block: it is keyed (not routed by load alone),
    with the key a longer prompt sharing that block gets."""
    prompt = [11, 12, 13, 14]
    assert routing_key(prompt, BS) == block_key(None, prompt, ())
    assert routing_key(prompt, BS) == routing_key(prompt + [99, 98], BS)
    assert routing_key(prompt[:-1], BS) is None


@pytest.mark.parametrize(("cost", "expected"), [
    # healthy loads [3, 1]: 1.5 * (3 + 1 + 1) / 2 = 3.75, rounded up to a whole request -> 4
    (1.0, 4.0),
    # 1.5 * (3 + 1 + 2) / 2 = 4.5, rounded up to a multiple of the cost 2 -> 6
    (2.0, 6.0),
])
def test_load_capacity_counts_only_healthy_replicas(cost, expected):
    """The unhealthy replica's load (100) and its seat in the mean are both left out."""
    loads, healthy = [3.0, 100.0, 1.0], [True, False, True]
    assert load_capacity(loads, healthy, epsilon=0.5, cost=cost) == expected


def test_load_capacity_never_goes_below_min_capacity():
    assert load_capacity([0.0, 0.0], [True, False], epsilon=0.1, min_capacity=5.0) == 5.0
