"""Routing simulator: a multi-tenant trace replayed against N modelled replicas, each with a real
BlockManager, under prefix-aware, round-robin and least-loaded routing.

    python -m bench.route_sim --variants # N = 2..64, 3 policies, + variants at 16: about 5 minutes
    python -m bench.route_sim --quick    # a small smoke run (for the tests)

The trace: `tenants` tenants, each with its own system prompt (512-2048 random tokens), followed by
a short user suffix (16-128 tokens) and 32-128 decoded tokens; the tenant of each request is
Zipf-distributed (exponent 1.0: a few hot tenants, a long tail); arrivals are Poisson. A replica is
`lanes` parallel servers (continuous batching, modelled as concurrent requests at full speed) over
one `BlockManager` of `--blocks` blocks of 16 tokens (default 512: 8k tokens, 360 MiB of
SmolLM2-135M's float32 KV; a tenth of the 64 system prompts, about 82k tokens, so caches evict):
a request starting service looks up its prefix hit and allocates its
blocks exactly as the scheduler does, publishes its prompt's full blocks, and frees them when done
(cached blocks stay in the LRU until evicted). Its service time is `prefill_cost` per uncached prompt
token plus `decode_cost` per output token. The arrival rate is set so round robin without any cache
hit would keep the cluster `utilization` busy. The router is vllmlite.api.ray.routing.Router, seeing what
the Ray ingress sees: each request's cost (`request_cost`: its prompt less the hit that replica
reported for the prefix's last request, plus the clients' max_tokens, 128), each replica's
in-flight costs and health.

Reported per (N, policy), over the trace after its first `warmup` fraction: the prefix hit rate
(hit prompt tokens / prompt tokens, vLLM's prefix_cache_hits / queries), prefill tokens saved, the
load imbalance (busiest replica's busy time / the mean), and latency (queueing + service). Raw
results: results/bench_route_sim.json; plot: results/route_sim.png.
"""

from __future__ import annotations

import argparse
import heapq
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from bench.report import REPO_ROOT, machine_info, module_command, write_json
from vllmlite.api.ray.routing import Router, RoutingPolicy, request_cost, routing_key
from vllmlite.core.block_manager import BlockManager

BLOCK_SIZE = 16
VOCAB = 49152
POLICIES = [p.value for p in RoutingPolicy]


@dataclass(frozen=True)
class TraceRequest:
    arrival: float
    tenant: int
    token_ids: list[int]
    num_output_tokens: int


@dataclass(frozen=True)
class SimConfig:
    tenants: int = 64
    num_requests: int = 6000
    zipf: float = 1.0
    blocks: int = 512
    lanes: int = 4
    prefill_cost: float = 1.0   # time units per uncached prompt token
    decode_cost: float = 4.0    # time units per output token
    utilization: float = 0.7
    warmup: float = 0.2
    max_tokens: int = 128       # the clients' max_tokens: the most a request may decode (it decodes 32-128)
    epsilon: float = 0.1        # the router's bound on a replica's share of recent work
    burst_epsilon: float = 2.0  # the router's bound on a replica's in-flight load
    half_life: float = 50.0     # requests per replica over which the router's recent work halves
    min_capacity: float = 0.0   # the router's floor on a replica's capacity (in load units)
    load: str = "work"          # what the router balances: "work" (request_cost: uncached prompt tokens as the
    # replica reported for the prefix's last request, plus max_tokens x DECODE_WEIGHT: the ingress's signal),
    # "tokens" (prompt + max_tokens) or "requests"
    seed: int = 0


def make_trace(cfg: SimConfig, num_replicas: int) -> list[TraceRequest]:
    """The same tenants and request sequence for every N and policy; only the arrival rate scales
    with N (so each replica sees the same offered load)."""
    rng = random.Random(cfg.seed)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(512, 2048))] for _ in range(cfg.tenants)]
    weights = [1.0 / (rank + 1) ** cfg.zipf for rank in range(cfg.tenants)]
    tenants = rng.choices(range(cfg.tenants), weights, k=cfg.num_requests)
    suffixes = [[rng.randrange(VOCAB) for _ in range(rng.randint(16, 128))] for _ in tenants]
    outputs = [rng.randint(32, 128) for _ in tenants]
    mean_work = sum(len(prompts[t]) + len(s) for t, s in zip(tenants, suffixes)) / len(tenants) * cfg.prefill_cost \
        + sum(outputs) / len(outputs) * cfg.decode_cost
    rate = cfg.utilization * num_replicas * cfg.lanes / mean_work  # requests per time unit
    trace, now = [], 0.0
    for tenant, suffix, num_out in zip(tenants, suffixes, outputs):
        now += rng.expovariate(rate)
        trace.append(TraceRequest(now, tenant, prompts[tenant] + suffix, num_out))
    return trace


@dataclass
class SimReplica:
    manager: BlockManager
    queue: deque = field(default_factory=deque)
    num_running: int = 0
    busy_time: float = 0.0
    num_requests: int = 0
    load: float = 0.0  # the router's view: the in-flight requests' costs
    last_hit: int = 0  # the prefix hit of the request started last, in tokens


def _cost(cfg: SimConfig, req: TraceRequest, reported_hit: int) -> float:
    """A request's load as the router counts it: before it runs, the router knows its prompt, the
    client's max_tokens and the prefix hit the replica reported for this prefix's last request (the
    ingress sees it in the outputs' num_cached_tokens)."""
    if cfg.load == "requests":
        return 1.0
    if cfg.load == "tokens":
        return float(len(req.token_ids) + cfg.max_tokens)
    return request_cost(len(req.token_ids), reported_hit, cfg.max_tokens)


@dataclass
class Totals:
    prompt_tokens: int = 0
    hit_tokens: int = 0
    latencies: list[float] = field(default_factory=list)


def simulate(cfg: SimConfig, trace: list[TraceRequest], num_replicas: int, policy: str) -> dict:
    """Replay `trace` on `num_replicas` replicas routed by `policy`; the measured figures."""
    replicas = [SimReplica(BlockManager(cfg.blocks, BLOCK_SIZE, enable_prefix_caching=True))
                for _ in range(num_replicas)]
    router = Router(policy, epsilon=cfg.epsilon, burst_epsilon=cfg.burst_epsilon, half_life=cfg.half_life,
                    min_capacity=cfg.min_capacity)
    healthy = [True] * num_replicas
    measured_from = int(cfg.warmup * len(trace))
    totals = Totals()
    events: list[tuple[float, int, int, int]] = []  # (time, order, kind 0 arrive / 1 finish, index)
    for i, req in enumerate(trace):
        heapq.heappush(events, (req.arrival, i, 0, i))
    order, placement, request_costs = len(trace), {}, {}
    hits: dict[int, int] = {}  # request -> its prefix hit, in tokens (the engine's num_cached_tokens)
    reported: dict[tuple[int, bytes | None], int] = {}  # (replica, key) -> the hit its last request reported
    while events:
        now, _, kind, index = heapq.heappop(events)
        if kind == 0:
            req = trace[index]
            key = routing_key(req.token_ids, BLOCK_SIZE)
            costs = [_cost(cfg, req, reported.get((i, key), 0)) for i in range(num_replicas)]
            chosen = router.choose(key, [r.load for r in replicas], healthy, costs)
            replicas[chosen].load += costs[chosen]
            request_costs[index] = costs[chosen]
            placement[index] = chosen
            replicas[chosen].queue.append(index)
        else:
            replica = replicas[placement[index]]
            replica.manager.free(str(index))
            replica.num_running -= 1
            replica.load -= request_costs.pop(index)
            reported[(placement[index], routing_key(trace[index].token_ids, BLOCK_SIZE))] = hits[index]
            totals.latencies.append(now - trace[index].arrival) if index >= measured_from else None
        replica = replicas[placement[index]]
        while replica.queue and replica.num_running < cfg.lanes:
            started = replica.queue[0]
            service = _start(cfg, replica, trace[started], str(started), totals if started >= measured_from else None)
            if service is None:  # too few free blocks until a running request finishes (as the scheduler)
                break
            hits[started] = replica.last_hit
            replica.queue.popleft()
            if started >= measured_from:
                replica.busy_time += service
                replica.num_requests += 1
            order += 1
            heapq.heappush(events, (now + service, order, 1, started))
    return _figures(cfg, replicas, totals)


def _start(cfg: SimConfig, replica: SimReplica, req: TraceRequest, request_id: str,
           totals: Totals | None) -> float | None:
    """Admit one request as the scheduler does: prefix hit, allocate, publish. Its service time, or
    None (nothing changed) when its blocks do not fit beside the running requests'."""
    manager = replica.manager
    hit = manager.find_prefix_hit(req.token_ids)
    num_tokens = len(req.token_ids) + req.num_output_tokens
    if not manager.allocate(request_id, hit.num_tokens, num_tokens, hit):
        if replica.num_running == 0:
            raise RuntimeError(f"{num_tokens} tokens cannot fit in a replica's {cfg.blocks} blocks")
        return None
    replica.num_running += 1
    manager.take_copies()
    manager.record_prefix_lookup(len(req.token_ids), hit)
    replica.last_hit = hit.num_tokens
    manager.publish_full_blocks(request_id, req.token_ids, len(req.token_ids))
    if totals is not None:
        totals.prompt_tokens += len(req.token_ids)
        totals.hit_tokens += hit.num_tokens
    return (len(req.token_ids) - hit.num_tokens) * cfg.prefill_cost + req.num_output_tokens * cfg.decode_cost


def _figures(cfg: SimConfig, replicas: list[SimReplica], totals: Totals) -> dict:
    busy = [r.busy_time for r in replicas]
    served = [r.num_requests for r in replicas]
    latencies = sorted(totals.latencies)
    mean_busy = sum(busy) / len(busy)
    return {
        "prefix_hit_rate": totals.hit_tokens / totals.prompt_tokens,
        "prefill_tokens": totals.prompt_tokens, "prefill_tokens_saved": totals.hit_tokens,
        "load_imbalance": max(busy) / mean_busy if mean_busy else None,
        "request_imbalance": max(served) / (sum(served) / len(served)),
        "latency_mean": sum(latencies) / len(latencies), "latency_p99": latencies[int(0.99 * (len(latencies) - 1))],
        "busy_time": busy, "requests_served": served,
    }


def run(cfg: SimConfig, replica_counts: list[int], policies: list[str]) -> list[dict]:
    rows = []
    for num_replicas in replica_counts:
        trace = make_trace(cfg, num_replicas)
        for policy in policies:
            started = time.perf_counter()
            row = {"num_replicas": num_replicas, "policy": policy, **simulate(cfg, trace, num_replicas, policy)}
            row["sim_seconds"] = time.perf_counter() - started
            rows.append(row)
            print(f"N {num_replicas:3d} {policy:13s} hit {row['prefix_hit_rate']:6.1%}  "
                  f"imbalance {row['load_imbalance']:5.2f}  p99 latency {row['latency_p99']:9.0f}  "
                  f"({row['sim_seconds']:.1f} s)", file=sys.stderr)
    return rows


def check_target(rows: list[dict], num_replicas: int = 16) -> dict | None:
    """The issue's target at 16 replicas: prefix-aware hit rate >= 2x round robin's, and its busiest
    replica <= 1.3x the mean load."""
    by_policy = {r["policy"]: r for r in rows if r["num_replicas"] == num_replicas}
    if not {"prefix_aware", "round_robin"} <= set(by_policy):
        return None
    aware, rr = by_policy["prefix_aware"], by_policy["round_robin"]
    ratio = aware["prefix_hit_rate"] / rr["prefix_hit_rate"] if rr["prefix_hit_rate"] else float("inf")
    return {"num_replicas": num_replicas, "hit_rate_ratio": ratio, "hit_rate_ratio_met": ratio >= 2.0,
            "load_imbalance": aware["load_imbalance"], "load_imbalance_met": aware["load_imbalance"] <= 1.3}


VARIANTS = {  # name -> SimConfig overrides
    "in-flight bound only (eps 0.25), tokens: the first router": {"epsilon": 1e9, "burst_epsilon": 0.25,
                                                                  "load": "tokens"},
    "in-flight bound only (eps 0.25), work": {"epsilon": 1e9, "burst_epsilon": 0.25},
    "recent-work bound, eps 0.25": {"epsilon": 0.25},
    "recent-work bound, load in tokens": {"load": "tokens"},
    "recent-work bound, load in requests": {"load": "requests"},
    "output token served in 2 prompt tokens' time (router assumes 4)": {"decode_cost": 2.0},
    "output token served in 8 prompt tokens' time (router assumes 4)": {"decode_cost": 8.0},
}


def run_variants(cfg: SimConfig, num_replicas: int = 16) -> list[dict]:
    """Prefix-aware routing at `num_replicas` under other bounds, load signals and service costs:
    what each part of the router buys, and how much a wrong DECODE_WEIGHT costs."""
    rows = []
    for name, overrides in VARIANTS.items():
        variant = SimConfig(**{**vars(cfg), **overrides})
        row = simulate(variant, make_trace(variant, num_replicas), num_replicas, "prefix_aware")
        rows.append({"variant": name, "overrides": overrides, **row})
        print(f"N {num_replicas} prefix_aware, {name}: hit {row['prefix_hit_rate']:6.1%}  "
              f"imbalance {row['load_imbalance']:5.2f}", file=sys.stderr)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("prefix_hit_rate", "prefix hit rate"), ("load_imbalance", "busiest replica / mean load"),
              ("latency_p99", "p99 latency (time units)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 4.2))
    for ax, (metric, label) in zip(axes, panels):
        for policy in POLICIES:
            points = [(r["num_replicas"], r[metric]) for r in rows if r["policy"] == policy]
            if points:
                ax.plot(*zip(*points), marker="o", label=policy)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("replicas")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("Routing across replicas: multi-tenant trace, real BlockManager per replica (bench/route_sim.py)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small trace and few replica counts")
    parser.add_argument("--replicas", default=None, help="comma-separated replica counts (default 2,4,...,64)")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated routing policies")
    parser.add_argument("--variants", action="store_true",
                        help="also prefix-aware at 16 replicas under other load signals and bounds")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    for name, default in vars(SimConfig()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=None)
    args = parser.parse_args(argv)
    overrides = {k: getattr(args, k) for k in vars(SimConfig()) if getattr(args, k) is not None}
    if args.quick:
        overrides = {"tenants": 8, "num_requests": 300, "blocks": 512, **overrides}
    cfg = SimConfig(**overrides)
    counts = [int(n) for n in args.replicas.split(",")] if args.replicas else ([2, 4] if args.quick
                                                                                 else [2, 4, 8, 16, 32, 64])
    rows = run(cfg, counts, args.policies.split(","))
    report = {"machine": machine_info(), "command": module_command("bench.route_sim", argv),
              "config": vars(cfg), "block_size": BLOCK_SIZE, "rows": rows, "target_16": check_target(rows),
              "variants_16": run_variants(cfg) if args.variants else None}
    suffix = "_quick" if args.quick else ""
    write_json(args.out or REPO_ROOT / "results" / f"bench_route_sim{suffix}.json", report)
    plot(rows, args.plot or REPO_ROOT / "results" / f"route_sim{suffix}.png")
    if report["target_16"] is not None:
        print(f"target at 16 replicas: {report['target_16']}", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
