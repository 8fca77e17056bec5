"""Which replica serves a request: prefix-aware (consistent hashing with bounded loads), round robin,
least loaded. Pure Python, no Ray.

Owns the routing policies (their names are api/routing_policy.py's) and a prompt's routing key (the
prefix-cache key of its first block, engine.client.first_block_key). Knows nothing of Ray, HTTP or
engines: replicas are indices, loads are counts.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

from vllmlite.api.routing_policy import RoutingPolicy
from vllmlite.engine.client import first_block_key


def routing_key(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None) -> bytes | None:
    """The prefix-cache key of the prompt's first full block (exactly the key the block manager
    publishes it under), or None for a prompt shorter than a block: such a prompt can share no cached
    block, so it is routed by load alone.

    >>> routing_key([1, 2, 3], 4) is None, routing_key([1, 2, 3, 4, 5], 4) == routing_key([1, 2, 3, 4, 9], 4)
    (True, True)
    """
    return first_block_key(token_ids, block_size, cache_salt)


def _score(key: bytes, replica: int) -> bytes:
    return hashlib.sha256(key + replica.to_bytes(4, "little")).digest()


def preference_order(key: bytes, num_replicas: int) -> list[int]:
    """Replicas in rendezvous-hashing order for `key` (highest random weight first).

    Consistent: removing a replica moves only the keys whose first choice it was, each to its own
    second choice; the relative order of the others never changes.
    """
    return sorted(range(num_replicas), key=lambda r: _score(key, r), reverse=True)


# What an output token costs a replica against a prompt token. A prompt token is one row of a
# prefill step's matrix products; an output token is a row of a decode step, which also rereads the
# weights and the sequence's KV once per token, so on a CPU it costs several prompt tokens' time.
# The simulator (bench/route_sim.py) serves an output token in 4 prompt tokens' time; the routing
# balance there holds within 1.25x for service at 2x or 8x (docs/ray.md).
DECODE_WEIGHT = 4.0


def request_cost(num_prompt_tokens: int, num_cached_tokens: int = 0, num_output_tokens: int = 0) -> float:
    """The work a request brings its replica, in prompt tokens: the prompt tokens it must prefill
    (those not already in that replica's prefix cache) plus its output tokens x DECODE_WEIGHT.

    >>> request_cost(1000, num_cached_tokens=960, num_output_tokens=10)
    80.0
    """
    return float(max(num_prompt_tokens - num_cached_tokens, 0) + DECODE_WEIGHT * num_output_tokens)


def load_capacity(loads: Sequence[float], healthy: Sequence[bool], epsilon: float, cost: float = 1.0,
                  min_capacity: float = 0.0) -> float:
    """Most load a healthy replica may hold after taking a new request of `cost`: (1+eps) x the mean
    load with the new request included, as in Mirrokni et al.'s consistent hashing with bounded loads
    (loads may be request counts, cost 1, or work), rounded up to a whole number of such requests
    (so an empty cluster takes one anywhere), but never below `min_capacity`.
    Worked example, counts: loads [3, 0, 1], eps 0.25 -> 1.25 * (4 + 1) / 3 = 2.08, so the replica
    holding 3 is full and the next one in the key's order gets the request.
    """
    live = [load for load, ok in zip(loads, healthy) if ok]
    bound = (1 + epsilon) * (sum(live) + cost) / max(len(live), 1)
    return max(min_capacity, math.ceil(bound / cost) * cost if cost > 0 else bound)


class Router:
    """Picks a replica per request under one policy; unhealthy replicas are never chosen.

    `choose(key, loads, healthy, cost)`: `loads[i]` is replica i's in-flight load (the costs of its
    requests not yet finished), `healthy[i]` whether it may take one, `cost` the new request's
    load, or per replica (`cost[i]`: `request_cost` less what replica i likely has cached).

    Prefix-aware walks `key`'s rendezvous order and takes the first healthy replica within two
    bounds (consistent hashing with bounded loads):
    - its *recent work*, the costs routed to it lately (a sum decayed by half every `half_life`
      requests per replica), stays within (1 + `epsilon`) x the mean: this is what spreads a hot
      prefix over its first few choices, each of which then caches it, and keeps the long-run
      balance. It is waived for a replica with nothing in flight: an idle replica keeps its
      prefixes, whatever its share.
    - its in-flight load stays within (1 + `burst_epsilon`) x the mean: no pile-up on one replica
      in a burst.
    Bounding the smoothed share rather than only the instantaneous load is what keeps a prefix on
    the same few replicas: in-flight loads are a handful of requests and swing with every arrival,
    so a tight bound on them sends a prefix to a different replica at every swing (and evicts the
    tenants cached there); see docs/ray.md for the simulated difference.
    A key of None (a prompt shorter than a block) goes to the least loaded. Raises NoReplicaError
    when no replica is healthy.
    """

    def __init__(self, policy: RoutingPolicy | str, epsilon: float = 0.1, burst_epsilon: float = 2.0,
                 half_life: float = 50.0, min_capacity: float = 0.0) -> None:
        self.policy = RoutingPolicy(policy)
        self.epsilon = epsilon
        self.burst_epsilon = burst_epsilon
        self.half_life = half_life
        self.min_capacity = min_capacity
        self.recent: list[float] = []  # per replica: the decayed sum of the costs routed to it
        self._next = 0  # round robin's cursor

    def choose(self, key: bytes | None, loads: Sequence[float], healthy: Sequence[bool],
               cost: float | Sequence[float] = 1.0) -> int:
        live = [i for i, ok in enumerate(healthy) if ok]
        if not live:
            raise NoReplicaError("no replica is healthy")
        costs = [float(cost)] * len(loads) if isinstance(cost, (int, float)) else list(cost)
        if len(self.recent) != len(healthy):  # the first request, or the replica count changed
            self.recent = (self.recent + [0.0] * len(healthy))[:len(healthy)]
        if self.policy is RoutingPolicy.ROUND_ROBIN:
            chosen = self._round_robin(len(healthy), healthy)
        elif self.policy is RoutingPolicy.LEAST_LOADED or key is None:
            chosen = min(live, key=lambda i: (loads[i], i))
        else:
            chosen = self._prefix_aware(key, loads, healthy, costs)
        decay = 0.5 ** (1.0 / (self.half_life * len(live)))
        self.recent = [work * decay for work in self.recent]
        self.recent[chosen] += costs[chosen]
        return chosen

    def _prefix_aware(self, key: bytes, loads: Sequence[float], healthy: Sequence[bool],
                      costs: Sequence[float]) -> int:
        recent = self.recent
        for replica in preference_order(key, len(healthy)):
            if not healthy[replica]:
                continue
            cost = costs[replica]
            share_ok = loads[replica] <= 0 or \
                recent[replica] + cost <= load_capacity(recent, healthy, self.epsilon, cost, self.min_capacity)
            if share_ok and loads[replica] + cost <= load_capacity(loads, healthy, self.burst_epsilon, cost,
                                                                    self.min_capacity):
                return replica
        # None within both bounds: the least loaded (of those, the one with least recent work).
        return min((i for i, ok in enumerate(healthy) if ok), key=lambda i: (loads[i], recent[i], i))

    def _round_robin(self, num_replicas: int, healthy: Sequence[bool]) -> int:
        for _ in range(num_replicas):
            replica = self._next % num_replicas
            self._next = replica + 1
            if healthy[replica]:
                return replica
        raise NoReplicaError("no replica is healthy")


class NoReplicaError(RuntimeError):
    """Every replica is down (dead or restarting)."""
