"""Routing policies: prefix affinity, bounded loads, stability when a replica leaves or returns."""

import random
from collections import Counter

import pytest

from vllmlite.api.ray.routing import (
    DECODE_WEIGHT,
    NoReplicaError,
    Router,
    RoutingPolicy,
    load_capacity,
    preference_order,
    request_cost,
    routing_key,
)
from vllmlite.core.block_manager import BlockManager

BS = 4


def _keys(n: int) -> list[bytes]:
    return [routing_key([i, i + 1, i + 2, i + 3, 7], BS) for i in range(n)]


def test_routing_key_is_the_block_managers_first_block_key():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    tokens = [5, 6, 7, 8, 9, 10]
    assert bm.allocate("a", 0, len(tokens))
    bm.publish_full_blocks("a", tokens, len(tokens), ("salt",))
    first_block = bm.pool.blocks[bm.block_table("a")[0]]
    assert routing_key(tokens, BS, "salt") == first_block.block_key
    assert routing_key(tokens, BS) != first_block.block_key  # the salt separates tenants
    assert routing_key(tokens[:BS - 1], BS) is None


def test_same_prefix_goes_to_same_replica_when_unloaded():
    router = Router(RoutingPolicy.PREFIX_AWARE, min_capacity=4)
    loads, healthy = [0] * 4, [True] * 4
    for key in _keys(20):
        assert len({router.choose(key, loads, healthy) for _ in range(5)}) == 1


def test_keys_spread_over_replicas():
    counts = Counter(preference_order(key, 8)[0] for key in _keys(800))
    assert len(counts) == 8 and max(counts.values()) < 2 * 800 / 8


@pytest.mark.parametrize("burst_epsilon", [0.1, 0.25, 1.0])
def test_one_hot_prefix_never_exceeds_the_in_flight_bound(burst_epsilon):
    """Every request has the same prefix and none finishes: loads stay within ceil((1+eps) * mean)."""
    router = Router(RoutingPolicy.PREFIX_AWARE, burst_epsilon=burst_epsilon)
    loads, healthy = [0] * 8, [True] * 8
    key = _keys(1)[0]
    for m in range(1, 200):
        loads[router.choose(key, loads, healthy)] += 1
        assert max(loads) <= -(-(1 + burst_epsilon) * m // 8), (m, loads)  # ceil((1 + eps) * mean)
    # The hot prefix spilled over enough replicas rather than queueing on one.
    assert sum(load > 0 for load in loads) >= int(8 / (1 + burst_epsilon))


def test_bounded_load_first_choice_is_kept_while_under_capacity():
    router = Router(RoutingPolicy.PREFIX_AWARE, burst_epsilon=0.25, min_capacity=1)
    key = _keys(1)[0]
    first, second = preference_order(key, 3)[:2]
    loads = [1, 1, 1]
    assert router.choose(key, loads, [True] * 3) == first   # cap ceil(1.25 * 4 / 3) = 2
    loads[first] = 3
    assert router.choose(key, loads, [True] * 3) == second  # cap ceil(1.25 * 6 / 3) = 3: full, spill


def _busy_replay(router: Router, keys: list[bytes], num_replicas: int) -> list[Counter]:
    """Route `keys` in turn on a busy cluster (every replica always has one request in flight, so
    only the recent-work bound decides); per key, how many of its requests each replica got."""
    placed = [Counter() for _ in range(max(keys) + 1)]
    key_bytes = _keys(max(keys) + 1)
    for k in keys:
        placed[k][router.choose(key_bytes[k], [1] * num_replicas, [True] * num_replicas)] += 1
    return placed


def test_hot_prefix_spreads_over_its_first_choices_and_cold_ones_stay_home():
    """Half the traffic is one prefix: its recent work would be 4x a replica's share on one of 8
    replicas, so it spreads, in its own rendezvous order, over about the 4 replicas it needs; the
    cold prefixes keep their first choice (the one their replica's cache holds) nearly always."""
    rng = random.Random(1)
    keys = [0 if rng.random() < 0.5 else rng.randrange(1, 40) for _ in range(4000)]
    router = Router(RoutingPolicy.PREFIX_AWARE, epsilon=0.1)
    placed = _busy_replay(router, keys, 8)
    hot = placed[0]
    order = preference_order(_keys(1)[0], 8)
    top = sum(hot[r] for r in order[:5])
    assert 3 <= sum(n > 0.05 * sum(hot.values()) for n in hot.values()) <= 6, hot
    assert top >= 0.9 * sum(hot.values()), (hot, order)
    key_bytes = _keys(40)
    cold_home = sum(placed[k][preference_order(key_bytes[k], 8)[0]] for k in range(1, 40))
    assert cold_home >= 0.6 * sum(sum(placed[k].values()) for k in range(1, 40))
    # The long-run balance the bound keeps: recent work within (1 + eps) x the mean, give or take a request.
    mean = sum(router.recent) / 8
    assert max(router.recent) <= 1.1 * mean + 1, router.recent


def test_idle_replica_keeps_its_prefix_whatever_its_recent_share():
    router = Router(RoutingPolicy.PREFIX_AWARE, epsilon=0.1)
    key = _keys(1)[0]
    first = preference_order(key, 4)[0]
    assert {router.choose(key, [0] * 4, [True] * 4) for _ in range(50)} == {first}
    assert router.recent[first] > 10 * max(router.recent[r] for r in range(4) if r != first)
    busy = [1] * 4
    assert router.choose(key, busy, [True] * 4) != first  # with work in flight the share bound applies


def test_recent_work_decays_by_half_every_half_life():
    router = Router(RoutingPolicy.LEAST_LOADED, half_life=10)
    router.choose(None, [0, 0], [True, True], cost=100.0)  # replica 0
    for _ in range(2 * 10):  # 10 requests per replica, on replica 1
        router.choose(None, [1, 0], [True, True], cost=0.0)
    assert router.recent[0] == pytest.approx(50.0)


def test_request_cost_counts_uncached_prompt_and_weighted_outputs():
    assert request_cost(1000, 960, 10) == 40 + 10 * DECODE_WEIGHT
    assert request_cost(100, 0, 0) == 100.0
    assert request_cost(100, 120, 1) == DECODE_WEIGHT  # a stale hit larger than the prompt counts none


def test_replica_leaving_moves_only_its_own_keys_and_they_return():
    router = Router(RoutingPolicy.PREFIX_AWARE, min_capacity=1000)
    loads = [0] * 6
    keys = _keys(600)
    before = [router.choose(k, loads, [True] * 6) for k in keys]
    down = [True] * 6
    down[2] = False
    during = [router.choose(k, loads, down) for k in keys]
    assert all(d != 2 for d in during)
    moved = [i for i, (b, d) in enumerate(zip(before, during)) if b != d]
    assert moved and all(before[i] == 2 for i in moved)
    assert [router.choose(k, loads, [True] * 6) for k in keys] == before


def test_round_robin_skips_unhealthy_and_cycles():
    router = Router("round_robin")
    healthy = [True, False, True]
    assert [router.choose(None, [0] * 3, healthy) for _ in range(4)] == [0, 2, 0, 2]


def test_least_loaded_and_short_prompts_take_the_lightest_healthy():
    loads, healthy = [3, 0, 1], [True, False, True]
    assert Router("least_loaded").choose(_keys(1)[0], loads, healthy) == 2
    assert Router("prefix_aware").choose(None, loads, healthy) == 2


@pytest.mark.parametrize("policy", list(RoutingPolicy))
def test_no_healthy_replica_raises(policy):
    with pytest.raises(NoReplicaError):
        Router(policy).choose(_keys(1)[0], [0, 0], [False, False])


def test_random_loads_respect_bound_and_health():
    rng = random.Random(0)
    router = Router(RoutingPolicy.PREFIX_AWARE, burst_epsilon=0.25, min_capacity=2)
    for _ in range(500):
        n = rng.randint(1, 9)
        loads = [rng.randint(0, 6) for _ in range(n)]
        healthy = [rng.random() < 0.8 for _ in range(n)]
        if not any(healthy):
            continue
        chosen = router.choose(rng.choice(_keys(50)), loads, healthy)
        assert healthy[chosen]
        cap = load_capacity(loads, healthy, 0.25, 2)
        assert loads[chosen] + 1 <= cap or loads[chosen] == min(x for x, h in zip(loads, healthy) if h)


def test_core_and_single_engine_server_never_import_ray():
    """Ray is an optional extra: the server module, the CLI and routing load without it."""
    import subprocess
    import sys
    code = ("import sys, vllmlite.api.server, vllmlite.api.ray.routing, vllmlite.llm; "
            "sys.exit(1 if any(m == 'ray' or m.startswith('ray.') for m in sys.modules) else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_server_args_replica_knobs():
    from vllmlite.api.cli import ServerArgs, parse_config
    args = parse_config(["--model", "random", "--num-replicas", "3", "--routing", "least_loaded"], {})
    assert (args.num_replicas, args.routing, args.uses_ray) == (3, "least_loaded", True)
    assert parse_config(["--model", "random"], {}).uses_ray is False
    assert parse_config(["--model", "random", "--ray-address", "auto"], {}).uses_ray is True
    replica = args.replica_args()
    assert (replica["num_replicas"], replica["ray_address"], replica["model"]) == (1, None, "random")
    assert ServerArgs(**replica).uses_ray is False
    for bad in (["--num-replicas", "0"], ["--routing", "random"]):
        with pytest.raises(SystemExit):
            parse_config(["--model", "random", *bad], {})
