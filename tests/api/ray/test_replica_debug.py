"""Merging the replicas' /v1/stats and /debug/* answers behind the Ray ingress (replica_debug.py),
without Ray: counts sum, rates come from the sums, percentiles are the worst replica's, requests
keep the single-engine order and name their replica, and a replica that did not answer is named.
(tests/test_ray_serving.py checks the same routes through a real ingress.)"""

from __future__ import annotations

from dataclasses import asdict

import pytest

from vllmlite.api.ops.protocol_debug import ReplicasDebugEngineResponse, RequestDetail, RequestList, StatsResponse
from vllmlite.api.ray.replica_debug import (
    ReplicaAnswers,
    engines_payload,
    find_request,
    merge_latency,
    merge_request_lists,
    merge_stats,
)
from vllmlite.stats import ChunkingStats


def _stats(*, running=0, waiting=0, swapped=0, kv=(0, 0, 0, 0), prefix=(0, 0), preemptions=0, tokens=(0, 0),
           requests=(0, 0), latency=(None, None, None, None, 0), spec=(0, 0)) -> dict:
    """One engine's /v1/stats payload (the single-engine shape), rates from its own counts."""
    total, used, cached, free = kv
    (queries, hits), (drafts, accepted) = prefix, spec
    return {"model": "m", "time": 1.0, "num_running": running, "num_waiting": waiting, "num_swapped": swapped,
            "kv_blocks": {"total": total, "used": used, "cached": cached, "free": free},
            "kv_cache_usage": used / total if total else 0.0,
            "prefix_cache": {"queries": queries, "hits": hits, "hit_rate": hits / queries if queries else 0.0},
            "num_preemptions": preemptions, "tokens": {"prompt": tokens[0], "generation": tokens[1]},
            "requests": {"finished": requests[0], "aborted": requests[1]},
            "latency": dict(zip(("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90", "window"), latency)),
            "spec_decode": {"num_draft_tokens": drafts, "num_accepted_tokens": accepted,
                            "acceptance_rate": accepted / drafts if drafts else 0.0}}


def _summary(request_id: str, state: str, arrival: float, finish: float | None = None) -> dict:
    return {"request_id": request_id, "state": state, "arrival_time": arrival, "first_token_time": None,
            "finish_time": finish, "ttft": None, "e2e": None, "num_prompt_tokens": 3, "num_output_tokens": 0,
            "num_cached_tokens": 0, "num_preemptions": 0, "finish_reason": None}


def test_stats_counts_are_sums_and_rates_come_from_the_sums():
    a = _stats(running=2, waiting=1, kv=(100, 40, 10, 60), prefix=(300, 0), preemptions=1, tokens=(500, 50),
               requests=(5, 1), latency=(0.1, 0.4, 0.01, 0.02, 5), spec=(10, 9))
    b = _stats(running=1, swapped=2, kv=(100, 10, 30, 90), prefix=(100, 100), tokens=(200, 20), requests=(2, 0),
               latency=(0.3, 0.35, None, None, 2), spec=(30, 3))
    merged = merge_stats("m", ReplicaAnswers([(0, a), (1, b)], [(2, "no answer within 5 s")]), now=7.0)
    StatsResponse.model_validate(merged)
    assert (merged["num_running"], merged["num_waiting"], merged["num_swapped"]) == (3, 1, 2)
    assert merged["kv_blocks"] == {"total": 200, "used": 50, "cached": 40, "free": 150}
    assert merged["kv_cache_usage"] == 0.25
    assert merged["prefix_cache"] == {"queries": 400, "hits": 100, "hit_rate": 0.25}  # not the mean of 0 and 1
    assert merged["spec_decode"] == {"num_draft_tokens": 40, "num_accepted_tokens": 12, "acceptance_rate": 0.3}
    assert merged["num_preemptions"] == 1 and merged["tokens"] == {"prompt": 700, "generation": 70}
    assert merged["requests"] == {"finished": 7, "aborted": 1}
    assert merged["latency"] == {"ttft_p50": 0.3, "ttft_p90": 0.4, "tpot_p50": 0.01, "tpot_p90": 0.02, "window": 7}
    assert merged["time"] == 7.0 and merged["model"] == "m"
    assert [r["replica"] for r in merged["replicas"]] == [0, 1]
    assert merged["replicas"][1]["prefix_cache"]["hit_rate"] == 1.0  # each replica's own numbers, unchanged
    assert merged["missing_replicas"] == [{"replica": 2, "error": "no answer within 5 s"}]


def test_stats_of_one_replica_are_its_own_numbers():
    one = _stats(running=3, kv=(64, 8, 4, 56), prefix=(48, 16), tokens=(90, 9), latency=(0.2, 0.5, 0.03, 0.04, 9))
    merged = merge_stats("m", ReplicaAnswers([(1, one)]), now=2.0)
    own = {key: value for key, value in merged.items() if key not in ("time", "replicas", "missing_replicas")}
    assert own == {key: value for key, value in one.items() if key != "time"}
    assert merged["missing_replicas"] == []


@pytest.mark.parametrize("p90s, expected", [((None, None), None), ((0.2, None), 0.2), ((0.2, 0.7), 0.7)])
def test_a_merged_percentile_is_the_worst_replica_that_has_one(p90s, expected):
    latencies = [{"ttft_p50": None, "ttft_p90": p90, "tpot_p50": None, "tpot_p90": None, "window": 1} for p90 in p90s]
    assert merge_latency(latencies) == {"ttft_p50": None, "ttft_p90": expected, "tpot_p50": None, "tpot_p90": None,
                                        "window": 2}


def test_request_lists_merge_live_oldest_first_then_ended_newest_first_with_their_replica():
    replica0 = {"requests": [_summary("a", "running", 5.0), _summary("b", "finished", 1.0, finish=4.0),
                             _summary("c", "aborted", 1.5, finish=2.0)]}
    replica1 = {"requests": [_summary("d", "waiting", 3.0), _summary("e", "finished", 2.5, finish=3.0)]}
    merged = merge_request_lists(ReplicaAnswers([(0, replica0), (1, replica1)], [(2, "down (killed)")]))
    RequestList.model_validate(merged)
    assert [(r["request_id"], r["replica"]) for r in merged["requests"]] == [
        ("d", 1), ("a", 0), ("b", 0), ("e", 1), ("c", 0)]
    assert merged["missing_replicas"] == [{"replica": 2, "error": "down (killed)"}]


def test_a_request_is_found_on_the_replica_that_has_it():
    detail = {**_summary("x", "finished", 1.0, finish=2.0), "events": [{"time": 1.0, "event": "arrived"}],
              "num_dropped_events": 0}
    found = find_request(ReplicaAnswers([(0, None), (1, detail)]))
    assert RequestDetail.model_validate(found).replica == 1 and found["events"] == detail["events"]
    assert find_request(ReplicaAnswers([(0, None), (1, None)])) is None


def test_debug_engine_is_one_payload_per_replica():
    def engine(num_blocks: int) -> dict:
        stats = _stats(kv=(num_blocks, 1, 0, num_blocks - 1))
        return {**stats, "blocks": [1] + [0] * (num_blocks - 1), "recent_steps": [],
                "chunking": asdict(ChunkingStats("fixed")), "config": {"model": "m"}}
    payload = engines_payload("m", ReplicaAnswers([(0, engine(4)), (1, engine(8))], [(2, "down (gone)")]), now=3.0)
    shaped = ReplicasDebugEngineResponse.model_validate(payload)
    assert [(r.replica, len(r.blocks)) for r in shaped.replicas] == [(0, 4), (1, 8)]
    assert [m.replica for m in shaped.missing_replicas] == [2] and shaped.model == "m"


def test_missing_replicas_are_described_for_error_messages():
    replies = ReplicaAnswers([], [(0, "down (killed)"), (1, "no answer within 5 s")])
    assert replies.describe_missing() == "replica 0: down (killed); replica 1: no answer within 5 s"
    assert ReplicaAnswers([(0, {})]).describe_missing() == ""
