"""/v1/stats and /debug/* behind the Ray ingress: merging the replicas' answers into one.

Each replica answers with the single-engine payload of the route (its engine's named read,
engine/inspection.py, run by `EngineReplica.inspect`); this module owns how those payloads combine,
in the shapes of protocol_debug.py. Pure functions on plain dicts: knows nothing of Ray, HTTP or the
engine.

Merging rules. Counts (queues, KV blocks, prefix-cache tokens, preemptions, tokens, requests,
speculative tokens) are sums over the replicas that answered; rates (KV usage, prefix hit rate,
acceptance rate) are recomputed from the sums, never averaged. Latency: a replica reports only its
percentiles, not its raw window, so each merged percentile is the largest replica's, an upper bound
on that percentile over all their requests together (at most 10% of each replica's requests lie
above its p90, so at most 10% of all lie above the largest p90); `window` is the sum.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

LIVE_STATES = ("waiting", "running", "swapped")
LATENCY_KEYS = ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90")


@dataclass(frozen=True)
class ReplicaAnswers:
    """One read of every replica: who answered what, and who did not and why."""

    answers: list[tuple[int, Any]] = field(default_factory=list)  # (replica index, its payload), by index
    missing: list[tuple[int, str]] = field(default_factory=list)  # (replica index, why it gave none)

    def missing_payload(self) -> list[dict[str, Any]]:
        return [{"replica": index, "error": error} for index, error in self.missing]

    def describe_missing(self) -> str:
        """'replica 1: down (...); ...', or '' when every replica answered."""
        return "; ".join(f"replica {index}: {error}" for index, error in self.missing)


def merge_answers(read: str, model_name: str, replies: ReplicaAnswers, now: float) -> Any:
    """The merged payload of the named read `read` (engine.client.INSPECT_READS)."""
    if read == "stats":
        return merge_stats(model_name, replies, now)
    if read == "requests":
        return merge_request_lists(replies)
    if read == "request":
        return find_request(replies)
    if read == "engine":
        return engines_payload(model_name, replies, now)
    raise ValueError(f"unknown read {read!r}")


def merge_stats(model_name: str, replies: ReplicaAnswers, now: float) -> dict[str, Any]:
    """/v1/stats over the replicas: the single-engine shape with every count summed, plus
    `replicas` (each answer with its `replica` index) and `missing_replicas`. Rates come from the
    sums: 30 queried tokens with 10 hits and 10 with 10 merge to 40 with 20, a hit rate of 0.5.
    """
    payloads = [payload for _, payload in replies.answers]

    def total(section: str, key: str) -> int:
        return sum(p[section][key] for p in payloads)

    kv = {key: total("kv_blocks", key) for key in ("total", "used", "cached", "free")}
    queries, hits = total("prefix_cache", "queries"), total("prefix_cache", "hits")
    drafts, accepted = total("spec_decode", "num_draft_tokens"), total("spec_decode", "num_accepted_tokens")
    return {
        "model": model_name, "time": now,
        **{key: sum(p[key] for p in payloads) for key in ("num_running", "num_waiting", "num_swapped")},
        "kv_blocks": kv,
        "kv_cache_usage": _rate(kv["used"], kv["total"]),
        "prefix_cache": {"queries": queries, "hits": hits, "hit_rate": _rate(hits, queries)},
        "num_preemptions": sum(p["num_preemptions"] for p in payloads),
        "tokens": {key: total("tokens", key) for key in ("prompt", "generation")},
        "requests": {key: total("requests", key) for key in ("finished", "aborted")},
        "latency": merge_latency([p["latency"] for p in payloads]),
        "spec_decode": {"num_draft_tokens": drafts, "num_accepted_tokens": accepted,
                        "acceptance_rate": _rate(accepted, drafts)},
        "replicas": [{**payload, "replica": index} for index, payload in replies.answers],
        "missing_replicas": replies.missing_payload(),
    }


def merge_latency(latencies: list[dict[str, Any]]) -> dict[str, Any]:
    """Each percentile the largest replica's (None when no replica has one); `window` summed.

    >>> merge_latency([{"ttft_p50": 0.1, "ttft_p90": 0.5, "tpot_p50": None, "tpot_p90": None, "window": 3},
    ...                {"ttft_p50": 0.2, "ttft_p90": 0.3, "tpot_p50": None, "tpot_p90": None, "window": 1}])
    {'ttft_p50': 0.2, 'ttft_p90': 0.5, 'tpot_p50': None, 'tpot_p90': None, 'window': 4}
    """
    merged: dict[str, Any] = {}
    for key in LATENCY_KEYS:
        values = [latency[key] for latency in latencies if latency[key] is not None]
        merged[key] = max(values) if values else None
    merged["window"] = sum(latency["window"] for latency in latencies)
    return merged


def merge_request_lists(replies: ReplicaAnswers) -> dict[str, Any]:
    """/debug/requests over the replicas, in the single-engine order: live requests oldest first,
    then finished (or aborted) ones newest first; each summary with its `replica`."""
    summaries = [{**summary, "replica": index} for index, answer in replies.answers for summary in answer["requests"]]
    live = sorted((s for s in summaries if s["state"] in LIVE_STATES), key=lambda s: s["arrival_time"])
    ended = sorted((s for s in summaries if s["state"] not in LIVE_STATES),
                   key=lambda s: s["arrival_time"] if s["finish_time"] is None else s["finish_time"], reverse=True)
    return {"requests": live + ended, "missing_replicas": replies.missing_payload()}


def find_request(replies: ReplicaAnswers) -> dict[str, Any] | None:
    """/debug/requests/{id}: the detail from the replica that has the trace (ids are unique to the
    ingress, so at most one has it), with its `replica`; None when no replica that answered has it."""
    for index, detail in replies.answers:
        if detail is not None:
            return {**detail, "replica": index}
    return None


def engines_payload(model_name: str, replies: ReplicaAnswers, now: float) -> dict[str, Any]:
    """/debug/engine over the replicas: each replica's own /debug/engine with its `replica` index
    (blocks are per replica: block ids are not shared between replicas)."""
    return {"model": model_name, "time": now,
            "replicas": [{**payload, "replica": index} for index, payload in replies.answers],
            "missing_replicas": replies.missing_payload()}


def _rate(part: int, whole: int) -> float:
    return part / whole if whole else 0.0

