"""The soak's short form (`bench/soak.py`): a few hundred mixed requests against a server process with a
tiny KV cache, speculative decoding, client disconnects and timeouts; then nothing may be left behind.
The long form is `python -m bench.soak` (10,000 requests). Also unit tests of what the soak calls valid.
"""

from __future__ import annotations

import pytest

from bench.soak import SoakConfig, parse_metrics, run_soak
from bench.soak_client import Choice, Outcome, make_mix, validate

NUM_REQUESTS = 400


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    log_path = tmp_path_factory.mktemp("soak") / "soak.log"
    return run_soak(SoakConfig(num_requests=NUM_REQUESTS, concurrency=16, seed=1, checkpoint_every=100,
                               log_path=log_path), command="tests/test_soak.py")


@pytest.mark.soak
def test_soak_leaves_nothing_behind_and_every_answer_checks_out(report):
    failed = {name: ok for name, ok in report["checks"].items() if not ok}
    assert not failed, (failed, report["counts"], report["rss_mib"], report["invalid"][:5],
                        report["alone"]["greedy"]["mismatches"][:3], report["shutdown"])
    client = report["counts"]["client"]
    assert sum(client.values()) == NUM_REQUESTS
    # The mix really cut requests short both ways, and enough greedy answers were re-run alone. How
    # many of the ~5% given a 0.01-0.4 s read timeout outlast it depends on the machine's speed (4 of
    # 400 on this project's 2-core AMD EPYC when quiet, more under load), so only that some did is asserted.
    assert client["disconnected"] > 0.1 * NUM_REQUESTS and client["timed_out"] > 0
    assert report["counts"]["admitted_then_cut"] > 0
    assert report["alone"]["greedy"]["checked"] > 0.2 * NUM_REQUESTS


def test_the_mix_is_seeded_and_mixed():
    mix = make_mix(400, seed=3)
    assert [r.body for r in mix] == [r.body for r in make_mix(400, seed=3)]
    bodies = [r.body for r in mix]
    assert {b["n"] for b in bodies} == {1, 2, 3, 4}
    assert {r.route for r in mix} == {"completions", "chat"}
    for feature in ("stop", "seed", "stream", "stream_options", "return_tokens_as_token_ids"):
        assert 0 < sum(feature in b for b in bodies) < len(bodies), feature
    assert 0.3 < sum(r.is_greedy for r in mix) / len(mix) < 0.7
    fates = [r.fate for r in mix]
    assert 0.12 < fates.count("disconnect") / len(mix) < 0.28 and 0.01 < fates.count("timeout") / len(mix) < 0.1


def test_validate_rejects_wrong_choices_stop_strings_and_lengths():
    request = next(r for r in make_mix(400, seed=3) if r.body["n"] == 2 and "stop" in r.body
                   and "return_tokens_as_token_ids" in r.body)
    stop, max_tokens = request.body["stop"][0], request.body["max_tokens"]
    good = Outcome(request.index, "completed", 200, True,
                   {0: Choice("a", "stop", [97], 1), 1: Choice("b", "stop", [98], 1)}, completion_tokens=2)
    assert validate(request, good) == []
    bad = Outcome(request.index, "completed", 200, True,
                  {0: Choice("x" + stop, "stop", [1, 2], 2),
                   1: Choice("b", "length", [98], 1)}, completion_tokens=2 * max_tokens + 1)
    problems = " | ".join(validate(request, bad))
    assert "stop string" in problems and "finish length" in problems and "usage" in problems
    assert validate(request, Outcome(request.index, "completed", choices={0: Choice("a", "abort")})) != []


def test_parse_metrics_reads_labelled_samples():
    text = ('# TYPE vllmlite:request_success_total counter\n'
            'vllmlite:request_success_total{model_name="random",finished_reason="stop"} 3.0\n'
            'vllmlite:kv_cache_usage_perc{model_name="random"} 0.0\n'
            'vllmlite:e2e_request_latency_seconds_bucket{model_name="random",le="0.1"} 2.0\n')
    assert parse_metrics(text) == {'request_success_total{finished_reason="stop"}': 3.0,
                                   "kv_cache_usage_perc": 0.0}
