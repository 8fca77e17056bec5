"""Which replica serves a request: prefix-aware (consistent hashing with bounded loads), round robin,
least loaded. Pure Python, no Ray.

Owns the routing policies and a prompt's routing key (the prefix-cache key of its first block, as the
block manager makes it). Knows nothing of Ray, HTTP or engines: replicas are indices, loads are counts.
"""

from __future__ import annotations

import enum
import hashlib
import math
from collections.abc import Sequence

from vllmlite.block import block_key


class RoutingPolicy(str, enum.Enum):
    PREFIX_AWARE = "prefix_aware"
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"


def routing_key(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None) -> bytes | None:
    """The prefix-cache key of the prompt's first full block (`block_key(None, first block, salt)`,
    exactly the key the block manager publishes it under), or None for a prompt shorter than a block:
    such a prompt can share no cached block, so it is routed by load alone.

    >>> routing_key([1, 2, 3], 4) is None, routing_key([1, 2, 3, 4, 5], 4) == routing_key([1, 2, 3, 4, 9], 4)
    (True, True)
    """
    if len(token_ids) < block_size:
        return None
    return block_key(None, list(token_ids[:block_size]), () if cache_salt is None else (cache_salt,))


def _score(key: bytes, replica: int) -> bytes:
    return hashlib.sha256(key + replica.to_bytes(4, "little")).digest()


def preference_order(key: bytes, num_replicas: int) -> list[int]:
    """Replicas in rendezvous-hashing order for `key` (highest random weight first).

    Consistent: removing a replica moves only the keys whose first choice it was, each to its own
    second choice; the relative order of the others never changes.
    """
    return sorted(range(num_replicas), key=lambda r: _score(key, r), reverse=True)


def load_capacity(loads: Sequence[float], healthy: Sequence[bool], epsilon: float, cost: float = 1.0,
                  min_capacity: float = 0.0) -> float:
    """Most load a healthy replica may hold after taking a new request of `cost`: (1+eps) x the mean
    load with the new request included, as in Mirrokni et al.'s consistent hashing with bounded loads
    (loads may be request counts, cost 1, or tokens), but never below `min_capacity`.
    Worked example, counts: loads [3, 0, 1], eps 0.25 -> 1.25 * (4 + 1) / 3 = 2.08, so the replica
    holding 3 is full and the next one in the key's order gets the request.
    """
    live = [load for load, ok in zip(loads, healthy) if ok]
    bound = (1 + epsilon) * (sum(live) + cost) / max(len(live), 1)
    return max(min_capacity, math.ceil(bound / cost) * cost if cost > 0 else bound)


class Router:
    """Picks a replica per request under one policy; unhealthy replicas are never chosen.

    `choose(key, loads, healthy, cost)`: `loads[i]` is replica i's in-flight load (requests, or their
    tokens), `healthy[i]` whether it may take one, `cost` the new request's load (1, or its tokens),
    or per replica (`cost[i]`: its tokens less those replica i likely has cached).
    Prefix-aware takes the first replica in `key`'s rendezvous order that stays within
    `load_capacity` after taking it, so one hot prefix spills onto its second choice (which then
    caches it too) instead of overloading its first; a key of None (a short prompt) goes to the
    least loaded. Raises NoReplicaError when no replica is healthy.
    """

    def __init__(self, policy: RoutingPolicy | str, epsilon: float = 0.25, min_capacity: float = 0.0) -> None:
        self.policy = RoutingPolicy(policy)
        self.epsilon = epsilon
        self.min_capacity = min_capacity
        self._next = 0  # round robin's cursor

    def choose(self, key: bytes | None, loads: Sequence[float], healthy: Sequence[bool],
               cost: float | Sequence[float] = 1.0) -> int:
        live = [i for i, ok in enumerate(healthy) if ok]
        if not live:
            raise NoReplicaError("no replica is healthy")
        if self.policy is RoutingPolicy.ROUND_ROBIN:
            return self._round_robin(len(healthy), healthy)
        if self.policy is RoutingPolicy.LEAST_LOADED or key is None:
            return min(live, key=lambda i: (loads[i], i))
        costs = [float(cost)] * len(loads) if isinstance(cost, (int, float)) else cost
        for replica in preference_order(key, len(healthy)):
            capacity = load_capacity(loads, healthy, self.epsilon, costs[replica], self.min_capacity)
            if healthy[replica] and loads[replica] + costs[replica] <= capacity:
                return replica
        # None within the bound (loads are not whole multiples of this request's cost): the lightest.
        return min(live, key=lambda i: (loads[i], i))

    def _round_robin(self, num_replicas: int, healthy: Sequence[bool]) -> int:
        for _ in range(num_replicas):
            replica = self._next % num_replicas
            self._next = replica + 1
            if healthy[replica]:
                return replica
        raise NoReplicaError("no replica is healthy")


class NoReplicaError(RuntimeError):
    """Every replica is down (dead or restarting)."""
