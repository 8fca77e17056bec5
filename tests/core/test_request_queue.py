"""Admission order: preempted first, then priority, then round-robin across clients, then arrival."""

from __future__ import annotations

import numpy as np
from conftest import greedy, make_prompts

from vllmlite.core.request import Request
from vllmlite.core.request_queue import WaitingQueue
from vllmlite.sampling_params import SamplingParams


def make_request(request_id: str, client: str | None = None, priority: int = 0, arrival: float = 0.0) -> Request:
    return Request(request_id, [1, 2, 3], SamplingParams(), 4, np.random.default_rng(0), arrival_time=arrival,
                   priority=priority, client_id=client)


def drain(queue: WaitingQueue) -> list[str]:
    return [queue.pop().request_id for _ in range(len(queue))]


def test_lower_priority_value_first_then_arrival():
    queue = WaitingQueue()
    for rid, priority, arrival in [("a", 1, 0.0), ("b", 0, 1.0), ("c", 1, 2.0), ("d", 0, 3.0)]:
        queue.add(make_request(rid, priority=priority, arrival=arrival))
    assert drain(queue) == ["b", "d", "a", "c"]


def test_a_flooding_client_cannot_starve_another():
    queue = WaitingQueue()
    for i in range(10):
        queue.add(make_request(f"flood{i}", client="A", arrival=float(i)))
    queue.add(make_request("b0", client="B", arrival=10.0))
    queue.add(make_request("b1", client="B", arrival=11.0))
    order = drain(queue)
    assert order[:4] == ["flood0", "b0", "flood1", "b1"]  # turns alternate while both wait
    assert order[4:] == [f"flood{i}" for i in range(2, 10)]


def test_priority_beats_round_robin_and_preempted_requests_come_first():
    queue = WaitingQueue()
    queue.add(make_request("a-low", client="A", priority=5, arrival=0.0))
    queue.add(make_request("b-high", client="B", priority=0, arrival=1.0))
    queue.push_front(make_request("resumed", client="C", priority=9, arrival=2.0))
    assert drain(queue) == ["resumed", "b-high", "a-low"]


def test_remove_and_len_and_iteration_agree():
    queue = WaitingQueue()
    requests = [make_request(f"r{i}", client=f"c{i % 3}") for i in range(6)]
    for r in requests:
        queue.add(r)
    assert queue.remove(requests[2]) and not queue.remove(requests[2])
    assert len(queue) == 5 and {r.request_id for r in queue} == {f"r{i}" for i in (0, 1, 3, 4, 5)}


def test_engine_admits_a_second_client_before_a_flooders_backlog(make_engine):
    engine = make_engine(max_num_seqs=1)
    prompts = make_prompts(6, seed=30, min_len=3, max_len=6)
    for i, p in enumerate(prompts[:5]):
        engine.add_request(f"A{i}", p, greedy(2), client_id="A")
    engine.add_request("B0", prompts[5], greedy(2), client_id="B")
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished.index("B0") <= 2  # not behind all of A's backlog
    assert len(finished) == 6


def test_a_client_trickling_one_request_at_a_time_takes_turns_with_a_flooder():
    queue = WaitingQueue()
    for i in range(5):
        queue.add(make_request(f"A{i}", client="A", arrival=float(i)))
    order = []
    for step in range(6):
        queue.add(make_request(f"B{step}", client="B", arrival=10.0 + step))  # B always has one waiting
        order.append(queue.pop().request_id[0])
        if order[-1] == "A":
            queue.remove(next(r for r in queue if r.client_id == "B"))  # keep exactly one B waiting
    assert order.count("A") >= 2 and order.count("B") >= 2


def test_turn_memory_stays_bounded():
    queue = WaitingQueue()
    for i in range(200):
        queue.add(make_request(f"r{i}", client=f"client{i}"))
        queue.pop()
    assert len(queue._last_turn) <= 1
